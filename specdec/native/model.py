"""The forward pass on the native kernels (specdec_forward), with static KV per slot in numpy and the scratch the
kernels work in, both owned here: a forward allocates nothing once the scratch has grown to its largest call."""
from __future__ import annotations

import ctypes
import functools
import threading
from enum import StrEnum

import numpy as np

from specdec.blocks import BF16, BLOCK, BLOCK4, BLOCK4P, BLOCK5, BLOCK6, BLOCK8, KINDS, WEIGHT_LAYOUTS
from specdec.errors import BackendError, nonfinite_logits
from specdec.lowering import Geometry
from specdec.manifest import Activation, Activations, ModelDims, Role
from specdec.native.weights import LINEARS, DraftWeights, NativeWeights

_P, _I, _F = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float
STATUS = {  # specdec_native.h's status codes
    1: "a pointer the kernels need is NULL", 2: "a count or size is out of range", 3: "a token id is outside the "
    "weights' vocabulary", 4: "a position is below 0 or past the static buffers", 5: "the scratch is too small",
    6: "the thread count is out of range", 7: "a row of logits holds NaN or inf"}
NONFINITE = 7  # specdec_native.h's SPECDEC_E_NONFINITE: the forward ran; a row of its logits has no distribution
WEIGHT_KINDS = {BLOCK4: 0, BLOCK8: 1, BLOCK4P: 2, BF16: 3, np.dtype("<f2"): 4, np.dtype("<f4"): 5,
                BLOCK6: 6, BLOCK5: 7}  # specdec_native.h's SPECDEC_W_*: specdec_matmul's kind, model_t.kinds


class Kernel(StrEnum):
    """A kernel of specdec_matmul (KERNELS: its code in specdec_native.h)."""

    STEP = "step"  # a decode step's and a verify pass's
    PROMPT = "prompt"  # a prompt's (fp32)
    INT8 = "int8"  # the activations rounded to two int8 parts: the draft's
    Q8A = "q8a"  # each row's activations rounded per block of 32 to int8 (the int8 activations mode)
    Q8A_REFERENCE = "q8a-reference"  # ... in plain C: the bits every build of Q8A must give


KERNELS = {Kernel.STEP: 0, Kernel.PROMPT: 1, Kernel.INT8: 2, Kernel.Q8A: 3, Kernel.Q8A_REFERENCE: 4}


class ModelStruct(ctypes.Structure):
    """specdec_native.h's model_t."""
    _fields_ = [("L", _I), ("H", _I), ("Hq", _I), ("Hkv", _I), ("D", _I), ("I", _I), ("V", _I), ("vocab", _I),
                ("positions", _I), ("kind", _I), ("eps", _F), ("scale", _F), ("embedding", _P), ("in_norm", _P), ("post_norm", _P),
                ("qkv", _P), ("o", _P), ("gate_up", _P), ("down", _P), ("qkv_p", _P), ("o_p", _P),
                ("gate_up_p", _P), ("down_p", _P), ("final_norm", _P), ("head", _P), ("cos", _P), ("sin", _P),
                ("embedding_rows", _P), ("qkv_bias", _P), ("kinds", _P), ("qkv_v", _P), ("q_norm", _P), ("k_norm", _P),
                ("head_kind", _I), ("window", _I), ("mlp", _I), ("in_norm_bias", _P), ("post_norm_bias", _P),
                ("final_norm_bias", _P), ("o_bias", _P), ("gate_up_bias", _P), ("down_bias", _P),
                ("position_table", _P)]
class FeaturesStruct(ctypes.Structure):
    """specdec_native.h's features_t."""
    _fields_ = [("layers", _P), ("n", _I), ("out", _P)]


MLPS = {Activation.SILU_GATED: 0, Activation.GELU_TANH: 1, Activation.GELU: 2}  # specdec_native.h's SPECDEC_MLP_*
ACT_DRAFT = 1  # specdec_native.h's SPECDEC_ACT_DRAFT: the draft's kernels (specdec_forward's quant)
QUANT = {Activations.FP32: 0, Activations.INT8: 2}  # ... SPECDEC_ACT_F32 and SPECDEC_ACT_INT8
BIASES = ("input_norm_bias", "post_norm_bias", "o_bias", "gate_up_bias", "down_bias")  # model_t's [L] tables of them


