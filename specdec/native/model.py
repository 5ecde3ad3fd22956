"""The forward pass on the native kernels (specdec_forward), with static KV per slot in numpy and the scratch the
kernels work in, both owned here: a forward allocates nothing once the scratch has grown to its largest call."""
from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np

from specdec.errors import BackendError, nonfinite_logits
from specdec.lowering import Geometry
from specdec.manifest import ModelDims
from specdec.native_record import Activation, Activations
from specdec.native.core import KernelModel
from specdec.native.weights import LINEARS, DraftWeights, NativeWeights
from specdec.weight_kinds import KERNELS, KIND_OF, WEIGHT_LAYOUTS, Kernel, WeightKind

_P, _I, _F = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float
STATUS = {  # specdec_native.h's status codes
    1: "a pointer the kernels need is NULL", 2: "a count or size is out of range", 3: "a token id is outside the "
    "weights' vocabulary", 4: "a position is below 0 or past the static buffers", 5: "the scratch is too small",
    6: "the thread count is out of range", 7: "a row of logits holds NaN or inf"}
NONFINITE = 7  # specdec_native.h's SPECDEC_E_NONFINITE: the forward ran; a row of its logits has no distribution
WEIGHT_KINDS = KIND_OF  # an array's dtype -> its WeightKind (specdec_matmul's kind, model_t.kinds)


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
QUANT = {Activations.FP32: 0, Activations.INT8: 2, Activations.BF16: 3}  # ... SPECDEC_ACT_F32, _INT8, _BF16: a target's
PER_LAYER = {"in_norm": "input_norm", "post_norm": "post_norm", **{name: name for name in LINEARS},
             "qkv_bias": "qkv_bias", "q_norm": "q_norm", "k_norm": "k_norm", "in_norm_bias": "input_norm_bias",
             "post_norm_bias": "post_norm_bias", "o_bias": "o_bias", "gate_up_bias": "gate_up_bias",
             "down_bias": "down_bias"}  # model_t's [L] tables of pointers -> the Layer field each points to


def _pointers(arrays: list) -> np.ndarray:
    return np.array([a.ctypes.data for a in arrays], dtype=np.uintp)


def _per_layer(layers: list, name: str) -> np.ndarray | None:
    """The [L] pointers to every layer's `name`, or None where the layers hold none (a family without it)."""
    return None if getattr(layers[0], name) is None else _pointers([getattr(layer, name) for layer in layers])


def _address(array) -> int | None:
    return None if array is None else array.ctypes.data


def raise_for(status: int, what: str) -> None:
    if status:
        raise BackendError(f"the native kernels refused {what}: {STATUS.get(status, f'status {status}')}",
                           "this is a bug in specdec's call; report it with the bundle's manifest")


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


