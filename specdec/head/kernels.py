"""The head's products on the native kernels (specdec.native: specdec_matmul): the head's weights quantized to Q8_0
blocks (specdec.blocks.BLOCK8) once, when the head opens, times the activations as the target takes its own: fp32
(the step kernel), or, beside a target of int8 activations, each row rounded to int8 per block (the Q8A kernel,
VPDPBUSD: a chain step about a sixth cheaper). A head step reads a little over one byte a weight, the LM head over
the draft vocabulary most of them. NativeLayer runs the whole layer on those blocks in one call
(specdec_head_forward): its norms, rotary, attention and residuals in C too.

The blocks compute another function than the fp32 weights (each weight rounded to its block's 8-bit grid); the head
only proposes, and acceptance compares the target with the q the head really used, so exactness does not depend on
it. `dequantized()` gives the reference products of the same blocks (tests compare the two paths with it).
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

from specdec.blocks import BLOCK, float_rows, q8_blocks
from specdec.errors import BackendError
from specdec.head.format import HeadWeights
from specdec.head.model import PRODUCTS, FloatProducts
from specdec.manifest import HeadRecord
from specdec.native.model import KERNELS, NONFINITE, WEIGHT_KINDS, Scratch, raise_for
from specdec.weight_kinds import Kernel

STEP = KERNELS[Kernel.STEP]
Q8A = KERNELS[Kernel.Q8A]
Q8A_REF = KERNELS[Kernel.Q8A_REF]  # Q8A in plain C: the same bits


def blocks_fit(matrices: dict) -> bool:
    """Whether every product's K is a whole number of blocks (else the head keeps the fp32 products)."""
    return all(matrix.shape[1] % BLOCK == 0 for matrix in matrices.values())


class BlockProducts:
    """x @ W.T through the kernels over Q8_0 blocks of each W. kernels: the loaded library (load_kernels);
    threads: the kernels' worker count; kernel: STEP (fp32 activations), Q8A or Q8A_REF (int8 activations)."""

    def __init__(self, matrices: dict, kernels, threads: int, kernel: int = STEP):
        self.blocks = {name: q8_blocks(matrix)[0] for name, matrix in matrices.items()}  # [N, K / 32] of BLOCK8
        self.kernels = kernels
        self.threads = threads
        self.kernel = kernel
        self.scratch = Scratch()
        self._needs = {}  # (M, K) -> scratch bytes
        self._lock = threading.Lock()  # one product at a time: the scratch is this object's

    def __call__(self, name: str, x: np.ndarray) -> np.ndarray:
        # x: [M, K] float32 -> [M, N]
        blocks = self.blocks[name]
        rows, width = x.shape
        y = np.empty((rows, len(blocks)), np.float32)
        need = self._needs.get((rows, width))
        if need is None:
            need = self._needs[(rows, width)] = self.kernels.specdec_matmul_scratch_bytes(rows, width, self.kernel,
                                                                                         self.threads)
        with self._lock:
            address, size = self.scratch.at_least(need)
            raise_for(self.kernels.specdec_matmul(
                x.ctypes.data, rows, width, blocks.ctypes.data, blocks.shape[1], WEIGHT_KINDS[blocks.dtype],
                self.kernel, y.ctypes.data, len(blocks), address, size, self.threads),
                f"the head's {name} product of {[rows, width]} by blocks {list(blocks.shape)}")
        return y

    def dequantized(self) -> FloatProducts:
        """The fp32 reference products of these very blocks (d·q or d·q + m per weight), fp32 activations."""
        return FloatProducts({name: float_rows(blocks) for name, blocks in self.blocks.items()})


_P, _I, _F = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float
LAYER_PRODUCTS = ("qkv", "o", "gate_up", "down", "lm_head")  # head_t.kinds' order: the layer's products, fc apart


class HeadStruct(ctypes.Structure):
    """specdec_native.h's head_t."""
    _fields_ = [("H", _I), ("Hq", _I), ("Hkv", _I), ("D", _I), ("I", _I), ("V", _I), ("positions", _I),
                ("residual_normed", _I), ("eps", _F), ("scale", _F), ("kinds", _I * 5), ("input_norm", _P),
                ("hidden_norm", _P), ("post_norm", _P), ("norm", _P), ("qkv", _P), ("o", _P), ("gate_up", _P),
                ("down", _P), ("lm_head", _P), ("cos", _P), ("sin", _P)]


