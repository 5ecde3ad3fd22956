"""The forward pass on the native kernels (kernels.c's specdec_forward), with static KV per slot in numpy."""
from __future__ import annotations

import ctypes
import functools

import numpy as np

from specdec.errors import BackendError
from specdec.lowering import Geometry
from specdec.manifest import ModelDims
from specdec.native.weights import BLOCK, BLOCK4, BLOCK4P, NativeWeights, q41_pairs

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
LINEARS = ("qkv", "o", "gate_up", "down")


class ModelStruct(ctypes.Structure):
    """kernels.c's model_t."""
    _fields_ = [("L", _I), ("H", _I), ("Hq", _I), ("Hkv", _I), ("D", _I), ("I", _I), ("V", _I), ("eps", _F),
                ("scale", _F), ("embedding", _P), ("in_norm", _P), ("post_norm", _P), ("qkv", _P), ("o", _P),
                ("gate_up", _P), ("down", _P), ("qkv_p", _P), ("o_p", _P), ("gate_up_p", _P), ("down_p", _P),
                ("final_norm", _P), ("head", _P), ("cos", _P), ("sin", _P), ("embedding_rows", _P)]


def _pointers(arrays: list) -> np.ndarray:
    return np.array([a.ctypes.data for a in arrays], dtype=np.uintp)


