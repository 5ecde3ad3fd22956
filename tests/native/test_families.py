"""The native engine beyond Llama: Phi-3 and Mistral (a sliding window, if any, as long as S) are its layout, Qwen2
(q/k/v biases, added after the packed product), Qwen3 (each head of q and k RMS-normalized before rotary) and GPT-2
(LayerNorm, learned positions, a bias on every product, GELU) run natively, the same function as their ONNX graphs
(logits against onnxruntime over 320 positions, greedy equality for every drafter, `auto` picks native, χ² at draft
positions 0-2). A family it does not run falls back to onnxruntime, and `backend_note` says why (the reason export
recorded in the manifest)."""
from __future__ import annotations

import numpy as np
import pytest

from specdec.manifest import read_manifest
from specdec.native import build
from specdec.runtime import load
from specdec.runtime.native_backend import NativeBackend
from tests.native.conftest import _gpt2, _gqa_export, with_q41
from tests.native.parity import (DRAFTER_CASES, assert_greedy_identical_to_target_only,
                                 assert_logits_match_onnxruntime, assert_sampling_matches_the_target)

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


def _normed_qwen3(folder):
    """A tiny Qwen3 with head size 16 (the packed gqa graph's fused rotary) whose q/k norm weights are random (a
    fresh one's are ones, which would not tell q's from k's)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdec.export.tiny import save_tiny

    folder = save_tiny(folder, family="qwen3", seed=0, init_range=0.5, hidden=64, head_dim=16)
    model = AutoModelForCausalLM.from_pretrained(folder)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=generator))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gpt2_bundles(tmp_path_factory):
    return with_q41(tmp_path_factory, "gpt2", _gpt2(tmp_path_factory.mktemp("gpt2")), max_seq_len=384)


@pytest.fixture(scope="module")
def qwen2_bundles(tmp_path_factory):
    return with_q41(tmp_path_factory, "qwen2", _biased_qwen2(tmp_path_factory.mktemp("qwen2")), max_seq_len=384)


@pytest.fixture(scope="module")
def qwen3_bundles(tmp_path_factory):
    return with_q41(tmp_path_factory, "qwen3", _normed_qwen3(tmp_path_factory.mktemp("qwen3")), max_seq_len=384)


def test_qwen2_biases_are_native_weights(qwen2_bundles):
    bundle, _ = qwen2_bundles
    native = read_manifest(bundle).target.native
    assert native is not None and native.layout == "f32"
    assert native.tensors["layers.1.qkv_bias"]["shape"] == [(4 + 2 * 2) * 16]
    weights = NativeBackend(bundle, read_manifest(bundle).target, 2).open().model.weights
    assert np.abs(weights.layers[0].qkv_bias).max() > 0.5  # the random biases, not zeros


def test_qwen3_head_norms_are_native_weights(qwen3_bundles):
    bundle, _ = qwen3_bundles
    native = read_manifest(bundle).target.native
    assert native is not None and native.layout == "f32"
    assert native.tensors["layers.1.q_norm"]["shape"] == [16] and native.tensors["layers.1.k_norm"]["shape"] == [16]
    layer = NativeBackend(bundle, read_manifest(bundle).target, 2).open().model.weights.layers[0]
    assert not np.array_equal(layer.q_norm, layer.k_norm)


def test_gpt2_layernorms_positions_and_biases_are_native_weights(gpt2_bundles):
    """The gqa graph of GPT-2 is LayerNormalization, packed q/k/v, a MatMul and a bias Add for every product,
    GroupQueryAttention without rotary and FastGelu; native export reads all of it."""
    bundle, q41 = gpt2_bundles
    native = read_manifest(bundle).target.native
    assert native is not None and native.layout == "f32" and native.family.activation == "gelu-tanh"
    assert (native.family.norm, native.family.positions, native.family.biases) == \
        ("layer", "learned", ["qkv", "o", "gate_up", "down"])
    assert native.tensors["positions"]["shape"] == [512, 64] and "cos" not in native.tensors
    for name, size in (("qkv_bias", 3 * 64), ("o_bias", 64), ("gate_up_bias", 256), ("down_bias", 64),
                       ("input_norm_bias", 64), ("post_norm_bias", 64)):
        assert native.tensors[f"layers.1.{name}"]["shape"] == [size], name
    weights = NativeBackend(bundle, read_manifest(bundle).target, 2).open().model.weights
    assert weights.layers[0].gate_up.shape == (256, 64) and not weights.gated  # the up rows alone
    for name in ("o_bias", "gate_up_bias", "down_bias", "post_norm_bias"):
        assert np.abs(getattr(weights.layers[0], name)).max() > 0.5, name  # the random ones, not zeros
    assert read_manifest(q41).draft.native is not None  # its int4-q41 draft runs natively too


def test_gpt2_with_exact_gelu_runs_natively(tmp_path):
    """activation_function "gelu" (the erf form): onnxruntime's Gelu in the graph, the same function natively."""
    bundle = _gqa_export(tmp_path / "b", _gpt2(tmp_path / "hf", "gelu"), no_draft=True)
    assert read_manifest(bundle).target.native.family.activation == "gelu"
    assert_logits_match_onnxruntime(bundle)
    with load(bundle) as gen:
        assert gen.backend == "native"


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gpt2"])
def test_logits_match_onnxruntime_over_320_positions(request, family):
    bundle, _ = request.getfixturevalue(f"{family}_bundles")
    assert_logits_match_onnxruntime(bundle, positions=320)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gpt2"])
