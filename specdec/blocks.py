"""The native engine's weight blocks, owned once (numpy only; the ground floor, beside manifest.py).

This module mirrors specdec/native/specdec_native.h: the block structs as numpy dtypes, the block size, the ABI
version that the kernels' loader checks against the library it opened, the version of the weights' format that a
bundle records, the fitters that put a float weight on a GGUF grid, and the native weights file that export writes
and the engine reads. The two versions move apart: a change of the library's exports or of model_t (an
in-process struct) needs no re-export; a change of a block or of the file does.

A GGUF block holds 32 weights along K. Q4_1: w = d·q + m (q in 0..15, float scale d and minimum m). Q8_0: w = d·q
(q in −127..127). A weight that lies on one of these grids (a GGUF's, dequantized on export) is stored as its blocks,
so the kernels compute the exported graph's own function while reading 4.5 or 8.5 bits a weight.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np

from specdec.files import open_regular
from specdec.manifest import Role

class TensorKind(StrEnum):
    """The element of a tensor of the native weights file (TensorEntry.kind; DTYPES holds its numpy dtype)."""

    BLK4 = "blk4"  # Q4_1
    BLK8 = "blk8"  # Q8_0
    BLK4P = "blk4p"  # two Q4_1 blocks of a column
    BLK6 = "blk6"  # Q8_0 with a scale per 16
    BLK5 = "blk5"  # 5-bit codes
    F32 = "f32"
    I64 = "i64"
    BF16 = "bf16"
    F16 = "f16"


class LayoutName(StrEnum):
    """How a native weights file holds a model (NativeRecord.layout; WEIGHT_LAYOUTS holds what each is). A layout of
    rows in a checkpoint's precision is named as its rows' TensorKind."""

    Q41 = "q41"
    Q80 = "q80"
    MIXED = "mixed"
    BF16 = "bf16"
    F16 = "f16"
    F32 = "f32"
    Q41_DRAFT = "q41-draft"


ABI_VERSION = 9  # specdec_native.h's SPECDEC_ABI_VERSION: the library's exports, model_t and status codes
FORMAT_VERSION = 4  # ... SPECDEC_FORMAT_VERSION: the blocks and the weights file (a bundle's native.abi)
CHANGED_SINCE = {2: frozenset({TensorKind.BLK5}), 3: frozenset()}  # an older format: the kinds whose layout changed
# since (3: blk5's codes; 4: none, the file holds its own table and extent: read_tensors)
BLOCK = 32  # weights per block along K
BLOCK4 = np.dtype([("d", "<f4"), ("m", "<f4"), ("qs", "u1", 16)])  # blk4: Q4_1; qs[j] = q[j] | q[j + 16] << 4
BLOCK8 = np.dtype([("d", "<f4"), ("qs", "i1", 32)])  # blk8: Q8_0
BLOCK4P = np.dtype([("h", "<f2", 4), ("qs", "u1", 32)])  # blk4p: two BLOCK4 of a column, fp16 d0 d1 m0 m1
BLOCK6 = np.dtype([("d", "<f4", 2), ("qs", "i1", 32)])  # blk6: Q8 with a scale per 16 (a Q6_K's sub-blocks)
BLOCK5 = np.dtype([("codes", "u1", 20), ("d", "<f4"), ("m", "<f4")])  # blk5: 5-bit codes (Q5_0, Q5_1, Q5_K), 160
# bits, slot i (bits 5i..5i+4, little-endian) holding q[Q5_ORDER[i]]: see specdec_native.h
Q5_ORDER = np.array([0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29,
                     2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31])  # SPECDEC_Q5_ORDER
GRID_TOLERANCE = 1e-4  # max |w − dequant| / d of a weight the native engine takes: fp32 rounding, not a coarser grid
BF16 = np.dtype("<u2")  # a bf16 value: the top 16 bits of its fp32
DTYPES = {TensorKind.BLK4: BLOCK4, TensorKind.BLK8: BLOCK8, TensorKind.BLK4P: BLOCK4P, TensorKind.BLK6: BLOCK6,
          TensorKind.BLK5: BLOCK5, TensorKind.F32: np.dtype("<f4"), TensorKind.I64: np.dtype("<i8"),
          TensorKind.BF16: BF16, TensorKind.F16: np.dtype("<f2")}


@dataclass(frozen=True)
class WeightLayout:
    """How a native weights file holds a model's weights; a NativeRecord's `layout` names one (WEIGHT_LAYOUTS)."""

    name: LayoutName
    role: Role  # the model it holds
    kind: int  # specdec_native.h's model_t.kind (-1: a draft's, which runs on its target's model_t)
    per: int  # inputs one stored element of a linear weight holds along K
    linear: TensorKind | None = None  # the block of its linear weights where they are GGUF blocks

    @property
    def rows(self) -> bool:
        """Whether its linear weights and head are rows [N, K] in a checkpoint's precision (else GGUF blocks)."""
        return self.per == 1

    @property
    def mixed(self) -> bool:
        """Whether each linear weight has blocks of its own kind (MIXED_LINEARS; model_t.kinds says which)."""
        return self.linear is None and not self.rows


