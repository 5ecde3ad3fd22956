"""The tiny bundles of the native backend's tests."""
from __future__ import annotations

import pytest

from specdec.calibration.bundle_io import quantized_bundle
from specdec.calibration.data import DataConfig
from specdec.calibration.quantize import QuantizeConfig
from specdec.export.bundle import export_bundle
from specdec.export.config import ExportConfig
from specdec.export.tiny import save_tiny, save_tiny_on_grids
from specdec.native import build
from specdec.native_record import Activations

HEAD_TOKENS = 48  # of the tiny vocabulary: the int4-q41 draft's trimmed head leaves tokens out


def _gqa_export(out, model, max_seq_len=256, **options):
    config = ExportConfig(out=out, target=str(model), max_seq_len=max_seq_len, gamma=3, gamma_max=6, max_batch=4,
                          max_prefill_chunk=16, progress=False, lowering="gqa",
                          **{"activations": Activations.FP32, **options})
    return export_bundle(config)


def with_q41(tmp_path_factory, name: str, model, max_seq_len: int = 256):
    """(`model` exported with an onnxruntime int4 draft; the same with its native int4-q41 draft, head trimmed to
    HEAD_TOKENS)"""
    bundle = _gqa_export(tmp_path_factory.mktemp("b") / name, model, max_seq_len=max_seq_len,
                         draft_from_target="int4")
    config = QuantizeConfig(method="int4-q41", data=DataConfig(seq_len=16, num_samples=4), head_tokens=HEAD_TOKENS)
    return bundle, quantized_bundle(bundle, tmp_path_factory.mktemp("q41") / "q41", config)


def _gpt2(folder, activation: str = "gelu_new"):
    """A tiny GPT-2 whose biases and LayerNorm weights are random (a fresh one's are zeros and ones, which would test
    nothing: the exporter even drops zero biases), with the given Hugging Face activation."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from specdec.export.tiny import save_tiny

    folder = save_tiny(folder, family="gpt2", seed=0, init_range=0.5, hidden=64)
    config = json.loads((folder / "config.json").read_text())
    config["activation_function"] = activation
    (folder / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(folder)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                base = 1.0 if name.endswith("weight") else 0.0
                parameter.copy_(base + 0.5 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gpt2_bundle(tmp_path_factory):
    """A tiny GPT-2 with random biases and LayerNorm weights (GPT-2's layout on the native kernels), no draft."""
    return _gqa_export(tmp_path_factory.mktemp("b") / "gpt2", _gpt2(tmp_path_factory.mktemp("gpt2")), no_draft=True)


@pytest.fixture(scope="module")
def grid_bundle(tmp_path_factory):
    """A tiny LLaMA whose weights lie on the GGUF grids, exported with an int4 (MatMulNBits) draft."""
    model = save_tiny_on_grids(tmp_path_factory.mktemp("grid"), family="llama", seed=0, init_range=0.5,
                               hidden=64)  # head size 16: the fused rotary of the packed gqa graph
    return _gqa_export(tmp_path_factory.mktemp("b") / "grid", model, draft_from_target="int4")


@pytest.fixture(scope="module")
def off_grid_bundle(tmp_path_factory):
    """The same tiny LLaMA with its random fp32 weights."""
    model = save_tiny(tmp_path_factory.mktemp("off"), family="llama", seed=0, init_range=0.5, hidden=64)
    return _gqa_export(tmp_path_factory.mktemp("b") / "off", model)


@pytest.fixture(scope="module")
def q41_bundle(grid_bundle, tmp_path_factory):
    """grid_bundle with make demo's kind of draft: int4-q41, its head trimmed to HEAD_TOKENS (and special) tokens."""
    config = QuantizeConfig(method="int4-q41", data=DataConfig(seq_len=16, num_samples=4), head_tokens=HEAD_TOKENS)
    return quantized_bundle(grid_bundle, tmp_path_factory.mktemp("q41") / "q41", config)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A kernels cache of this test's own (SPECDEC_CACHE), and no library loaded yet in this process."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    build.forget_kernels()
    yield tmp_path
    build.forget_kernels()
