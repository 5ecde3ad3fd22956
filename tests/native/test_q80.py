"""Targets from a Q8_0 GGUF: every linear weight on a Q8_0 grid keeps its blocks (layout "q80", blk8: 34 bytes per
32 weights as stored, not 128 as fp32 rows), multiplied by the kernels the head's blocks already use, so the native
target computes the fp32 graph's function. Its int4-q41 draft is fitted to the blocks' values. Logits against
onnxruntime over 200 positions, greedy equality for every drafter, the sampled output's distribution."""
from __future__ import annotations

import numpy as np
import pytest

from specdec.blocks import BLOCK8, float_rows, q8_blocks
from specdec.manifest import read_manifest
from specdec.native import build
from specdec.runtime.native_backend import NativeBackend
from tests.native.conftest import with_q41
from tests.native.parity import (DRAFTER_CASES, assert_greedy_identical_to_target_only,
                                 assert_logits_match_onnxruntime, assert_sampling_matches_the_target)

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")


@pytest.fixture(scope="module")
def q80_bundle(tmp_path_factory):
    """(a tiny LLaMA on Q8_0 grids, exported; the same with its native int4-q41 draft)"""
    from specdec.export.tiny import save_tiny_on_grids

    model = save_tiny_on_grids(tmp_path_factory.mktemp("q80"), q80=True, family="llama", seed=0, init_range=0.5,
                               hidden=64)  # head size 16: the fused rotary of the packed gqa graph
    return with_q41(tmp_path_factory, "q80", model)


def test_layout_keeps_the_blocks(q80_bundle):
    bundle, q41 = q80_bundle
    entry = read_manifest(bundle).target
    assert entry.native.layout == "q80"
    assert entry.native.tensors["layers.0.qkv"]["kind"] == "blk8"
    weights = (bundle / entry.native.path).stat().st_size
    assert weights < 0.35 * (bundle / "target" / "model.onnx.data").stat().st_size  # ~9 bits a weight, not 32
    assert read_manifest(q41).draft.native.layout == "q41-draft"


def test_block_products_match_numpy(q80_bundle):
    bundle, _ = q80_bundle
    model = NativeBackend(bundle, read_manifest(bundle).target, 2).open().model
    rng = np.random.default_rng(1)
    for rows, columns, k in ((1, 5, 32), (5, 37, 96), (9, 50, 576)):
        blocks, _ = q8_blocks(rng.normal(0, 0.1, (columns, k)).astype(np.float32))
        assert blocks.dtype == BLOCK8
        weight = float_rows(blocks)
        x = rng.normal(0, 2, (rows, k)).astype(np.float32)
        want = x.astype(np.float64) @ weight.T.astype(np.float64)
        step = model.matmul(x, blocks, threads=2)
        assert np.abs(step - want).max() <= 1e-5 * np.abs(want).max()
        assert np.abs(model.matmul(x, blocks, "prompt", threads=2) - want).max() <= 1e-5 * np.abs(want).max()


def test_logits_match_onnxruntime_over_200_positions(q80_bundle):
    bundle, _ = q80_bundle
    assert_logits_match_onnxruntime(bundle)


@pytest.mark.parametrize("drafter,gamma", DRAFTER_CASES)
def test_greedy_identical_to_target_only(q80_bundle, drafter, gamma):
    bundle, q41 = q80_bundle
    assert_greedy_identical_to_target_only(bundle, q41, drafter, gamma)


def test_sampling_matches_the_target_distribution(q80_bundle):
    _, q41 = q80_bundle
    assert_sampling_matches_the_target(q41)