WEIGHT_LAYOUTS = {layout.name: layout for layout in (
    WeightLayout(LayoutName.Q41, Role.TARGET, 0, BLOCK, TensorKind.BLK4),  # Q4_1 blocks [N, K / 32], a Q8_0 head
    WeightLayout(LayoutName.Q80, Role.TARGET, 4, BLOCK, TensorKind.BLK8),  # Q8_0 blocks, a Q8_0 head (a Q8_0 GGUF's)
    WeightLayout(LayoutName.MIXED, Role.TARGET, 5, BLOCK),  # each linear blk4, blk5, blk8 or blk6 (MIXED_LINEARS),
    # a Q8_0 head
    WeightLayout(LayoutName.BF16, Role.TARGET, 1, 1), WeightLayout(LayoutName.F16, Role.TARGET, 2, 1),
    WeightLayout(LayoutName.F32, Role.TARGET, 3, 1),
    WeightLayout(LayoutName.Q41_DRAFT, Role.DRAFT, -1, 2 * BLOCK))}  # pairs of Q4_1 blocks, a Q8_0 head's rows
KINDS = {name: layout.kind for name, layout in WEIGHT_LAYOUTS.items() if layout.kind >= 0}  # model_t.kind by name
SIZES = {TensorKind.BLK4: 24, TensorKind.BLK8: 36, TensorKind.BLK4P: 40, TensorKind.BLK6: 40,
         TensorKind.BLK5: 28}  # the header's static_asserts, checked against the library at load
MAGIC = b"SPECDEC-NATIVE\x00\x00"  # the weights file's first 16 bytes
MIXED_LINEARS = (BLOCK4, BLOCK5, BLOCK8, BLOCK6)  # a "mixed" layout's linear blocks, narrowest first (24 to 40 bytes)
ALIGN = 64  # every tensor of the weights file starts at a multiple of this (cache lines, AVX loads)


class GridError(ValueError):
    """A weight is not on the grid a layout needs (or holds NaN or inf)."""