@pytest.mark.parametrize("drafter,gamma", DRAFTER_CASES)
def test_greedy_identical_to_target_only(request, family, drafter, gamma):
    bundle, q41 = request.getfixturevalue(f"{family}_bundles")
    assert_greedy_identical_to_target_only(bundle, q41, drafter, gamma)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gpt2"])
def test_sampling_matches_the_target_distribution(request, family):
    _, q41 = request.getfixturevalue(f"{family}_bundles")
    assert_sampling_matches_the_target(q41)


def test_the_cuda_backend_refuses_qwen3_and_auto_stays_native(qwen3_bundles):
    from specdec.cuda.reference import ReferenceKernels
    from specdec.errors import BackendError
    from specdec.runtime.cuda_backend import CudaBackend, CudaOptions

    bundle, _ = qwen3_bundles
    with pytest.raises(BackendError, match="q/k heads normalized"):
        CudaBackend(bundle, read_manifest(bundle).target, CudaOptions(kernels=ReferenceKernels)).open()
    with load(bundle) as gen:
        assert gen.backend == "native"


def test_the_cuda_backend_refuses_gpt2(gpt2_bundles):
    from specdec.cuda.reference import ReferenceKernels
    from specdec.errors import BackendError
    from specdec.runtime.cuda_backend import CudaBackend, CudaOptions

    bundle, _ = gpt2_bundles
    with pytest.raises(BackendError, match="GPT-2's layout"):
        CudaBackend(bundle, read_manifest(bundle).target, CudaOptions(kernels=ReferenceKernels)).open()


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_a_family_the_engine_does_not_run_says_why(tmp_path, family):
    """A Qwen3 whose head size (8) keeps q/k unpacked: its norms stay the exporter's decomposed ops; a GPT-2 whose
    MLP is ReLU, which stays Hugging Face's own module."""
    from specdec.export.tiny import save_tiny

    model = save_tiny(tmp_path / "hf", family=family, seed=0, hidden=64) if family == "qwen3" else \
        _gpt2(tmp_path / "hf", "relu")
    bundle = _gqa_export(tmp_path / "b", model, no_draft=True)
    note = read_manifest(bundle).target.native_note
    why = {"qwen3": "rotates whole heads of a multiple of 16", "gpt2": "MLP is neither SiLU(gate)·up"}[family]
    assert note.startswith(f"{family}, gqa lowering: ") and why in note, note
    with load(bundle) as gen:
        assert gen.backend == "onnxruntime" and note in gen.backend_note


def _mistral_with_window(folder, window: int):
    import json

    from specdec.export.tiny import save_tiny

    folder = save_tiny(folder, family="mistral", seed=0, init_range=0.5, hidden=64)
    config = json.loads((folder / "config.json").read_text())
    config["sliding_window"] = window
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_window_as_long_as_s_runs_natively(tmp_path):
    """A sliding window of S positions or more never masks a key (Phi-3-mini's 2047, Mistral 7B v0.1's 4096 beside
    a shorter S): the gqa lowering exports it, and the native target computes its graph's function."""
    model = _mistral_with_window(tmp_path / "hf", 256)  # _gqa_export's S
    bundle = _gqa_export(tmp_path / "b", model, no_draft=True)
    assert read_manifest(bundle).target.native is not None
    assert_logits_match_onnxruntime(bundle)


def test_a_window_shorter_than_s_runs_natively(tmp_path):
    """A sliding window of 24 keys beside S = 256: the gqa graph's GroupQueryAttention gets local_window_size 24 and
    computes the checkpoint's function (its logits against the plain lowering's, whose mask export checks against
    PyTorch, over 120 positions: five windows), and the native engine computes the graph's (over 200)."""
    from specdec.export.bundle import export_bundle
    from specdec.export.config import ExportConfig
    from specdec.runtime.ort_backend import OrtBackend

    model = _mistral_with_window(tmp_path / "hf", 24)
    bundle = _gqa_export(tmp_path / "b", model, no_draft=True)
    native = read_manifest(bundle).target.native
    assert native is not None and native.family.window == 24
    assert_logits_match_onnxruntime(bundle)
    plain = export_bundle(ExportConfig(out=tmp_path / "plain", target=str(model), max_seq_len=256, max_batch=4,
                                       max_prefill_chunk=16, progress=False, lowering="plain", no_draft=True))
    ids = np.random.default_rng(2).integers(3, 300, (1, 120))
    logits = []
    for path in (plain, bundle):
        backend = OrtBackend(path, read_manifest(path).target, 2).open()
        backend.reset(1)
        logits.append(np.concatenate([backend.forward(ids[:, a:b], np.array([a]))[0]
                                      for a, b in ((0, 17), (17, 18), (18, 40), (40, 120))]))
    assert np.abs(logits[0] - logits[1]).max() <= 1e-4 * np.abs(logits[0]).max()
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).all()
    with load(bundle) as gen:
        assert gen.backend == "native"


@pytest.mark.parametrize("family", ["phi3", "mistral"])
def test_packed_and_plain_llama_layouts_run_natively(tmp_path, family):
    """Phi-3 (q/k/v and gate/up packed in its checkpoint) and Mistral without a window are the LLaMA layout."""
    from specdec.export.tiny import save_tiny

    model = save_tiny(tmp_path / "hf", family=family, seed=0, init_range=0.5, hidden=64)
    bundle = _gqa_export(tmp_path / "b", model, no_draft=True)
    assert read_manifest(bundle).target.native is not None
    assert_logits_match_onnxruntime(bundle)