class NativeModel(KernelModel):
    """One model on the CPU kernels (specdec.native.core.KernelModel). Also a KV source for the gqa driver's copy_kv
    (a draft taking this target's KV): `geometry` and `buffers`, the per-layer keys then values [slots, Hkv, S, D], as
    GqaDriver holds its own. A draft's products round its activations to two int8 parts before each weight (the
    draft's kernels); the target keeps fp32. threads: the threads each call uses (the caller and its workers).
    activations: a target's (Activations): fp32; int8, each row's rounded per block of 32 before every product
    with blk4, blk8 or blk6 weights (the kernels' SPECDEC_ACT_INT8); or bf16, each row's rounded to bf16 before
    every product with bf16 rows, on AMX tiles (SPECDEC_ACT_BF16)."""

    def __init__(self, weights: NativeWeights, dims: ModelDims, kernels, max_seq_len: int,
                 draft: DraftWeights | None = None, kv_owner: "NativeModel | None" = None, threads: int = 1,
                 activations: Activations = Activations.FP32):
        super().__init__(weights, dims, max_seq_len, draft, kv_owner)
        self.kernels = kernels
        self.threads = threads
        self.geometry = Geometry(dims, max_seq_len, "float32")
        self._keys = self._values = None  # [L, slots, Hkv, S, D]
        self.buffers = []
        self.scratch = Scratch()
        self._lock = threading.Lock()  # one forward at a time: the scratch is this model's
        self.quant = draft is not None  # the draft's kernels (int8 activations, paired blocks); a test may turn
        # them off to see the draft's head on its target's fp32 products
        self.activations = Activations(activations)

    @property
    def head(self) -> np.ndarray:
        """[V or V', H / 32] of BLOCK8: the rows the head scores."""
        return self.weights.head if self.draft is None else self.draft.head

    @functools.cached_property
    def struct(self) -> ModelStruct:
        """specdec_native.h's model_t over the weights, every field by its name (built once; the arrays it points into
        live as long as this)."""
        weights, dims = self.weights, self.dims
        tables = {field: _per_layer(weights.layers, name) for field, name in PER_LAYER.items()}
        if self.draft:  # the draft's pairs, a column of [L] per linear; NULL for a target
            tables.update({f"{name}_p": _pointers(list(column)) for name, column in zip(LINEARS, zip(*self.draft.pairs))})
        mixed = WEIGHT_LAYOUTS[weights.layout].mixed
        if mixed:  # each linear's own blocks, and its v rows' where a layer holds them apart
            tables["kinds"] = np.array([[WEIGHT_KINDS[getattr(layer, name).dtype] for name in LINEARS] +
                                        [WEIGHT_KINDS[(layer.qkv if layer.qkv_v is None else layer.qkv_v).dtype]]
                                        for layer in weights.layers], np.int32)
        if any(layer.qkv_v is not None for layer in weights.layers):
            tables["qkv_v"] = np.array([0 if layer.qkv_v is None else layer.qkv_v.ctypes.data
                                        for layer in weights.layers], np.uintp)
        self._tables = tables  # kept alive with the struct
        rows = WEIGHT_LAYOUTS[weights.layout].rows  # rows: a tied embedding is the head itself
        embedding = weights.head if rows and weights.embedding is None else weights.embedding
        arrays = {**tables, "embedding": embedding, "final_norm": weights.final_norm, "head": self.head,
                  "cos": weights.cos, "sin": weights.sin, "final_norm_bias": weights.final_norm_bias,
                  "position_table": weights.positions,
                  "embedding_rows": weights.head if embedding is None else None}  # the whole head, not a draft's rows
        return ModelStruct(
            L=dims.num_layers, H=dims.hidden_size, Hq=dims.num_heads, Hkv=dims.num_kv_heads, D=dims.head_dim,
            I=weights.mlp_width, V=len(self.head), vocab=weights.vocab, positions=weights.max_position,
            kind=WEIGHT_LAYOUTS[weights.layout].kind, eps=weights.epsilon, scale=weights.scale, window=weights.window,
            head_kind=WEIGHT_KINDS[weights.head.dtype] if mixed else WeightKind.Q80,
            mlp=MLPS[weights.activation], **{name: _address(array) for name, array in arrays.items()})

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
        """x [M, K] -> [M, N] through weights [N, elements] of any WeightKind (blocks [N, K / 32], pairs, rows [N, K])
        by `kernel` (a Kernel or its name) where the kind's table gives it that kernel; the products alone, for
        benchmarks and tests."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or blocks.ndim != 2 or blocks.dtype not in WEIGHT_KINDS:
            raise BackendError(f"matmul of {x.shape} by {blocks.dtype} {blocks.shape}", "pass x [M, K], blocks [N, nb]")
        kind = WEIGHT_KINDS[blocks.dtype]
        y = np.empty((x.shape[0], blocks.shape[0]), np.float32)
        need = self.kernels.specdec_matmul_scratch_bytes(x.shape[0], x.shape[1], KERNELS[kernel], threads)
        with self._lock:
            address, size = self.scratch.at_least(need)
            raise_for(self.kernels.specdec_matmul(
                x.ctypes.data, x.shape[0], x.shape[1], blocks.ctypes.data, blocks.shape[1], kind,
                KERNELS[kernel], y.ctypes.data, blocks.shape[0], address, size, threads),
                f"a product of {list(x.shape)} by {blocks.dtype.name} blocks {list(blocks.shape)}")
        return y

    def held_slots(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    def compute(self, tokens: np.ndarray, pos: np.ndarray, slots: np.ndarray, last_only: bool = False,
                layers: tuple = ()) -> np.ndarray | tuple:
        """forward without check_rows: every row in one kernel call (each weight read once for all of them). With
        `layers` (indices 0..L-1) -> (logits, features [B, T, len(layers), H]: every fed token's hidden state after
        each of those layers)."""
        threads = self.threads
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
        logits = self.widen(out)
        return (logits, features) if layers else logits

    def _features(self, rows: int, steps: int, layers: tuple) -> tuple:
        """(features [rows, steps, F, H], the layers int32 [F], features_t over both) of the requested layers, or
        three None."""
        if not layers:
            return None, None, None
        chosen = np.ascontiguousarray(layers, dtype=np.int32)
        features = np.empty((rows, steps, len(chosen), self.dims.hidden_size), np.float32)
        return features, chosen, FeaturesStruct(chosen.ctypes.data, len(chosen), features.ctypes.data)