class NativeModel:
    """Also a KV source for the gqa driver's copy_kv (a draft taking this target's KV): `geometry` and `buffers`,
    the per-layer keys then values [slots, Hkv, S, D], as GqaDriver holds its own.

    quant: round activations to two int8 parts before each weight (the draft's kernels; the target keeps fp32).
    head_rows: the token ids the head scores (a trimmed draft head), None for all; the rest get `fill`.
    kv_owner: a model whose KV this one reads and writes (a draft beside its target), else its own.
    """

    def __init__(self, weights: NativeWeights, dims: ModelDims, kernels, max_seq_len: int, quant: bool = False,
                 head_rows: np.ndarray | None = None, fill: float = 0.0, kv_owner: "NativeModel | None" = None):
        self.weights = weights
        self.dims = dims
        self.kernels = kernels
        self.max_seq_len = max_seq_len
        self.quant = quant
        self.head_rows, self.fill = head_rows, np.float32(fill)
        self.kv_owner = kv_owner
        self.geometry = Geometry(dims, max_seq_len, "float32")
        self._keys = self._values = None  # [L, slots, Hkv, S, D]
        self.buffers = []
        if quant:
            self.struct  # the draft's paired weights are made when it opens, not on its first call (~0.2 s)

    @functools.cached_property
    def head(self) -> np.ndarray:
        """[V or len(head_rows), H / 32] of BLOCK8: the rows the head scores."""
        head = self.weights.head
        return head if self.head_rows is None else np.ascontiguousarray(head[self.head_rows])

    @functools.cached_property
    def pairs(self) -> list:
        """The draft's copy of the layers' Q4_1 weights in pairs of blocks (BLOCK4P, fp16 scales): per layer
        qkv, o, gate_up, down. About 5/6 of the target's bytes, which the draft reads on every step."""
        return [[q41_pairs(getattr(layer, name)) for name in LINEARS] for layer in self.weights.layers]

    @functools.cached_property
    def struct(self) -> ModelStruct:
        """kernels.c's model_t over the weights (built once; the arrays it points into live as long as this)."""
        weights, dims, layers = self.weights, self.dims, self.weights.layers
        tables = [_pointers([getattr(layer, name) for layer in layers])
                  for name in ("input_norm", "post_norm", *LINEARS)]
        paired = [_pointers(list(column)) for column in zip(*self.pairs)] if self.quant else []  # the draft's only
        self._tables = tables + paired  # kept alive with the struct
        return ModelStruct(
            dims.num_layers, dims.hidden_size, dims.num_heads, dims.num_kv_heads, dims.head_dim,
            layers[0].down.shape[1] * BLOCK, len(self.head), weights.epsilon, weights.scale,
            None if weights.embedding is None else weights.embedding.ctypes.data,
            *(table.ctypes.data for table in tables),
            *([table.ctypes.data for table in paired] or [None] * len(LINEARS)),  # NULL for a target
            weights.final_norm.ctypes.data, self.head.ctypes.data, weights.cos.ctypes.data, weights.sin.ctypes.data,
            weights.head.ctypes.data if weights.embedding is None else None)  # the whole head, not a draft's rows

    @property
    def keys(self):
        return self._keys if self.kv_owner is None else self.kv_owner.keys

    @property
    def values(self):
        return self._values if self.kv_owner is None else self.kv_owner.values

    def reset(self, slots: int) -> None:
        if self.kv_owner is not None:  # the owner's reset sizes the buffers
            return
        d = self.dims
        shape = (d.num_layers, slots, d.num_kv_heads, self.max_seq_len, d.head_dim)
        if self._keys is None or self._keys.shape != shape:
            self._keys, self._values = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
            self.buffers = list(self._keys) + list(self._values)  # views, [slots, Hkv, S, D] each

    def matmul(self, x: np.ndarray, blocks: np.ndarray, quant: bool = False, prompt: bool = False) -> np.ndarray:
        """x [M, K] -> [M, N] through blocks [N, K / 32] (BLOCK4, BLOCK8; or BLOCK4P, the draft's pairs, with quant),
        x rounded to two int8 parts first with quant (the draft's kernels), or through the kernel of a prompt's rows
        with prompt (fp32 activations; a forward with last_only); the products alone, for benchmarks and tests."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        y = np.empty((x.shape[0], blocks.shape[0]), np.float32)
        four, k = blocks.dtype in (BLOCK4, BLOCK4P), x.shape[1]
        if quant:
            pairs = q41_pairs(blocks) if blocks.dtype == BLOCK4 else blocks
            if self.kernels.int8_gemm(x.ctypes.data, x.shape[0], k, pairs.ctypes.data, four, y.ctypes.data,
                                      blocks.shape[0]):
                raise BackendError(f"int8 activations of {x.shape[0]} rows: out of memory", "free some memory")
            return y
        if prompt:
            if self.kernels.prefill_products(x.ctypes.data, x.shape[0], k, blocks.ctypes.data, four, y.ctypes.data,
                                             blocks.shape[0]):
                raise BackendError(f"a prompt's {x.shape[0]} rows: out of memory", "free some memory")
            return y
        kernel = self.kernels.q41_gemm if four else self.kernels.q8_gemm
        kernel(x.ctypes.data, x.shape[0], k, blocks.ctypes.data, y.ctypes.data, blocks.shape[0])
        return y

    def forward(self, tokens: np.ndarray, pos: int, slot: int, last_only: bool = False) -> np.ndarray:
        """tokens [T] at positions pos.. of `slot` -> logits [T, V] ([1, V] with last_only); K/V land at
        [pos, pos + T)."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        vocab = self.dims.vocab_size
        if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
            raise BackendError(f"token ids {tokens.min()}..{tokens.max()} are outside the vocabulary 0..{vocab - 1}",
                               "encode the text with the bundle's tokenizer")
        keys, values = self.keys, self.values
        if self.quant and not self.struct.qkv_p:  # rounding turned on after a struct without the pairs was built
            del self.struct
        rows = 1 if last_only else len(tokens)
        scored = np.empty((rows, len(self.head)), np.float32)
        status = self.kernels.specdec_forward(
            ctypes.byref(self.struct), tokens.ctypes.data, len(tokens), pos, keys[0, slot].ctypes.data,
            values[0, slot].ctypes.data, keys.strides[0] // 4, self.max_seq_len, last_only, self.quant,
            scored.ctypes.data)
        if status:
            raise BackendError(f"the native forward of {len(tokens)} tokens ran out of memory", "free some memory")
        if self.head_rows is None:
            return scored
        logits = np.full((rows, vocab), self.fill, np.float32)
        logits[:, self.head_rows] = scored
        return logits
