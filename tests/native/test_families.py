"""The native engine beyond the bias-free LLaMA layout: Qwen2 (q/k/v biases, added after the packed product) runs
natively, the same function as its ONNX graph (logits against onnxruntime over 200 positions, greedy equality for
every drafter, `auto` picks native). A family it does not run falls back to onnxruntime, and `backend_note` says why
(the reason export recorded in the manifest)."""
from __future__ import annotations

import numpy as np
import pytest

from specdec import GenerationConfig
from specdec.manifest import read_manifest
from specdec.native import build
from specdec.runtime import load
from specdec.runtime.backend import unwrapped
from specdec.runtime.native_backend import NativeBackend
from specdec.runtime.ort_backend import OrtBackend
from tests.native.conftest import HEAD_TOKENS, _gqa_export

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")


def _biased_qwen2(folder):
    """A tiny Qwen2 whose q/k/v biases are random (a fresh one's are zero, which would test nothing)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdec.export.tiny import save_tiny

    folder = save_tiny(folder, family="qwen2", seed=0, init_range=0.5, hidden=64)  # head size 16: fused rotary
    model = AutoModelForCausalLM.from_pretrained(folder)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.copy_(torch.randn(projection.bias.shape, generator=generator))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def qwen2_bundles(tmp_path_factory):
    from specdec.calibration.bundle_io import quantized_bundle
    from specdec.calibration.data import DataConfig
    from specdec.calibration.quantize import QuantizeConfig

    model = _biased_qwen2(tmp_path_factory.mktemp("qwen2"))
    bundle = _gqa_export(tmp_path_factory.mktemp("b") / "qwen2", model, draft_from_target="int4")
    config = QuantizeConfig(method="int4-q41", data=DataConfig(seq_len=16, num_samples=4), head_tokens=HEAD_TOKENS)
    return bundle, quantized_bundle(bundle, tmp_path_factory.mktemp("q41") / "q41", config)


def test_qwen2_biases_are_native_weights(qwen2_bundles):
    bundle, _ = qwen2_bundles
    native = read_manifest(bundle).target.native
    assert native is not None and native.layout == "f32"
    assert native.tensors["layers.1.qkv_bias"]["shape"] == [(4 + 2 * 2) * 16]
    weights = NativeBackend(bundle, read_manifest(bundle).target, 2).open().model.weights
    assert np.abs(weights.layers[0].qkv_bias).max() > 0.5  # the random biases, not zeros


def test_qwen2_logits_match_onnxruntime_over_200_positions(qwen2_bundles):
    bundle, _ = qwen2_bundles
    manifest = read_manifest(bundle)
    ids = np.random.default_rng(2).integers(3, 300, (1, 200))
    out = {}
    for cls in (NativeBackend, OrtBackend):
        backend = cls(bundle, manifest.target, 2).open()
        backend.reset(1)
        out[cls] = np.concatenate([backend.forward(ids[:, a:b], np.array([a]))[0]
                                   for a, b in ((0, 17), (17, 18), (18, 23), (23, 150), (150, 200))])
    native, ort = out[NativeBackend], out[OrtBackend]
    assert np.abs(native - ort).max() <= 1e-4 * np.abs(ort).max() and (native.argmax(-1) == ort.argmax(-1)).all()


@pytest.mark.parametrize("drafter,gamma", [("model", 1), ("model", 4), ("auto", 3), ("prompt_lookup", 3)])
def test_qwen2_greedy_identical_to_target_only(qwen2_bundles, drafter, gamma):
    bundle, q41 = qwen2_bundles
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown"
    config = GenerationConfig(max_new_tokens=40, drafter=drafter, gamma=gamma)
    with load(bundle, backend="onnxruntime") as ort:
        reference = ort.generate(prompt, GenerationConfig(max_new_tokens=40, drafter="none")).token_ids
    for path, draft in ((q41, NativeBackend), (bundle, OrtBackend)):
        with load(path) as native:  # auto picks native
            assert native.backend == "native" and isinstance(unwrapped(native.draft), draft)
            assert native.generate(prompt, config).token_ids == reference


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_a_family_the_engine_does_not_run_says_why(tmp_path, family):
    from specdec.export.tiny import save_tiny

    model = save_tiny(tmp_path / "hf", family=family, seed=0, hidden=64)
    bundle = _gqa_export(tmp_path / "b", model, no_draft=True)
    note = read_manifest(bundle).target.native_note
    assert note.startswith(f"{family}, gqa lowering: ") and "native engine does not run" in note, note
    with load(bundle) as gen:
        assert gen.backend == "onnxruntime" and note in gen.backend_note
