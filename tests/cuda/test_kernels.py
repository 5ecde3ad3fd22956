"""kernels.cu and its numpy references: the source compiles under NVRTC (no GPU needed) with the weight kinds' header
inlined, whose asserts it runs; it defines every kernel the launcher names, for every weight kind of the table but those
specdec/cuda/layouts.py declares unserved; each reference computes its kernel's documented function (block layouts
decoded as the native engine's are, causal GQA attention, the first of equal logits); a product's row never depends on
the call's other rows; capture records without running and replays what it recorded. The GPU's numerics against these
references are the device check's (benchmarks/cuda_check.py)."""
from __future__ import annotations

import ctypes
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from specdec.blocks import BLOCK8, float_rows, q8_blocks, q41_blocks, q41_pairs, rows_of
from specdec.cuda import device
from specdec.cuda.layouts import SERVED, UNSERVED, layout_of
from specdec.cuda.reference import ReferenceKernels, dense
from specdec.weight_kinds import HEADER, WeightKind

ARCHS = ("compute_80", "compute_90")  # A100, H100 / H200


def _nvrtc():
    found = sorted(Path(sys.prefix).glob("lib/python3*/site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so*"))
    if not found:
        pytest.skip("NVRTC is not installed (pip install 'specdec[nvrtc]')")
    return ctypes.CDLL(str(found[0]))


def compile_ptx(source: bytes, arch: str) -> tuple[int, str, str]:
    """(NVRTC's status, its log, the PTX) of `source` for `arch`."""
    nvrtc, program = _nvrtc(), ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(program), source, b"kernels.cu", 0, None, None) == 0
    options = (ctypes.c_char_p * 2)(f"--gpu-architecture={arch}".encode(), b"-std=c++17")
    status = nvrtc.nvrtcCompileProgram(program, 2, options)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    ptx = b""
    if status == 0:
        nvrtc.nvrtcGetPTXSize(program, ctypes.byref(size))
        out = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetPTX(program, out)
        ptx = out.value
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    return status, log.value.decode(errors="replace"), ptx.decode(errors="replace")


@pytest.mark.parametrize("arch", ARCHS)
def test_kernels_compile_without_warnings_and_define_what_the_launcher_names(arch):
    status, log, ptx = compile_ptx(device.source().encode(), arch)
    assert status == 0 and not log.strip(), log
    entries = set(re.findall(r"\.entry\s+(\w+)", ptx))
    launched = re.findall(r'_launch\(\s*(f?)"(\w+?)(_\{w\.layout\.label\})?"', Path(device.__file__).read_text())
    names = {name + (f"_{kind.label}" if per_kind else "") for _, name, per_kind in launched for kind in SERVED}
    assert {"embed", "rmsnorm", "rope_kv", "attention", "silu_mul", "argmax", "linear_bf16", "linear_norm_q41",
            "linear_silu_q41p", "dequant_f16"} <= names <= entries
    per_kind = {entry.rpartition("_")[2] for entry in entries if entry.startswith(("linear_", "dequant_"))}
    assert per_kind == {kind.label for kind in SERVED}  # every kind of the table served, or declared UNSERVED


def test_every_weight_kind_is_served_or_declared_unserved():
    assert set(SERVED) | set(UNSERVED) == set(WeightKind) and not set(SERVED) & set(UNSERVED)
    assert all(why for why in UNSERVED.values())
    for kind in UNSERVED:
        with pytest.raises(TypeError, match=f"do not read {kind.label} weights"):
            layout_of(np.zeros((2, 2), kind.dtype))


def test_kernels_cu_holds_no_layout_of_its_own():
    """Its structs and kind codes are the header's, inlined once: a struct or enum of a kind here could drift."""
    text = device.SOURCE.read_text()
    assert text.count(device.INCLUDE) == 1 and device.source().count("#define SPECDEC_WEIGHT_KINDS(X)") == 1
    assert not re.search(r"\bstruct\s+blk|\benum\s*\{[^}]*Q4_1", text)
    assert "SPECDEC_W_Q41" in text