def _pointers(arrays: list) -> np.ndarray:
    return np.array([a.ctypes.data for a in arrays], dtype=np.uintp)


def raise_for(status: int, what: str) -> None:
    if status:
        raise BackendError(f"the native kernels refused {what}: {STATUS.get(status, f'status {status}')}",
                           "this is a bug in specdec's call; report it with the bundle's manifest")


def check_rows(rows: int, steps: int, pos, slots, held: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions int32 [rows], slots int64 [rows]) of a forward of `rows` x `steps` tokens over `held` KV slots of
    `size` positions; BackendError where either is not one integer per row, a position or its last token falls
    outside 0..size - 1 (never wrapped to 32 bits), or the slots are not distinct held slots."""
    pos, slots = np.asarray(pos), np.asarray(slots)
    if pos.shape != (rows,) or slots.shape != (rows,) or pos.dtype.kind not in "iu" or slots.dtype.kind not in "iu":
        raise BackendError(f"a forward of {rows} rows got positions {pos.dtype} {list(pos.shape)} and slots "
                           f"{slots.dtype} {list(slots.shape)}", "pass one integer position and one slot per row")
    at, into = pos.tolist(), slots.tolist()
    if any(p < 0 or p + steps > size for p in at):
        raise BackendError(f"positions {at} with {steps} tokens fall outside the {size} positions of the KV",
                           "end the row first (finish reason 'length'), or re-export with a larger --max-seq-len")
    if any(s < 0 or s >= held for s in into) or len(set(into)) != rows:
        raise BackendError(f"slots {into} are not distinct slots of 0..{held - 1}", "call reset with enough slots")
    return pos.astype(np.int32), slots.astype(np.int64)


class Scratch:
    """A growing, 64-byte aligned work buffer for the kernels."""

    def __init__(self):
        self.buffer = np.empty(0, np.uint8)

    def at_least(self, nbytes: int) -> tuple[int, int]:
        """(address, size) of a buffer of at least `nbytes` (grown, never shrunk)."""
        if nbytes < 0:  # what the kernels' scratch_bytes answer for a call they would refuse
            raise_for(2, "a call's shape")
        if self.buffer.size < nbytes:
            self.buffer = np.empty(nbytes, np.uint8)
        return self.buffer.ctypes.data, self.buffer.size


class NativeModel:
    """One model on the kernels. Also a KV source for the gqa driver's copy_kv (a draft taking this target's KV):
    `geometry` and `buffers`, the per-layer keys then values [slots, Hkv, S, D], as GqaDriver holds its own.

    draft: the paired weights and head of an int4-q41 draft (activations rounded to two int8 parts before each
    weight: the draft's kernels; the target keeps fp32); it runs on `weights` (its target's norms and tables).
    kv_owner: a model whose KV this one reads and writes (a draft beside its target), else its own.
    activations: a target's (Activations): fp32, or int8 per block of 32 before every product with blocked weights.
    """

    def __init__(self, weights: NativeWeights, dims: ModelDims, kernels, max_seq_len: int,
                 draft: DraftWeights | None = None, kv_owner: "NativeModel | None" = None,
                 activations: Activations = Activations.FP32):
        self.weights = weights
        self.dims = dims
        self.kernels = kernels
        self.max_seq_len = max_seq_len
        self.draft = draft
        self.kv_owner = kv_owner
        self.geometry = Geometry(dims, max_seq_len, "float32")
        self._keys = self._values = None  # [L, slots, Hkv, S, D]
        self.buffers = []
        self.scratch = Scratch()
        self._lock = threading.Lock()  # one forward at a time: the scratch is this model's
        self.quant = draft is not None  # the draft's kernels (int8 activations, paired blocks); a test may turn
        # them off to see the draft's head on its target's fp32 products
        self.activations = Activations(activations)

    @property
    def role(self) -> Role:
        return Role.TARGET if self.draft is None else Role.DRAFT

    @property
    def head(self) -> np.ndarray:
        """[V or V', H / 32] of BLOCK8: the rows the head scores."""
        return self.weights.head if self.draft is None else self.draft.head

    @functools.cached_property
    def struct(self) -> ModelStruct:
        """specdec_native.h's model_t over the weights (built once; the arrays it points into live as long as
        this)."""
        weights, dims, layers = self.weights, self.dims, self.weights.layers
        tables = [_pointers([getattr(layer, name) for layer in layers])
                  for name in ("input_norm", "post_norm", *LINEARS)]
        paired = [_pointers(list(column)) for column in zip(*self.draft.pairs)] if self.draft else []
        biases = _pointers([layer.qkv_bias for layer in layers]) if layers[0].qkv_bias is not None else None
        mixed = WEIGHT_LAYOUTS[weights.layout].mixed
        kinds = np.array([[WEIGHT_KINDS[getattr(layer, name).dtype] for name in LINEARS] +
                          [WEIGHT_KINDS[(layer.qkv_v if layer.qkv_v is not None else layer.qkv).dtype]]
                          for layer in layers], np.int32) if mixed else None  # each linear's own blocks ("mixed")
        split = [layer.qkv_v for layer in layers]  # a mixed layer's v rows apart, else NULL
        v_rows = np.array([0 if v is None else v.ctypes.data for v in split], np.uintp) if any(
            v is not None for v in split) else None
        head_norms = [_pointers([getattr(layer, name) for layer in layers]) for name in ("q_norm", "k_norm")] \
            if layers[0].q_norm is not None else [None, None]
        more = [_pointers([getattr(layer, name) for layer in layers]) if getattr(layers[0], name) is not None else None
                for name in BIASES]  # LayerNorm's biases, and those after o, gate_up and down (GPT-2's)
        self._tables = tables + paired + [biases, kinds, v_rows, *head_norms, *more]  # kept alive with the struct
        address = lambda array: None if array is None else array.ctypes.data  # noqa: E731
        rows = WEIGHT_LAYOUTS[weights.layout].rows  # rows: a tied embedding is the head itself
        embedding = weights.head if rows and weights.embedding is None else weights.embedding
        return ModelStruct(
            dims.num_layers, dims.hidden_size, dims.num_heads, dims.num_kv_heads, dims.head_dim, weights.mlp_width,
            len(self.head), weights.vocab, weights.max_position, KINDS[weights.layout], weights.epsilon, weights.scale,
            None if embedding is None else embedding.ctypes.data, *(table.ctypes.data for table in tables),
            *([table.ctypes.data for table in paired] or [None] * len(LINEARS)),  # NULL for a target
            weights.final_norm.ctypes.data, self.head.ctypes.data, address(weights.cos), address(weights.sin),
            weights.head.ctypes.data if embedding is None else None,  # the whole head, not a draft's rows
            None if biases is None else biases.ctypes.data, None if kinds is None else kinds.ctypes.data,
            None if v_rows is None else v_rows.ctypes.data,
            *(None if table is None else table.ctypes.data for table in head_norms),
            WEIGHT_KINDS[weights.head.dtype] if mixed else WEIGHT_KINDS[BLOCK8], weights.window,
            MLPS[weights.activation], *(address(table) for table in more[:2]), address(weights.final_norm_bias),
            *(address(table) for table in more[2:]), address(weights.positions))

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

    def matmul(self, x: np.ndarray, blocks: np.ndarray, kernel: Kernel = Kernel.STEP, threads: int = 1) -> np.ndarray:
        """x [M, K] -> [M, N] through blocks [N, K / 32] (BLOCK4, BLOCK5, BLOCK8, BLOCK6; BLOCK4P with Kernel.INT8) or
        rows [N, K] (BF16, float16, float32), by `kernel` (a Kernel or its name); the products alone, for benchmarks
        and tests."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or blocks.ndim != 2 or blocks.dtype not in WEIGHT_KINDS:
            raise BackendError(f"matmul of {x.shape} by {blocks.dtype} {blocks.shape}", "pass x [M, K], blocks [N, nb]")
        kind = WEIGHT_KINDS[blocks.dtype]
        rows = blocks.dtype.names is None  # rows [N, K]: K / 32 blocks of 32 a column
        per_column = blocks.shape[1] // BLOCK if rows and blocks.shape[1] % BLOCK == 0 else -1 if rows else blocks.shape[1]
        y = np.empty((x.shape[0], blocks.shape[0]), np.float32)
        need = self.kernels.specdec_matmul_scratch_bytes(x.shape[0], x.shape[1], KERNELS[kernel], threads)
        with self._lock:
            address, size = self.scratch.at_least(need)
            raise_for(self.kernels.specdec_matmul(
                x.ctypes.data, x.shape[0], x.shape[1], blocks.ctypes.data, per_column, kind,
                KERNELS[kernel], y.ctypes.data, blocks.shape[0], address, size, threads),
                f"a product of {list(x.shape)} by {blocks.dtype.name} blocks {list(blocks.shape)}")
        return y

    def forward(self, tokens: np.ndarray, pos: np.ndarray, slots: np.ndarray, last_only: bool = False,
                threads: int = 1) -> np.ndarray:
        """tokens [B, T] of rows at positions pos[b].. of slots[b] -> logits [B, T or 1, V]; K/V land at
        [pos[b], pos[b] + T) of each slot. One call for all rows: each weight is read once for all of them. Checks its
        positions and slots (check_rows); NativeBackend, whose forward has checked them, calls compute."""
        tokens = np.asarray(tokens)
        rows, steps = tokens.shape if tokens.ndim == 2 else (0, 0)
        if rows and steps and self.keys is not None:  # else compute says what is wrong
            pos, slots = check_rows(rows, steps, pos, slots, self.keys.shape[1], self.max_seq_len)
        return self.compute(tokens, pos, slots, last_only, threads)

    def compute(self, tokens: np.ndarray, pos: np.ndarray, slots: np.ndarray, last_only: bool = False,
                threads: int = 1, layers: tuple = ()) -> np.ndarray | tuple:
        """forward without check_rows: positions and slots already checked. With `layers` (indices 0..L-1) ->
        (logits, features [B, T, len(layers), H]: every fed token's hidden state after each of those layers)."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        rows, steps = tokens.shape if tokens.ndim == 2 else (0, 0)
        keys, values = self.keys, self.values
        if rows == 0 or steps == 0 or keys is None:
            raise BackendError(f"a native forward of token ids shaped {list(tokens.shape)}",
                               "pass [B, T] token ids with B, T >= 1, after reset")
        pos32 = np.ascontiguousarray(pos, dtype=np.int32)
        key_rows, value_rows = _pointers([keys[0, s] for s in slots]), _pointers([values[0, s] for s in slots])
        out = np.empty((rows, 1 if last_only else steps, len(self.head)), np.float32)
        features, chosen, wanted = self._features(rows, steps, layers)  # chosen: alive through the call
        with self._lock:
            need = self.kernels.specdec_scratch_bytes(ctypes.byref(self.struct), rows, steps, self.max_seq_len, threads)
            address, size = self.scratch.at_least(need)
            status = self.kernels.specdec_forward(
                ctypes.byref(self.struct), address, size, tokens.ctypes.data, rows, steps, pos32.ctypes.data,
                key_rows.ctypes.data, value_rows.ctypes.data, keys.strides[0] // 4, self.max_seq_len, last_only,
                ACT_DRAFT if self.quant else QUANT[self.activations], threads, out.ctypes.data, None if wanted is None else ctypes.byref(wanted))
        if status == NONFINITE:  # the kernels checked every logit; which positions, on this path alone
            raise nonfinite_logits(self.role, np.isfinite(out.max(axis=-1)).tolist(), pos32.tolist(), steps, last_only)
        raise_for(status, f"a forward of {rows} x {steps} tokens at {pos32.tolist()}")
        logits = out
        if self.draft is not None and self.draft.head_rows is not None:
            logits = np.full(out.shape[:2] + (self.dims.vocab_size,), self.draft.fill, np.float32)
            logits[..., self.draft.head_rows] = out
        return (logits, features) if layers else logits

    def _features(self, rows: int, steps: int, layers: tuple) -> tuple:
        """(features [rows, steps, F, H], the layers int32 [F], features_t over both) of the requested layers, or
        three None."""
        if not layers:
            return None, None, None
        chosen = np.ascontiguousarray(layers, dtype=np.int32)
        features = np.empty((rows, steps, len(chosen), self.dims.hidden_size), np.float32)
        return features, chosen, FeaturesStruct(chosen.ctypes.data, len(chosen), features.ctypes.data)
