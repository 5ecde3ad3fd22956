"""The native engine's weight blocks: the fitters that put a float weight on a GGUF grid, and the numpy decoders of
every weight kind (numpy only; the ground floor, beside manifest.py). The kinds themselves (their structs as numpy
dtypes, the block size) come from specdec.weight_kinds, which reads them from specdec/native/specdec_kinds.h.

A GGUF block holds 32 weights along K. Q4_1: w = d·q + m (q in 0..15, float scale d and minimum m). Q8_0: w = d·q
(q in −127..127). A weight that lies on one of these grids (a GGUF's, dequantized on export) is stored as its blocks,
so the kernels compute the exported graph's own function while reading 4.5 or 8.5 bits a weight.
"""
from __future__ import annotations

import numpy as np

from specdec.weight_kinds import BLOCK, DTYPES, MIXED_KINDS, Q5_ORDER, TensorKind, WeightKind, kind_of

BLOCK4, BLOCK8, BLOCK4P = WeightKind.Q41.dtype, WeightKind.Q80.dtype, WeightKind.Q41P.dtype  # blk4, blk8, blk4p
BLOCK6, BLOCK5, BF16 = WeightKind.Q6.dtype, WeightKind.Q5.dtype, WeightKind.BF16.dtype  # blk6, blk5; a bf16 value:
# the top 16 bits of its fp32
GRID_TOLERANCE = 1e-4  # max |w − dequant| / d of a weight the native engine takes: fp32 rounding, not a coarser grid


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


FITTERS = {WeightKind.Q41: _fit4, WeightKind.Q5: _fit5, WeightKind.Q80: _fit8, WeightKind.Q6: _fit6}  # of MIXED_KINDS


def mixed_blocks(name: str, weight: np.ndarray) -> np.ndarray:
    """weight [N, K] (K % 32 == 0) -> its blocks in the narrowest of MIXED_KINDS that holds it (blk4 and blk5
    within GRID_TOLERANCE, blk8 and blk6 exactly), fitted FIT_ROWS rows at a time; GridError where none does."""
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if weight.ndim != 2 or weight.shape[1] % BLOCK:
        raise GridError(f"{name} has shape {list(weight.shape)}; the native kernels need K % {BLOCK} == 0")
    for fit in (FITTERS[kind] for kind in MIXED_KINDS):
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
    if blocks.dtype != BLOCK8:
        raise TypeError(f"q8_rows takes blocks of BLOCK8, not {blocks.dtype}")
    return float_rows(blocks)


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
    if DTYPES[precision] == BF16:
        return (weight.view(np.uint32) >> 16).astype(BF16)
    return weight.astype(DTYPES[precision])


# ---- the numpy decoders: each weight kind's values as the kernels compute them (the references of both engines) ------
def _values_q41(blocks: np.ndarray) -> np.ndarray:  # [..., nb] -> [..., nb, 32]: d * q + m
    return _nibbles(blocks).astype(np.float32) * blocks["d"][..., None] + blocks["m"][..., None]


def _values_q5(blocks: np.ndarray) -> np.ndarray:  # d * q + m, q from the packed 5-bit codes
    return q5_codes(blocks["codes"]).astype(np.float32) * blocks["d"][..., None] + blocks["m"][..., None]


def _values_q80(blocks: np.ndarray) -> np.ndarray:  # d * q
    return blocks["d"][..., None] * blocks["qs"].astype(np.float32)