@pytest.mark.parametrize("edit", [("X(Q41,  0, blk4,  24,", "X(Q41,  0, blk4,  28,"),  # a size the struct is not
                                  ("uint8_t qs[SPECDEC_BLOCK / 2]; } blk4;", "uint8_t qs[SPECDEC_BLOCK]; } blk4;")])
def test_nvrtc_checks_the_table_as_gcc_does(edit):
    """The header's asserts run where kernels.cu compiles: a struct that drifts from the table's bytes fails."""
    source = device.source()
    assert source.count(edit[0]) == 1 and HEADER.read_text().count(edit[0]) == 1
    status, log, _ = compile_ptx(source.replace(*edit).encode(), ARCHS[0])
    assert status != 0 and "the weight kind Q41 as the table gives it" in log


def test_a_broken_kernel_is_caught():
    status, log, _ = compile_ptx(b'extern "C" __global__ void k(float *x) { x[0] = undefined_name; }', ARCHS[0])
    assert status != 0 and "undefined_name" in log


def _grid_weight(rng, n: int, k: int) -> np.ndarray:
    """[N, K] on a Q4_1 grid: per block of 32 a scale and a minimum."""
    d = rng.uniform(0.01, 0.1, (n, k // 32, 1)).astype(np.float32)
    m = rng.uniform(-0.5, 0.0, (n, k // 32, 1)).astype(np.float32)
    codes = rng.integers(0, 16, (n, k // 32, 32))
    codes[..., 0], codes[..., 1] = 0, 15  # each block spans its grid, as a GGUF's fitted block does
    return (d * codes.astype(np.float32) + m).reshape(n, k)


def test_dense_decodes_every_layout():
    rng = np.random.default_rng(0)
    weight = _grid_weight(rng, 6, 96)
    blocks, error = q41_blocks(weight)
    assert error < 1e-4 and layout_of(blocks) is WeightKind.Q41
    np.testing.assert_allclose(dense(blocks), weight, rtol=0, atol=1e-6)
    pairs = q41_pairs(blocks)  # 3 blocks: the second pair is half empty
    half = blocks.copy()
    half["d"], half["m"] = half["d"].astype(np.float16), half["m"].astype(np.float16)  # the pairs' fp16 scales
    np.testing.assert_allclose(dense(pairs, 96), dense(half), rtol=0, atol=1e-6)
    assert dense(pairs).shape == (6, 128) and not dense(pairs)[:, 96:].any()
    q8, _ = q8_blocks(weight)
    assert q8.dtype == BLOCK8 and np.allclose(dense(q8), weight, atol=weight.max() / 127)
    for precision in ("bf16", "f16", "f32"):
        rows = rows_of(float_rows(rows_of(weight, "bf16")), precision)
        assert np.array_equal(dense(rows), float_rows(rows))


def test_a_products_row_does_not_depend_on_the_calls_other_rows():
    rng = np.random.default_rng(1)
    kernels = ReferenceKernels(few_rows=8)
    w = kernels.weight(rows_of(rng.normal(0, 1, (50, 64)).astype(np.float32), "f32"))
    x = rng.normal(0, 1, (8, 64)).astype(np.float32)
    one, eight = np.zeros((1, 50), np.float32), np.zeros((8, 50), np.float32)
    kernels.linear(x[3:4], w, one)
    kernels.linear(x, w, eight)
    assert np.array_equal(one[0], eight[3])
    base = eight.copy()
    kernels.linear(x, w, eight, accumulate=True)
    assert np.array_equal(eight, base + base)


def test_fused_products_equal_their_parts():
    rng = np.random.default_rng(4)
    kernels = ReferenceKernels()
    w = kernels.weight(rows_of(rng.normal(0, 1, (40, 64)).astype(np.float32), "f32"))
    x, gamma = rng.normal(0, 1, (3, 64)).astype(np.float32), rng.normal(1, 0.1, 64).astype(np.float32)
    normed, apart, fused = np.zeros((3, 64), np.float32), np.zeros((3, 40), np.float32), np.zeros((3, 40), np.float32)
    kernels.rmsnorm(x, gamma, 1e-5, normed)
    kernels.linear(normed, w, apart)
    kernels.linear_norm(x, gamma, 1e-5, w, fused)
    np.testing.assert_allclose(fused, apart, rtol=1e-5, atol=1e-5)
    gu, act = rng.normal(0, 1, (3, 128)).astype(np.float32), np.zeros((3, 64), np.float32)
    kernels.silu_mul(gu, act)
    kernels.linear(act, w, apart)
    kernels.linear_silu(gu, w, fused, accumulate=False)
    np.testing.assert_array_equal(fused, apart)


def test_attention_is_causal_gqa_over_each_rows_slot():
    rng = np.random.default_rng(2)
    heads, kv_heads, dim, size, steps = 4, 2, 8, 16, 3
    keys, values = rng.normal(0, 1, (2, 2, kv_heads, size, dim)).astype(np.float32)  # [slots, Hkv, S, D]
    q = rng.normal(0, 1, (2 * steps, heads, dim)).astype(np.float32)
    pos, slots = np.array([5, 2], np.int32), np.array([1, 0], np.int32)
    out = np.zeros_like(q)
    ReferenceKernels().attention(q, keys, values, pos, slots, steps, 0.5, out)
    for m in range(2 * steps):
        b, t = divmod(m, steps)
        n = pos[b] + t + 1  # the slot's committed keys and the row's own new ones up to t
        for h in range(heads):
            k, v = keys[slots[b], h // 2, :n], values[slots[b], h // 2, :n]
            p = np.exp(0.5 * k @ q[m, h] - (0.5 * k @ q[m, h]).max())
            np.testing.assert_allclose(out[m, h], p @ v / p.sum(), rtol=1e-5, atol=1e-6)


def test_rope_kv_writes_each_rows_slot_at_its_positions():
    rng = np.random.default_rng(3)
    heads, kv_heads, dim, size = 2, 1, 4, 8
    cos, sin = rng.normal(0, 1, (2, size, dim // 2)).astype(np.float32)
    qkv = rng.normal(0, 1, (4, (heads + 2 * kv_heads) * dim)).astype(np.float32)  # 2 rows of T = 2
    keys, values = np.zeros((2, 3, kv_heads, size, dim), np.float32)
    q = np.zeros((4, heads, dim), np.float32)
    ReferenceKernels().rope_kv(qkv, cos, sin, np.array([3, 0], np.int32), np.array([2, 0], np.int32), 2, heads,
                               kv_heads, q, keys, values)
    x = qkv[1, heads * dim : (heads + 1) * dim]  # row 0, t = 1: position 4 of slot 2
    c, s = cos[4], sin[4]
    np.testing.assert_allclose(keys[2, 0, 4], np.concatenate([x[:2] * c - x[2:] * s, x[2:] * c + x[:2] * s]))
    np.testing.assert_array_equal(values[2, 0, 4], qkv[1, (heads + 1) * dim :])
    assert keys[1].sum() == 0 and np.count_nonzero(keys[0, 0].any(axis=-1)) == 2  # slot 0: positions 0 and 1


def test_argmax_takes_the_first_of_equal_logits():
    logits = np.array([[1, 3, 3, 0], [-np.inf, -np.inf, -1, -1]], np.float32)
    ids, best = np.zeros(2, np.int32), np.zeros(2, np.float32)
    ReferenceKernels().argmax(logits, ids, best)
    assert ids.tolist() == [1, 2] and best.tolist() == [3, -1]


def test_capture_records_without_running_and_replay_runs_the_record():
    kernels, x, out = ReferenceKernels(), np.ones((2, 32), np.float32), np.zeros((2, 32), np.float32)
    gamma = np.full(32, 2, np.float32)
    graph = kernels.capture(lambda: kernels.rmsnorm(x, gamma, 0.0, out))
    assert not out.any() and kernels.launches == 0
    x *= 3  # an input written after capture, as a pinned upload writes one
    kernels.replay(graph)
    assert np.allclose(out, 2.0) and kernels.launches == 1  # RMSNorm of a constant row: gamma
