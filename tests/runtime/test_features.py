"""The forward seam: a request for hidden states, what each backend declares it returns, and the features themselves
against PyTorch's own layer outputs (onnxruntime with either lowering, the native engine, the cuda backend on its
numpy references)."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.cli.export import _layers
from specdec.cuda.reference import ReferenceKernels
from specdec.errors import BackendError, ConfigError, ManifestError
from specdec.export.config import ExportConfig
from specdec.export.tiny import save_tiny
from specdec.manifest import read_manifest
from specdec.native import build
from specdec.runtime.cuda_backend import CudaBackend, CudaOptions
from specdec.runtime.forward import ForwardRequest, Observed, Output, head_feature_layers
from specdec.runtime.native_backend import NativeBackend
from specdec.runtime.ort_backend import OrtBackend

TOLERANCE = 1e-4  # of the largest |hidden state|: fp32 in another summation order
LAYERS = (2, 0)  # in the order the graph returns them, not sorted
needs_native = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA, F16C")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("features"), "llama", layers=4, seed=3, hidden=64, init_range=0.5)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, model_dir, export_tiny):
    root = tmp_path_factory.mktemp("b")
    made = {lowering: export_tiny(root / lowering, model_dir, lowering=lowering, feature_layers=LAYERS,
                                  draft_from_target="int4") for lowering in ("gqa", "plain")}
    made["none"] = export_tiny(root / "none", model_dir, lowering="gqa", no_draft=True)
    return made


def reference(model_dir, tokens: list) -> np.ndarray:
    """Each layer's output for every token: [L, T, H], by hooks on the Hugging Face model's own decoder layers."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    outputs = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: outputs.append(out[0] if isinstance(out, tuple) else out))
             for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]))
    for hook in hooks:
        hook.remove()
    return np.stack([out[0].float().numpy() for out in outputs])


def open_backend(kind: str, bundle):
    entry = read_manifest(bundle).target
    if kind == "native":
        return NativeBackend(bundle, entry).open()
    if kind == "cuda":
        return CudaBackend(bundle, entry, CudaOptions(kernels=ReferenceKernels)).open()
    return OrtBackend(bundle, entry).open()


def features_of(backend, tokens: list, split: int, layers: tuple) -> np.ndarray:
    """A prefill of tokens[:split] on slot 1 and a last-only verify pass of the rest beside a one-token row on slot 0;
    -> the features of every fed token of slot 1, [T, F, H]."""
    backend.reset(2)
    first = backend.run(ForwardRequest(np.array([tokens[:split]]), np.array([0]), slots=np.array([1]),
                                       feature_layers=layers))
    rest = tokens[split:]
    ids = np.array([rest, [7] * len(rest)])
    second = backend.run(ForwardRequest(ids, np.array([split, 0]), last_only=True, slots=np.array([1, 0]),
                                        feature_layers=layers))
    assert second.logits.shape[:2] == (2, 1) and second.features.shape[:2] == (2, len(rest))
    return np.concatenate([first.features[0], second.features[0]])


@pytest.mark.parametrize("kind", ["gqa", "plain", "native", "cuda"])
def test_features_are_the_layer_outputs_pytorch_computes(kind, bundles, model_dir):
    if kind in ("native", "cuda") and build.missing_cpu_flags():
        pytest.skip("the native kernels need AVX2, FMA, F16C")
    tokens = [5, 17, 33, 2, 90, 41, 8, 66, 12]
    expected = reference(model_dir, tokens)  # [L, T, H]
    backend = open_backend(kind, bundles["plain" if kind == "plain" else "gqa"])
    try:
        got = features_of(backend, tokens, 6, LAYERS)  # [T, F, H]
    finally:
        backend.close()
    want = np.stack([expected[layer] for layer in LAYERS], axis=1)
    assert got.shape == want.shape == (len(tokens), len(LAYERS), 64)
    assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max(), np.abs(got - want).max()


