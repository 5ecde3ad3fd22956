"""The native attention against numpy: causal GQA over static KV, within fp32 rounding, for one and several query
positions, head sizes with and without AVX2's multiple of 8, shared KV heads, and long caches whose keys are taken in
chunks and merged; and each position's result the same bits whatever the call's length or thread count."""
from __future__ import annotations

import numpy as np
import pytest

from specdec.native import build

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")
S = 512  # KV positions per head


def reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, pos: int, scale: float) -> np.ndarray:
    """q [T, Hq, D] at positions pos..; keys, values [Hkv, S, D] -> [T, Hq, D] (float64)."""
    T, Hq, _ = q.shape
    group = Hq // keys.shape[0]
    out = np.empty(q.shape)
    for t in range(T):
        for h in range(Hq):
            k, v = keys[h // group, : pos + t + 1].astype(np.float64), values[h // group, : pos + t + 1]
            scores = k @ q[t, h] * scale
            p = np.exp(scores - scores.max())
            out[t, h] = p @ v / p.sum()
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("D,Hq,Hkv", [(64, 9, 3), (16, 4, 4), (12, 6, 2), (8, 32, 1)])
@pytest.mark.parametrize("T,pos", [(1, 0), (1, 70), (1, 400), (5, 300), (40, 0), (17, 100)])
def test_attention_matches_numpy(threads, D, Hq, Hkv, T, pos):
    lib = build.load_kernels()
    rng = np.random.default_rng(T * 1000 + pos + D)
    q = rng.normal(0, 1, (T, Hq, D)).astype(np.float32)
    keys, values = (rng.normal(0, 1, (Hkv, S, D)).astype(np.float32) for _ in range(2))
    scale = 1.5 / np.sqrt(D)
    out = attend(lib, q, keys, values, pos, scale, threads)
    want = reference(q, keys, values, pos, scale)
    assert np.abs(out - want).max() <= 1e-5 * np.abs(want).max()


def attend(lib, q, keys, values, pos: int, scale: float, threads: int) -> np.ndarray:
    T, Hq, D = q.shape
    Hkv, S, _ = keys.shape
    out = np.full((T, Hq, D), np.nan, np.float32)
    scratch = np.empty(lib.specdec_attention_scratch_bytes(T, Hq, Hkv, D, S, threads), np.uint8)
    assert lib.specdec_attention(q.ctypes.data, T, Hq, Hkv, D, keys.ctypes.data, values.ctypes.data, S, pos,
                                 float(scale), out.ctypes.data, scratch.ctypes.data, scratch.size, threads) == 0
    return out


@pytest.mark.parametrize("D,Hq,Hkv", [(64, 9, 3), (12, 6, 2)])
def test_a_positions_result_depends_on_nothing_else(D, Hq, Hkv):
    """Chunks of keys sit at fixed positions and merge in a fixed order: a query at position p gets the same bits as
    the last of a 7-token call, alone, or at another thread count (so verify passes equal one-token steps)."""
    lib = build.load_kernels()
    rng = np.random.default_rng(D)
    q = rng.normal(0, 1, (7, Hq, D)).astype(np.float32)
    keys, values = (rng.normal(0, 1, (Hkv, S, D)).astype(np.float32) for _ in range(2))
    for pos in (0, 100, 290):
        whole = attend(lib, q, keys, values, pos, 0.3, 2)
        for t in range(7):
            for threads in (1, 2):
                alone = attend(lib, q[t : t + 1], keys, values, pos + t, 0.3, threads)
                assert np.array_equal(alone[0], whole[t])