def _values_q6(blocks: np.ndarray) -> np.ndarray:  # d[0] * q of elements 0-15, d[1] * q of 16-31
    return np.repeat(blocks["d"], BLOCK // 2, axis=-1) * blocks["qs"].astype(np.float32)


def _values_q41p(pairs: np.ndarray) -> np.ndarray:  # [..., np] -> [..., np, 2, 32]: each half's d * q + m, fp16 d, m
    h = pairs["h"].astype(np.float32)  # d0 d1 m0 m1
    first = h[..., 0, None] * (pairs["qs"] & 15).astype(np.float32) + h[..., 2, None]
    second = h[..., 1, None] * (pairs["qs"] >> 4).astype(np.float32) + h[..., 3, None]
    return np.stack([first, second], axis=-2)


def _values_bf16(rows: np.ndarray) -> np.ndarray:  # the fp32 of these top 16 bits
    return (rows.astype(np.uint32) << 16).view(np.float32)


def _values_float(rows: np.ndarray) -> np.ndarray:  # f16 (exactly) and f32
    return rows.astype(np.float32)


DECODERS = {WeightKind.Q41: _values_q41, WeightKind.Q80: _values_q80, WeightKind.Q41P: _values_q41p,
            WeightKind.BF16: _values_bf16, WeightKind.F16: _values_float, WeightKind.F32: _values_float,
            WeightKind.Q6: _values_q6, WeightKind.Q5: _values_q5}  # every weight kind's (tests check it is every one)


def float_rows(weights: np.ndarray) -> np.ndarray:
    """Weights [..., elements] of any weight kind (rows of bf16 as BF16, f16 or f32; blocks [N, K / 32]; pairs
    [N, ceil(K / 64)]) -> float32 [..., elements * per]: a block's d * q or d * q + m, a row's value. A pair that ends
    half empty decodes its empty half too (zeros)."""
    return np.ascontiguousarray(DECODERS[kind_of(weights)](weights), np.float32).reshape(weights.shape[:-1] + (-1,))


# ---- encoders: any float weight as the nearest weights of each kind (tests, benchmarks: every kind's examples) -------
def _nearest5(weight: np.ndarray) -> np.ndarray:
    """weight [N, K] -> blocks [N, K / 32] of BLOCK5: per block d = span / 31 and m = its minimum, q rounded."""
    blocks = weight.reshape(len(weight), -1, BLOCK)
    low, high = blocks.min(axis=-1), blocks.max(axis=-1)
    scale = np.where(high > low, (high - low) / np.float32(31), np.float32(1)).astype(np.float32)
    out = np.empty(low.shape, BLOCK5)
    out["d"], out["m"] = scale, low
    out["codes"] = q5_packed(np.clip(np.rint((blocks - low[..., None]) / scale[..., None]), 0, 31).astype(np.uint8))
    return out


def _nearest6(weight: np.ndarray) -> np.ndarray:
    """weight [N, K] -> blocks [N, K / 32] of BLOCK6: per 16 weights d = max |w| / 127, q rounded."""
    halves = weight.reshape(len(weight), -1, 2, BLOCK // 2)
    scale = np.abs(halves).max(axis=-1) / np.float32(127)
    scale = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)
    out = np.empty(scale.shape[:2], BLOCK6)
    out["d"] = scale
    out["qs"] = np.clip(np.rint(halves / scale[..., None]), -127, 127).astype(np.int8).reshape(out.shape + (BLOCK,))
    return out


ENCODERS = {WeightKind.Q41: lambda weight: q41_blocks(weight)[0], WeightKind.Q80: lambda weight: q8_blocks(weight)[0],
            WeightKind.Q41P: lambda weight: q41_pairs(q41_blocks(weight)[0]),
            WeightKind.BF16: lambda weight: rows_of(weight, TensorKind.BF16),
            WeightKind.F16: lambda weight: weight.astype(np.float16), WeightKind.F32: lambda weight: weight,
            WeightKind.Q6: _nearest6, WeightKind.Q5: _nearest5}  # every weight kind's (tests check it is every one)


def encode(kind: WeightKind, weight: np.ndarray) -> np.ndarray:
    """weight [N, K] (K % 32 == 0) -> the weights of `kind` nearest it (bf16: its top halves) [N, elements]."""
    return ENCODERS[kind](np.ascontiguousarray(weight, dtype=np.float32))