class NativeLayer:
    """The head's layer (HeadModel.forward after the embedding and the feature) in one call of the native kernels, on
    the blocks of `products` (BlockProducts: its kernels, threads and kernel) and the rotary table `rotary` (cos, sin
    [S, D / 2]): HeadModel's layer_of. Its outputs are a row's same bits whatever the call's rows, tokens and
    threads."""

    def __init__(self, weights: HeadWeights, record: HeadRecord, products: BlockProducts, rotary: tuple):
        assert set(LAYER_PRODUCTS) <= set(products.blocks) and set(products.blocks) <= set(PRODUCTS)
        self.products = products
        self.kernels = products.kernels
        self._keep = [np.ascontiguousarray(a, np.float32) for a in (weights.input_norm, weights.hidden_norm,
                                                                    weights.post_norm, weights.norm, *rotary)]
        blocks = self._blocks = [products.blocks[name] for name in LAYER_PRODUCTS]  # held: the struct points at them
        norms, tables = self._keep[:4], self._keep[4:]
        self.struct = HeadStruct(
            record.hidden_size, record.num_heads, record.num_kv_heads, record.head_dim,
            record.intermediate_size, len(weights.draft_ids), len(tables[0]), int(bool(record.norm_before_residual)),
            record.epsilon, 1.0 / np.sqrt(record.head_dim), (_I * 5)(*(int(WEIGHT_KINDS[b.dtype]) for b in blocks)),
            *(a.ctypes.data for a in norms), *(b.ctypes.data for b in blocks), *(t.ctypes.data for t in tables))
        self.scratch = Scratch()
        self._needs = {}  # (B, T, S) -> scratch bytes
        self._lock = threading.Lock()  # one call at a time: the scratch is this object's

    def __call__(self, embedded: np.ndarray, hidden: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                 keys: np.ndarray, values: np.ndarray, last_only: bool) -> tuple[np.ndarray, np.ndarray]:
        """embedded, hidden: [B, T, H] float32; K/V [slots, Hkv, S, D] written at positions[b].. of slots[b] ->
        (logits [B, T or 1, V'], prenorm [B, T or 1, H])."""
        rows, steps, width = hidden.shape
        kept = 1 if last_only else steps
        embedded = np.ascontiguousarray(embedded, np.float32)
        hidden = np.ascontiguousarray(hidden, np.float32)
        logits = np.empty((rows, kept, self.struct.V), np.float32)
        prenorm = np.empty((rows, kept, width), np.float32)
        at = np.ascontiguousarray(positions, np.int32)
        slots = np.asarray(slots, np.int64)
        key_rows = (keys.ctypes.data + slots * keys.strides[0]).astype(np.uintp)
        value_rows = (values.ctypes.data + slots * values.strides[0]).astype(np.uintp)
        S, threads = keys.shape[2], self.products.threads
        need = self._needs.get((rows, steps, S))
        if need is None:
            need = self._needs[(rows, steps, S)] = self.kernels.specdec_head_scratch_bytes(
                ctypes.byref(self.struct), rows, steps, S, threads)
        with self._lock:
            address, size = self.scratch.at_least(need)
            status = self.kernels.specdec_head_forward(
                ctypes.byref(self.struct), address, size, embedded.ctypes.data, hidden.ctypes.data, rows, steps,
                at.ctypes.data, key_rows.ctypes.data, value_rows.ctypes.data, S, int(last_only),
                self.products.kernel, threads, logits.ctypes.data, prenorm.ctypes.data)
        if status == NONFINITE:
            raise BackendError("the draft head's logits hold NaN or have no finite largest value: its weights are "
                               "damaged or overflow", "train the head again, or draft without it (drafter='auto' "
                               "or 'model')")
        raise_for(status, f"the head's layer over {[rows, steps]} tokens at positions {at.tolist()}")
        return logits, prenorm
