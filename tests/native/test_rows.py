"""Targets in a checkpoint's own precision: a bf16 or f16 checkpoint exported to fp32 keeps its weights exactly, and
the native weights hold them as bf16 / f16 rows (fp32 rows for weights in neither); the kernels multiply them with
fp32 activations, so the native target computes the fp32 graph's function. Its int4-q41 draft is fitted to those
rows. Products against numpy (the prompt kernel equal to the step kernel bit for bit), logits against onnxruntime
over 200 positions, greedy equality for every drafter, and the sampled output's distribution."""
from __future__ import annotations

import numpy as np
import pytest

from specdec import GenerationConfig
from specdec.blocks import float_rows, row_precision, rows_of
from specdec.manifest import read_manifest
from specdec.native import build
from specdec.runtime import load
from specdec.runtime.native_backend import NativeBackend
from tests.native.conftest import HEAD_TOKENS, _gqa_export
from tests.native.parity import (DRAFTER_CASES, assert_greedy_identical_to_target_only,
                                 assert_logits_match_onnxruntime, assert_sampling_matches_the_target)

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def half_bundle(request, tmp_path_factory):
    """(precision, a bundle of a half-precision tiny LLaMA with its native int4-q41 draft)"""
    from specdec.calibration.bundle_io import quantized_bundle
    from specdec.calibration.data import DataConfig
    from specdec.calibration.quantize import QuantizeConfig
    from specdec.export.tiny import save_tiny_in

    model = save_tiny_in(tmp_path_factory.mktemp("half"), request.param, family="llama", seed=0, init_range=0.5,
                         hidden=64)
    bundle = _gqa_export(tmp_path_factory.mktemp("b") / "half", model, draft_from_target="int4")
    config = QuantizeConfig(method="int4-q41", data=DataConfig(seq_len=16, num_samples=4), head_tokens=HEAD_TOKENS)
    q41 = quantized_bundle(bundle, tmp_path_factory.mktemp("q41") / "q41", config)
    return {"bfloat16": "bf16", "float16": "f16"}[request.param], bundle, q41


def test_precision_is_the_narrowest_exact_one():
    rng = np.random.default_rng(0)
    weight = rng.normal(0, 1, (8, 64)).astype(np.float32)
    bf16 = float_rows(rows_of(weight, "bf16"))  # the top 16 bits of each: a bf16 value
    assert row_precision([bf16]) == "bf16" and np.array_equal(float_rows(rows_of(bf16, "bf16")), bf16)
    half = weight.astype(np.float16).astype(np.float32)
    assert row_precision([half]) == "f16" and row_precision([weight]) == "f32" and row_precision([bf16, weight]) == "f32"


@pytest.mark.parametrize("precision", ["bf16", "f16", "f32"])
def test_row_products_match_numpy(half_bundle, precision):
    _, bundle, _ = half_bundle
    model = NativeBackend(bundle, read_manifest(bundle).target, 2).open().model
    rng = np.random.default_rng(1)
    for rows, columns, k in ((1, 5, 32), (5, 37, 96), (9, 50, 576)):
        weight = rng.normal(0, 0.1, (columns, k)).astype(np.float32)
        weight = weight.astype(np.float16).astype(np.float32) if precision == "f16" else weight
        weight = float_rows(rows_of(weight, "bf16")) if precision == "bf16" else weight
        stored = rows_of(weight, precision)
        x = rng.normal(0, 2, (rows, k)).astype(np.float32)
        want = x.astype(np.float64) @ weight.T.astype(np.float64)
        step = model.matmul(x, stored, threads=2)
        assert np.abs(step - want).max() <= 1e-5 * np.abs(want).max()
        assert np.array_equal(step, model.matmul(x, stored, "prompt", threads=2))


def test_layout_and_size(half_bundle):
    precision, bundle, q41 = half_bundle
    entry = read_manifest(bundle).target
    assert entry.native.layout == precision
    weights = (bundle / entry.native.path).stat().st_size
    assert weights < 0.55 * (bundle / "target" / "model.onnx.data").stat().st_size  # 2 bytes a weight, not 4
    assert read_manifest(q41).draft.native.layout == "q41-draft"


def test_logits_match_onnxruntime_over_200_positions(half_bundle):
    _, bundle, _ = half_bundle
    assert_logits_match_onnxruntime(bundle)


@pytest.mark.parametrize("drafter,gamma", DRAFTER_CASES)
def test_greedy_identical_to_target_only(half_bundle, drafter, gamma):
    _, bundle, q41 = half_bundle
    assert_greedy_identical_to_target_only(bundle, q41, drafter, gamma)


def test_sampling_matches_the_target_distribution(half_bundle):
    _, _, q41 = half_bundle
    assert_sampling_matches_the_target(q41)


@pytest.mark.parametrize("weights,checkpoint", [("bf16", "bfloat16"), ("fp16", "float16")])
def test_export_weights_option_gives_the_half_checkpoints_bundle(tmp_path, weights, checkpoint):
    """`specdec-export --weights bf16` of an fp32 checkpoint writes the graph and native rows that exporting the
    checkpoint saved in bf16 writes: the same bytes; and the native engine opens it."""
    from specdec.export.tiny import save_tiny, save_tiny_in

    options = {"family": "llama", "seed": 0, "init_range": 0.5, "hidden": 64}
    half = _gqa_export(tmp_path / "a", save_tiny_in(tmp_path / "half", checkpoint, **options), no_draft=True)
    rounded = _gqa_export(tmp_path / "b", save_tiny(tmp_path / "full", **options), no_draft=True, weights=weights)
    entry = read_manifest(rounded).target
    assert entry.native.layout == {"bf16": "bf16", "fp16": "f16"}[weights] == read_manifest(half).target.native.layout
    for name in (entry.native.path, "target/model.onnx.data"):
        assert (rounded / name).read_bytes() == (half / name).read_bytes(), name
    plain = _gqa_export(tmp_path / "c", save_tiny(tmp_path / "full2", **options), no_draft=True)
    assert read_manifest(plain).target.native.layout == "f32"  # without the option, fp32 weights stay fp32 rows
    from specdec.cli.describe import describe_bundle

    assert f"native     {entry.native.layout} weights (target/native.bin)" in describe_bundle(rounded)
    with load(rounded, backend="native") as gen:
        assert gen.generate("The quick", GenerationConfig(max_new_tokens=4)).token_ids