# ---- fitters: a float weight onto a GGUF grid --------------------------------------------------------------------
def q41_from_weight(weight: np.ndarray) -> dict:
    """Quantize a [K, N] weight (K % 32 == 0) to Q4_1 codes. -> codes [nb, 32, N] uint8, scale, zp, residual and
    minimum (m), each [nb, N], and grid_error (max |w − d·q − m| / d; inf where the weight is not finite)."""
    k, n = weight.shape
    blocks = weight.astype(np.float32).reshape(k // BLOCK, BLOCK, n)  # [nb, 32, N]
    low, high = blocks.min(axis=1), blocks.max(axis=1)  # [nb, N]
    scale = (high - low) / 15.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        codes = np.clip(np.rint((blocks - low[:, None]) / scale[:, None]), 0, 15)
        error = np.abs(codes * scale[:, None] + low[:, None] - blocks).max(axis=1) / scale
        zero_point = np.clip(np.rint(-low / scale), 0, 15)
    residual = (low + zero_point * scale).astype(np.float32)  # (q − zp)·d + residual == d·q + m
    return {"codes": np.nan_to_num(codes).astype(np.uint8), "scale": scale,
            "zero_point": np.nan_to_num(zero_point).astype(np.uint8), "residual": residual,
            "minimum": low.astype(np.float32), "grid_error": _worst(error)}


def q8_0_from_weight(weight: np.ndarray) -> dict:
    """Quantize an [N, K] weight (K % 32 == 0) on the GGUF Q8_0 grid: per 32-value block along K, w = d·q with
    d = max |w| / 127 and q in −127..127, exact for weights dequantized from Q8_0 (the amax element is q = ±127).
    -> codes [N, nb, 32] uint8 (q + 128), scale [N, nb], zero_point [N, nb] (128), grid_error (max |w − d·q| / d)."""
    n, k = weight.shape
    blocks = weight.astype(np.float32).reshape(n, k // BLOCK, BLOCK)  # [N, nb, 32]
    scale = np.abs(blocks).max(axis=-1) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        codes = np.clip(np.rint(blocks / scale[..., None]), -127, 127)
        error = np.abs(codes * scale[..., None] - blocks).max(axis=-1) / scale
    return {"codes": (np.nan_to_num(codes) + 128).astype(np.uint8), "scale": scale,
            "zero_point": np.full(scale.shape, 128, np.uint8), "grid_error": _worst(error)}


def _worst(error: np.ndarray) -> float:
    """The largest grid error, inf where any is NaN (a NaN weight is never on a grid)."""
    return float("inf") if error.size and not np.isfinite(error).all() else float(error.max(initial=0.0))


def q41_blocks(weight: np.ndarray) -> tuple[np.ndarray, float]:
    """weight [N, K] -> (blocks [N, K/32] of BLOCK4, max |w − d·q − m| / d)."""
    q = q41_from_weight(weight.T)  # codes [nb, 32, N]; scale, minimum [nb, N]
    codes = q["codes"].transpose(2, 0, 1)  # [N, nb, 32]
    out = np.zeros(codes.shape[:2], BLOCK4)
    out["d"], out["m"] = q["scale"].T, q["minimum"].T
    out["qs"] = codes[..., :16] | (codes[..., 16:] << 4)
    return out, q["grid_error"]


def q8_blocks(weight: np.ndarray) -> tuple[np.ndarray, float]:
    """weight [N, K] -> (blocks [N, K/32] of BLOCK8, max |w − d·q| / d)."""
    q = q8_0_from_weight(weight)  # codes [N, nb, 32] as q + 128; scale [N, nb]
    out = np.zeros(q["scale"].shape, BLOCK8)
    out["d"], out["qs"] = q["scale"], (q["codes"].astype(np.int16) - 128).astype(np.int8)
    return out, q["grid_error"]


def on_grid(name: str, weight: np.ndarray, fit) -> np.ndarray:
    """The blocks of `weight` [N, K] by `fit` (q41_blocks, q8_blocks); GridError where it is off the grid."""
    if weight.ndim != 2 or weight.shape[1] % BLOCK:
        raise GridError(f"{name} has shape {list(weight.shape)}; the native kernels need K % {BLOCK} == 0")
    blocks, error = fit(np.ascontiguousarray(weight, dtype=np.float32))
    if not error <= GRID_TOLERANCE:  # NaN and inf fail too
        grid = "Q4_1" if fit is q41_blocks else "Q8_0"
        raise GridError(f"{name} is not on a {grid} grid (max error {error:.3g} of a step)")
    return blocks


# ---- a K-quant GGUF's grids, a linear at a time (the "mixed" layout) ------------------------------------------------
EUCLID_STEPS = 64  # steps of Euclid's algorithm a group may take; values on no common grid take more
FIT_ROWS = 2048  # rows fitted at a time (bounds the fitters' temporaries)


def float_gcd(values: np.ndarray) -> np.ndarray:
    """values [..., g] float32 -> [...]: the largest d of which every |value| is an integer multiple, by Euclid's
    algorithm on floats. fmod is exact, so for values d·c with small integers c (a GGUF block's, dequantized: d·c is
    exact in float32) this is d·gcd(c) exactly. NaN where a group does not settle within EUCLID_STEPS steps (values
    on no common grid); 0 for a group of zeros."""
    v = np.abs(np.asarray(values, dtype=np.float32))
    g, settled = v[..., 0].copy(), np.ones(v.shape[:-1], bool)
    with np.errstate(invalid="ignore"):
        for i in range(1, v.shape[-1]):
            a, b = g, v[..., i].copy()
            for _ in range(EUCLID_STEPS):
                live = b > 0
                if not live.any():
                    break
                a, b = np.where(live, b, a), np.where(live, np.fmod(a, np.where(live, b, 1)), 0).astype(np.float32)
            settled &= ~(b > 0)
            g = a
    return np.where(settled, g, np.nan).astype(np.float32)


def _symmetric(weight: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray] | None:
    """weight [N, K] -> (scales [N, K / group], codes int8 [N, K / 32, 32]) with w = d·q exactly (|q| <= 127) per
    `group` along K; None where a group is on no such grid."""
    n, k = weight.shape
    groups = weight.reshape(n, k // group, group)
    d = float_gcd(groups)
    d = np.where(d > 0, d, np.float32(1)).astype(np.float32)  # an all-zero group: any scale
    with np.errstate(invalid="ignore", divide="ignore"):
        codes = groups / d[..., None]
    if not (np.isfinite(codes).all() and np.abs(codes).max(initial=0) <= 127):
        return None
    codes = np.rint(codes)
    if not np.array_equal(codes.astype(np.float32) * d[..., None], groups):
        return None
    return d, codes.astype(np.int8).reshape(n, k // BLOCK, BLOCK)


def _fit8(weight: np.ndarray) -> np.ndarray | None:
    """weight [N, K] -> blocks [N, K / 32] of BLOCK8 holding it exactly (a Q8_0, Q5_0 or Q4_0 block's values), or
    None."""
    found = _symmetric(weight, BLOCK)
    if found is None:
        return None
    out = np.empty(found[0].shape, BLOCK8)
    out["d"], out["qs"] = found
    return out


def _fit6(weight: np.ndarray) -> np.ndarray | None:
    """weight [N, K] -> blocks [N, K / 32] of BLOCK6 holding it exactly (a Q6_K sub-block's values: a scale per 16),
    or None."""
    found = _symmetric(weight, BLOCK // 2)
    if found is None:
        return None
    d, codes = found
    out = np.empty(codes.shape[:2], BLOCK6)
    out["d"], out["qs"] = d.reshape(len(d), -1, 2), codes
    return out


def _asymmetric(weight: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """weight [N, K] -> (scale, minimum [N, K / 32], codes uint8 [N, K / 32, 32]) with w = d·q + m within
    GRID_TOLERANCE of a step, q in 0..levels − 1 (a Q4_1 / Q4_K or Q5_0 / Q5_1 / Q5_K block's values, whose codes
    need not reach both ends: the step is the block's span over the largest k < levels that fits), or None."""
    n, k = weight.shape
    blocks = weight.reshape(n, k // BLOCK, BLOCK)
    low, high = blocks.min(axis=-1), blocks.max(axis=-1)
    scale, codes = np.ones(low.shape, np.float32), np.zeros(blocks.shape, np.float32)
    fitted = high == low  # one value: any scale, every code 0
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for span in range(levels - 1, 0, -1):
            if fitted.all():
                break
            step = ((high - low) / np.float32(span)).astype(np.float32)
            step = np.where(step > 0, step, np.float32(1))
            q = np.clip(np.rint((blocks - low[..., None]) / step[..., None]), 0, levels - 1)
            error = np.abs(q * step[..., None] + low[..., None] - blocks).max(axis=-1) / step
            take = ~fitted & (error <= GRID_TOLERANCE)
            scale, codes = np.where(take, step, scale), np.where(take[..., None], q, codes)
            fitted |= take
    return (scale, low, codes.astype(np.uint8)) if fitted.all() else None


def _fit_levels(weight: np.ndarray, levels: int) -> np.ndarray | None:
    """weight [N, K] -> blocks [N, K / 32] of BLOCK4 (16 levels: a Q4_1 or Q4_K block's values) or BLOCK5 (32: a
    Q5_0, Q5_1 or Q5_K block's), or None."""
    found = _asymmetric(weight, levels)
    if found is None:
        return None
    scale, low, q = found
    out = np.empty(low.shape, BLOCK5 if levels > 16 else BLOCK4)
    out["d"], out["m"] = scale, low
    if levels > 16:
        out["codes"] = q5_packed(q)
    else:
        out["qs"] = q[..., :16] | (q[..., 16:] << 4)
    return out


def q5_packed(q: np.ndarray) -> np.ndarray:
    """codes [..., 32] (0..31) -> BLOCK5's 20 bytes [..., 20]: slot i, bits 5i..5i+4, holds q[Q5_ORDER[i]]."""
    bits = (q[..., Q5_ORDER, None].astype(np.uint8) >> np.arange(5, dtype=np.uint8)) & 1  # [..., 32 slots, 5]
    return np.packbits(bits.reshape(*q.shape[:-1], 160), axis=-1, bitorder="little")


def q5_codes(packed: np.ndarray) -> np.ndarray:
    """BLOCK5's 20 bytes [..., 20] -> their codes [..., 32] uint8 (q5_packed's inverse)."""
    bits = np.unpackbits(packed, axis=-1, bitorder="little").reshape(*packed.shape[:-1], 32, 5)
    slots = (bits << np.arange(5, dtype=np.uint8)).sum(axis=-1, dtype=np.uint8)
    q = np.empty_like(slots)
    q[..., Q5_ORDER] = slots
    return q


def _fit4(weight: np.ndarray) -> np.ndarray | None:
    return _fit_levels(weight, 16)


def _fit5(weight: np.ndarray) -> np.ndarray | None:
    return _fit_levels(weight, 32)


def mixed_blocks(name: str, weight: np.ndarray) -> np.ndarray:
    """weight [N, K] (K % 32 == 0) -> its blocks in the narrowest of MIXED_LINEARS that holds it (blk4 and blk5
    within GRID_TOLERANCE, blk8 and blk6 exactly), fitted FIT_ROWS rows at a time; GridError where none does."""
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if weight.ndim != 2 or weight.shape[1] % BLOCK:
        raise GridError(f"{name} has shape {list(weight.shape)}; the native kernels need K % {BLOCK} == 0")
    for fit in (_fit4, _fit5, _fit8, _fit6):
        if fit(weight[:8]) is None:  # a few rows first: most weights are on no grid, or clearly on one
            continue
        parts = []
        for start in range(0, len(weight), FIT_ROWS):
            part = fit(weight[start : start + FIT_ROWS])
            if part is None:
                break
            parts.append(part)
        else:
            return np.concatenate(parts)
    raise GridError(f"{name} is on none of the grids of a K-quant GGUF (Q4_K / Q4_1, Q5_K / Q5_1 / Q5_0, Q8_0, Q6_K)")


def _nibbles(blocks: np.ndarray) -> np.ndarray:
    """BLOCK4 blocks [..., nb] -> their codes [..., nb, 32] uint8 (q[j] and q[j + 16] from qs[j])."""
    return np.concatenate([blocks["qs"] & 15, blocks["qs"] >> 4], axis=-1)


def q41_pairs(blocks: np.ndarray) -> np.ndarray:
    """blocks [N, nb] of BLOCK4 -> [N, ceil(nb / 2)] of BLOCK4P: each two blocks' d0, d1, m0, m1 in fp16 (a GGUF's
    own precision; elsewhere the draft's scales round to 11 bits) and their codes q0[j] | q1[j] << 4. An odd nb ends
    in a pair whose second block is 0."""
    if blocks.shape[1] % 2:
        blocks = np.concatenate([blocks, np.zeros((len(blocks), 1), BLOCK4)], axis=1)
    codes = _nibbles(blocks)  # [N, nb, 32]
    out = np.empty((len(blocks), blocks.shape[1] // 2), BLOCK4P)
    out["h"] = np.stack([blocks["d"][:, 0::2], blocks["d"][:, 1::2], blocks["m"][:, 0::2], blocks["m"][:, 1::2]], -1)
    out["qs"] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return out


def q8_rows(blocks: np.ndarray) -> np.ndarray:
    """blocks [N, nb] of BLOCK8 -> their values [N, nb * 32] float32, d * q as the kernels compute it."""
    return (blocks["d"][..., None] * blocks["qs"].astype(np.float32)).reshape(len(blocks), -1)


def head_holds(head: np.ndarray, embedding: np.ndarray, rows: int = 4096) -> bool:
    """Whether the head's blocks [V, H / 32] give the embedding [V, H] exactly (float_rows: d * q, exact in float32
    for BLOCK8 and BLOCK6, as the kernels compute it; a fitted BLOCK4 or BLOCK5 head's d * q + m may round otherwise
    and is then not taken): tied weights on the grid, so the kernels read the embedding's rows from the head and no
    float32 copy is stored. Compared a few thousand rows at a time."""
    if embedding.shape != (head.shape[0], head.shape[1] * BLOCK) or head.dtype not in (BLOCK8, BLOCK6):
        return False
    for start in range(0, len(head), rows):
        if not np.array_equal(float_rows(head[start : start + rows]), embedding[start : start + rows]):
            return False
    return True


# ---- rows: a checkpoint's own precision ----------------------------------------------------------------------------
def row_precision(weights: list) -> TensorKind:
    """The narrowest of BF16, F16, F32 that holds every float32 array of `weights` exactly; GridError where one holds
    NaN or inf."""
    bf16 = f16 = True
    for weight in weights:
        weight = np.ascontiguousarray(weight, dtype=np.float32)
        if not np.isfinite(weight).all():
            raise GridError("a weight holds NaN or inf")
        bf16 = bf16 and not (weight.view(np.uint32) & 0xFFFF).any()
        with np.errstate(over="ignore"):
            f16 = f16 and np.array_equal(weight.astype(np.float16).astype(np.float32), weight)
    return TensorKind.BF16 if bf16 else TensorKind.F16 if f16 else TensorKind.F32


def rows_of(weight: np.ndarray, precision: str) -> np.ndarray:
    """weight [N, K] float32 held exactly in `precision` -> its rows in that dtype (bf16: the top 16 bits)."""
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if DTYPES[precision] is BF16:
        return (weight.view(np.uint32) >> 16).astype(BF16)
    return weight.astype(DTYPES[precision])


def float_rows(rows: np.ndarray) -> np.ndarray:
    """Rows of bf16 (as BF16), f16 or f32, or blocks [N, K / 32] of BLOCK8, BLOCK6, BLOCK4 or BLOCK5 -> float32
    [N, K] (a block's d * q or d * q + m)."""
    if rows.dtype == BF16:
        return (rows.astype(np.uint32) << 16).view(np.float32)
    if rows.dtype == BLOCK8:
        return (rows["d"][..., None] * rows["qs"].astype(np.float32)).reshape(rows.shape[0], -1)
    if rows.dtype == BLOCK6:
        scales = np.repeat(rows["d"], BLOCK // 2, axis=-1)  # [N, nb, 32]
        return (scales * rows["qs"].astype(np.float32)).reshape(rows.shape[0], -1)
    if rows.dtype in (BLOCK4, BLOCK5):
        q = (_nibbles(rows) if rows.dtype == BLOCK4 else q5_codes(rows["codes"])).astype(np.float32)
        return (q * rows["d"][..., None] + rows["m"][..., None]).reshape(rows.shape[0], -1)
    return rows.astype(np.float32)


# ---- the native weights file -------------------------------------------------------------------------------------
# The header: MAGIC, u32 format, u32 bytes of the table, u64 offset of the table. From format TABLE_SINCE the file
# holds its own table of tensors after the last one (JSON: name -> {kind, shape, offset}, as the manifest's index):
# it says where it ends (its size) and what each tensor is. Older files leave both words zero.
HEADER = len(MAGIC) + 16
TABLE_SINCE = 4
MAX_TABLE = 1 << 24  # bytes a file's table may take (a model of a thousand layers takes about 1 MiB)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a native weights file."""

    kind: str  # a key of DTYPES
    shape: tuple
    offset: int  # bytes from the file's start, a multiple of ALIGN

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * DTYPES[self.kind].itemsize


def index_from(tensors: dict) -> dict:
    """A manifest's (or a file's) {name: {"kind", "shape", "offset"}} -> {name: TensorEntry}; KeyError, TypeError or
    ValueError where an entry is not of that form."""
    return {name: TensorEntry(spec["kind"], tuple(spec["shape"]), int(spec["offset"]))
            for name, spec in tensors.items()}


def _kind_of(array: np.ndarray) -> TensorKind:
    for kind, dtype in DTYPES.items():
        if array.dtype == dtype:
            return kind
    raise TypeError(f"no native kind for dtype {array.dtype}")


def write_tensors(path: Path, tensors: dict) -> dict:
    """Write `tensors` (name -> array of a DTYPES kind) to `path`, each aligned, then their table; -> {name:
    TensorEntry}."""
    index, offset = {}, HEADER
    with open(path, "wb") as handle:
        handle.write(b"\0" * HEADER)  # the header last, once the table's place is known
        for name, array in tensors.items():
            offset = -(-offset // ALIGN) * ALIGN
            handle.write(b"\0" * (offset - handle.tell()))
            data = np.ascontiguousarray(array)
            index[name] = TensorEntry(_kind_of(data), tuple(int(n) for n in data.shape), offset)
            handle.write(data.tobytes())
            offset += data.nbytes
        table = json.dumps({name: {"kind": entry.kind, "shape": list(entry.shape), "offset": entry.offset}
                            for name, entry in index.items()}).encode()
        handle.write(table)
        handle.seek(0)
        handle.write(MAGIC + struct.pack("<IIQ", FORMAT_VERSION, len(table), offset))
    return index


def check_index(index: dict, size: int, name: str) -> None:
    """ValueError unless every tensor of `index` starts at a multiple of ALIGN past the header and ends inside the
    file's `size` bytes (before its table), and no two overlap (a manifest that passes its hash can still point
    anywhere)."""
    spans = []
    for tensor, entry in index.items():
        if entry.kind not in DTYPES or any(not isinstance(n, int) or n < 0 for n in entry.shape):
            raise ValueError(f"{name}: tensor {tensor} has kind {entry.kind!r} and shape {list(entry.shape)}")
        if entry.offset < HEADER or entry.offset % ALIGN:
            raise ValueError(f"{name}: tensor {tensor} starts at byte {entry.offset}, not a multiple of {ALIGN} past "
                             "the header")
        if entry.offset + entry.nbytes > size:
            raise ValueError(f"{name} has {size} bytes; tensor {tensor} needs {entry.offset + entry.nbytes}")
        spans.append((entry.offset, entry.offset + entry.nbytes, tensor))
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"{name}: tensors {first} and {second} overlap (bytes {start}..{end})")


EXPONENTS = {np.dtype("<f4"): (np.dtype("<u4"), 0x7F800000), np.dtype("<f2"): (np.dtype("<u2"), 0x7C00),
             BF16: (BF16, 0x7F80)}  # a value is NaN or inf exactly where its exponent bits are all ones
CHUNK = 1 << 20


def nonfinite(array: np.ndarray) -> bool:
    """Whether a native tensor holds NaN or inf where the kernels read a float: f32 / f16 / bf16 values, and the
    scales and minima of blocks (their codes are integers). The largest exponent field, a chunk at a time through one
    buffer (a bf16 model of 135M weights: about 0.05 s)."""
    if array.dtype.names:
        return any(nonfinite(np.ascontiguousarray(array[field])) for field in ("d", "m", "h")
                   if field in array.dtype.names)
    if array.dtype not in EXPONENTS:
        return False
    bits, mask = EXPONENTS[array.dtype]
    flat = np.ascontiguousarray(array).reshape(-1).view(bits)
    out = np.empty(min(CHUNK, flat.size), bits)
    for start in range(0, flat.size, CHUNK):
        part = out[: min(CHUNK, flat.size - start)]
        np.bitwise_and(flat[start : start + CHUNK], mask, out=part)
        if int(part.max()) == mask:
            return True
    return False


class Pages(StrEnum):
    """How read_tensors holds a weights file (see there)."""

    PRIVATE = "private"
    SHARED = "shared"


PAGES = tuple(Pages)
READ_CHUNK = 1 << 24


def check_format(abi: int, kinds: set, name: str) -> None:
    """ValueError unless weights of format `abi` holding tensors of `kinds` read as this format: the same format, or
    an older one none of whose changed layouts (CHANGED_SINCE) they use."""
    if abi == FORMAT_VERSION:
        return
    if abi not in CHANGED_SINCE:
        raise ValueError(f"{name} holds native weights of format {abi}, this specdec reads format {FORMAT_VERSION}")
    changed = sorted(CHANGED_SINCE[abi] & set(kinds))
    if changed:  # the format that changed them: the first later one they are not changed since
        at = min(v for v in range(abi + 1, FORMAT_VERSION + 1) if not CHANGED_SINCE.get(v, frozenset()) & set(changed))
        raise ValueError(f"{name} holds native weights of format {abi} with {', '.join(changed)} blocks, whose layout "
                         f"changed in format {at}")


def _extent(fd: int, name: str) -> tuple[int, int, int]:
    """(format, the table's offset, its bytes; both 0 before format TABLE_SINCE) of an open native weights file.
    ValueError where it has no magic, or its size is not the one its header gives (padded or cut short): two small
    reads and its size, before anything else is read."""
    size, head = os.fstat(fd).st_size, os.pread(fd, HEADER, 0)
    if head[: len(MAGIC)] != MAGIC:
        raise ValueError(f"{name} is not a native weights file (no magic)")
    if len(head) < HEADER:
        raise ValueError(f"{name} has {size} bytes, fewer than its {HEADER}-byte header")
    abi, table_bytes, table_at = struct.unpack("<IIQ", head[len(MAGIC) :])
    if abi < TABLE_SINCE:
        return abi, 0, 0
    if table_at < HEADER or table_bytes > MAX_TABLE or table_at + table_bytes != size:
        raise ValueError(f"{name} has {size} bytes; its header says it ends at byte {table_at + table_bytes} (a "
                         f"table of {table_bytes} bytes at byte {table_at}): the file was padded or cut short")
    return abi, table_at, table_bytes


def check_extent(path: Path) -> None:
    """_extent's checks alone: load(verify=True) runs them before it hashes the file."""
    fd = open_regular(path)
    try:
        _extent(fd, str(path))
    finally:
        os.close(fd)


def _table(fd: int, at: int, size: int, name: str) -> dict:
    """The file's own table of tensors ({name: TensorEntry}), `size` bytes at byte `at`."""
    try:
        return index_from(json.loads(os.pread(fd, size, at).decode("utf-8")))
    except (UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{name}: its table of tensors (bytes {at}..{at + size}) cannot be read") from None


def check_table(index: dict, table: dict, name: str) -> None:
    """ValueError unless the manifest's `index` describes every tensor as the file's own `table` does: the same
    names, each of the same kind and shape at the same offset (a manifest edited apart from its file, with offsets
    swapped or a kind misread, points at the wrong bytes however its hash stands)."""
    where = lambda e: "absent" if e is None else f"{e.kind} {list(e.shape)} at byte {e.offset}"  # noqa: E731
    for tensor in sorted(set(index) | set(table)):
        mine, theirs = index.get(tensor), table.get(tensor)
        if mine != theirs:
            raise ValueError(f"{name}: the manifest reads tensor {tensor} as {where(mine)}; the file's own table "
                             f"holds it as {where(theirs)}")


def read_tensors(path: Path, index: dict, pages: str = Pages.SHARED) -> dict:
    """Every tensor of `index` ({name: TensorEntry}) of `path`, read only. ValueError where the file is not a native
    weights file of this format, is padded or cut short, is shorter than the index needs, or holds its own table
    (format TABLE_SINCE on) that the index contradicts; ManifestError where it is not a regular file. Only the bytes
    up to the index's last tensor are mapped or copied.

    pages "shared": the file memory-mapped (the page cache's 4 KiB pages, shared with every process that maps it).
    "private": the file read into anonymous memory advised for transparent huge pages. Streaming a weight then crosses
    a page boundary every 2 MiB instead of every 4 KiB, and the hardware prefetchers stop at each: a bf16 target's
    step runs measurably faster (`python benchmarks/step.py BUNDLE --backends native --pages private,shared`), at
    the cost of a copy per process."""
    if pages not in PAGES:
        raise ValueError(f"pages {pages!r} is not one of {', '.join(PAGES)}")
    fd = open_regular(path)
    try:
        abi, table_at, table_bytes = _extent(fd, str(path))
        check_format(abi, {entry.kind for entry in index.values()}, str(path))
        check_index(index, table_at or os.fstat(fd).st_size, str(path))
        if table_at:
            check_table(index, _table(fd, table_at, table_bytes, str(path)), str(path))
        need = max((entry.offset + entry.nbytes for entry in index.values()), default=HEADER)
        whole = _private_copy(fd, need, path) if pages == Pages.PRIVATE else \
            np.frombuffer(mmap.mmap(fd, need, access=mmap.ACCESS_READ), dtype=np.uint8)  # the map outlives fd
    finally:
        os.close(fd)
    return {name: whole[entry.offset : entry.offset + entry.nbytes].view(DTYPES[entry.kind]).reshape(entry.shape)
            for name, entry in index.items()}


def _private_copy(fd: int, size: int, path: Path) -> np.ndarray:
    """The first `size` bytes of the open file `fd` read into anonymous memory (page aligned, advised for huge pages
    where the kernel offers them), as a read-only byte array that keeps the mapping alive. Read with readinto, so the
    file's pages are never mapped here and the process's peak memory is the copy alone."""
    buffer = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: 4 KiB pages, still correct
            pass
    with memoryview(buffer) as view, open(fd, "rb", buffering=0, closefd=False) as handle:
        handle.seek(0)
        done = 0
        while done < size:
            got = handle.readinto(view[done : min(size, done + READ_CHUNK)])
            if not got:
                raise ValueError(f"{path} ended after {done} of its {size} bytes")
            done += got
    whole = np.frombuffer(buffer, dtype=np.uint8)[:size]
    whole.flags.writeable = False
    return whole
