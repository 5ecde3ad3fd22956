"""The native library and the table of weight kinds (specdec_kinds.h): the library reports the table Python reads, and
its dispatch serves exactly what the table lists: every kernel the table gives a kind computes the product of the
numpy decoder's values (blocks, pairs, rows), every other is refused, and so is every id past the table. A kind the
table lists without its kernels in linear.c (KIND_OPS) fails here. The sanitizer run (make test-sanitize) runs it."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from specdec.blocks import encode, float_rows
from specdec.native import build
from specdec.weight_kinds import ISA_BITS, KERNELS, Kernel, WeightKind

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")
E_NULL, E_SHAPE = 1, 2  # specdec_native.h


def product(x: np.ndarray, weights: np.ndarray, kind: int, kernel: int, threads: int = 2) -> tuple[int, np.ndarray]:
    """(status, y [M, N]) of specdec_matmul, called raw."""
    lib = build.load_kernels()
    y = np.zeros((len(x), len(weights)), np.float32)
    need = lib.specdec_matmul_scratch_bytes(x.shape[0], x.shape[1], kernel, threads)
    scratch = np.empty(max(need, 64), np.uint8)
    status = lib.specdec_matmul(x.ctypes.data, x.shape[0], x.shape[1], weights.ctypes.data, weights.shape[1], kind,
                                kernel, y.ctypes.data, len(weights), scratch.ctypes.data, scratch.size, threads)
    return status, y


def test_the_library_reports_the_table_python_reads():
    lib = build.load_kernels()
    found, build_isa = build.library_kinds(lib)
    assert found == [kind.traits() for kind in WeightKind] and build_isa == ISA_BITS[build.isa()]
    traits = (ctypes.c_int32 * 5)()
    assert [lib.specdec_weight_kind(kind, traits) for kind in (-1, len(WeightKind), 1 << 30)] == [E_SHAPE] * 3
    assert lib.specdec_weight_kind(0, None) == E_NULL


@pytest.mark.parametrize("kind", list(WeightKind), ids=lambda kind: kind.label)
def test_every_kernel_the_table_lists_runs_and_no_other(kind):
    rng = np.random.default_rng(int(kind))
    weights = encode(kind, rng.normal(0, 0.1, (37, 96)).astype(np.float32))  # 3 blocks: the pairs end half empty
    x = rng.normal(0, 1, (5, 96)).astype(np.float32)
    want = x @ float_rows(weights)[:, :96].T
    for kernel in Kernel:
        status, y = product(x, weights, kind, KERNELS[kernel])
        # bf16 activations run where the CPU has AMX-BF16, in the AVX-512 builds (test_bf16_activations.py)
        amx = kernel is not Kernel.BF16A or build.kernel_runs(build.load_kernels(), kernel, kind)
        if kernel not in kind.kernels or not amx:
            assert status == E_SHAPE, f"{kind.label} by the {kernel} kernel, which the table does not give it"
            continue
        assert status == 0, f"{kind.label} by the {kernel} kernel: status {status}"
        scale = np.abs(want).max()  # int8 activations: each rounded to 1/(127 * 128) of its block's largest (the
        # draft's two parts), or to 1/127 of it (one part: the int8 activations mode's)
        tolerance = {Kernel.INT8: 1e-3, Kernel.Q8A: 3e-2, Kernel.Q8A_REF: 3e-2, Kernel.BF16A: 1e-2}.get(kernel, 1e-5)
        np.testing.assert_allclose(y, want, rtol=0, atol=scale * tolerance)


def test_a_kind_past_the_table_or_a_count_it_does_not_have_is_refused():
    x, weights = np.ones((2, 64), np.float32), encode(WeightKind.Q41, np.ones((3, 64), np.float32))
    assert product(x, weights, len(WeightKind), KERNELS[Kernel.STEP])[0] == E_SHAPE
    assert product(x, weights, -1, KERNELS[Kernel.STEP])[0] == E_SHAPE
    assert product(x, weights, WeightKind.Q41, len(Kernel))[0] == E_SHAPE  # no such kernel
    rows = encode(WeightKind.F32, np.ones((3, 64), np.float32))  # rows: K elements a column, not K / 32
    assert product(x, rows, WeightKind.F32, KERNELS[Kernel.STEP])[0] == 0
    assert product(x, rows[:, :2].copy(), WeightKind.F32, KERNELS[Kernel.STEP])[0] == E_SHAPE