@needs_native
@pytest.mark.parametrize("kind", ["native", "cuda"])
def test_the_kernel_engines_return_any_layer_and_the_same_logits(kind, bundles, model_dir):
    tokens = [9, 4, 77, 3, 21]
    backend = open_backend(kind, bundles["none"])  # a graph without features: the engines read no graph
    try:
        assert Output.FEATURES in backend.capabilities and backend.capabilities.feature_layers is None
        got = features_of(backend, tokens, 3, (3, 1))
        backend.reset(1)
        plain = np.asarray(backend.forward(np.array([tokens]), np.array([0])))
        backend.reset(1)
        both = backend.run(ForwardRequest(np.array([tokens]), np.array([0]), feature_layers=(1,)))
        assert np.array_equal(np.asarray(both.logits), plain)  # asking for features changes no logit
    finally:
        backend.close()
    expected = reference(model_dir, tokens)
    want = np.stack([expected[3], expected[1]], axis=1)
    assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max()


def test_onnxruntime_returns_only_the_layers_its_graph_holds(bundles):
    backend = open_backend("gqa", bundles["gqa"])
    try:
        assert backend.capabilities.feature_layers == LAYERS and Output.FEATURES in backend.capabilities
        backend.reset(1)
        with pytest.raises(BackendError, match=r"(?s)layers \[2, 0\], not \[1\].*Hint: re-export"):
            backend.run(ForwardRequest(np.array([[1, 2]]), np.array([0]), feature_layers=(1,)))
        with pytest.raises(BackendError, match=r"outside the model's layers 0..3"):
            backend.run(ForwardRequest(np.array([[1, 2]]), np.array([0]), feature_layers=(4,)))
        picked = backend.run(ForwardRequest(np.array([[1, 2]]), np.array([0]), feature_layers=(0,)))
        assert picked.features.shape == (1, 2, 1, 64)
    finally:
        backend.close()
    plain = open_backend("gqa", bundles["none"])
    try:
        assert Output.FEATURES not in plain.capabilities
        plain.reset(1)
        with pytest.raises(BackendError, match="(?s)returns no hidden states.*--feature-layers"):
            Observed(plain).run(ForwardRequest(np.array([[1]]), np.array([0]), feature_layers=(0,)))
    finally:
        plain.close()


def test_the_manifest_records_the_layers_and_the_draft_returns_none(bundles):
    manifest = read_manifest(bundles["gqa"])
    assert manifest.target.feature_layers == list(LAYERS) and manifest.draft.feature_layers == []
    assert [spec.name for spec in manifest.target.outputs][-1] == "features"
    assert read_manifest(bundles["none"]).target.feature_layers == []
    draft = OrtBackend(bundles["gqa"], manifest.draft).open()
    try:
        assert "features" not in [output.name for output in draft.session.get_outputs()]
    finally:
        draft.close()


def test_a_manifest_edited_to_claim_features_its_graph_lacks_is_refused(bundles, tmp_path):
    import shutil

    bundle = shutil.copytree(bundles["none"], tmp_path / "edited")
    data = json.loads((bundle / "manifest.json").read_text())
    data["models"]["target"]["feature_layers"] = [0]
    data["models"]["target"]["outputs"].append({"name": "features", "dtype": "float32", "shape": ["B", "T", 1, 64]})
    (bundle / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="has no output features"):
        OrtBackend(bundle, read_manifest(bundle).target).open()


def test_feature_layer_options():
    assert head_feature_layers(30) == (1, 14, 26) and head_feature_layers(2) == (0, 1)
    assert _layers("head") is None and _layers("none") == () and _layers("1,14,26") == (1, 14, 26)
    with pytest.raises(argparse.ArgumentTypeError, match="layer numbers"):
        _layers("first")
    config = ExportConfig(out="x", feature_layers=None)
    assert config.target_features(30) == (1, 14, 26)
    with pytest.raises(ConfigError, match="(?s)past the target.s 4.*Hint"):
        ExportConfig(out="x", feature_layers=(1, 4)).target_features(4)
    for bad in ((1, 1), (-1,), "1,2", tuple(range(17))):
        with pytest.raises(ConfigError, match="Hint"):
            ExportConfig(out="x", feature_layers=bad)
