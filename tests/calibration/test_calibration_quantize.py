"""Quantized tiny models as drafts (and a quantized target) keep greedy equality; the manifest records the method."""
from __future__ import annotations

import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from specdec import GenerationConfig, load
from specdec.calibration.bundle_io import quantized_bundle
from specdec.calibration.data import DataConfig
from specdec.calibration.q41 import q41_from_onnx, q41_from_weight
from specdec.calibration.quantize import QuantizeConfig, quantize_onnx
from specdec.errors import ConfigError, MissingDependencyError
from specdec.manifest import check_bundle_files, read_manifest

PROMPTS = ["The quick brown fox", "def add(a, b):", "Summarize the following text", "a + b\n"]
DATA = DataConfig(seq_len=16, num_samples=4)  # the tiny tokenizer's built-in-set windows


def _greedy_equal(bundle, gammas=(1, 3, 6)):
    with load(bundle) as gen:
        for prompt in PROMPTS:
            plain = gen.generate(prompt, GenerationConfig(max_new_tokens=16, drafter="none")).token_ids
            for gamma in gammas:
                got = gen.generate(prompt, GenerationConfig(max_new_tokens=16, drafter="model", gamma=gamma))
                assert got.token_ids == plain, (prompt, gamma)


@pytest.mark.parametrize("method", ["int4-rtn", "int4-hqq", "int4-gptq", "int4-q41", "int8-qdq"])
def test_quantized_draft_keeps_greedy_equality(int4_bundle, tmp_path, method):
    out = quantized_bundle(int4_bundle, tmp_path / method, QuantizeConfig(method=method, data=DATA))
    manifest = read_manifest(out)
    check_bundle_files(out, manifest)
    draft = manifest.draft
    assert draft.precision == ("int8-qdq" if method == "int8-qdq" else "int4") and draft.derived == method
    assert draft.calibration["method"] == method
    assert (draft.calibration["data"] is not None) == (method in ("int4-gptq", "int8-qdq"))
    ops = {node.op_type for node in onnx.load(str(out / draft.onnx_path), load_external_data=False).graph.node}
    assert ("QuantizeLinear" if method == "int8-qdq" else "MatMulNBits") in ops
    _greedy_equal(out)


def test_quantized_target_serves_with_the_existing_draft(int4_bundle, tmp_path):
    out = quantized_bundle(int4_bundle, tmp_path / "q8target", QuantizeConfig(method="int8-qdq", role="target", data=DATA))
    manifest = read_manifest(out)
    assert manifest.target.precision == "int8-qdq" and manifest.draft.precision == "int4"
    _greedy_equal(out, gammas=(2,))


def _single_matmul(path, weight):
    k, n = weight.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "T", n])], [numpy_helper.from_array(weight, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))


def test_q41_grid_weight_is_reproduced_exactly(tmp_path):
    rng = np.random.default_rng(0)
    k, n = 64, 24
    scale = rng.uniform(0.01, 0.1, (k // 32, 1, n)).astype(np.float32)
    low = rng.uniform(-0.5, 0.0, (k // 32, 1, n)).astype(np.float32)
    codes = rng.integers(0, 16, (k // 32, 32, n))
    codes[:, 0], codes[:, 1] = 0, 15  # each block spans its whole grid, as a Q4_1 block does
    weight = (codes * scale + low).reshape(k, n).astype(np.float32)
    assert q41_from_weight(weight)["grid_error"] < 1e-3
    _single_matmul(tmp_path / "fp32.onnx", weight)
    stats = q41_from_onnx(tmp_path / "fp32.onnx", tmp_path / "q41" / "model.onnx", accuracy_level=1)
    assert stats == {"quantized": 1, "on_grid": 1, "max_grid_error": stats["max_grid_error"]}
    x = rng.standard_normal((2, 3, k)).astype(np.float32)
    session = ort.InferenceSession(str(tmp_path / "q41" / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": x})[0]
    assert np.abs(got - x @ weight).max() <= 1e-5 * np.abs(x @ weight).max()


def test_precision_the_backend_does_not_run_is_refused():
    with pytest.raises(ConfigError, match="not supported by the tensorrt back end") as err:
        QuantizeConfig(method="int4-gptq", backend="tensorrt")
    assert "Hint:" in str(err.value) and "int8-qdq" in str(err.value)
    with pytest.raises(ConfigError, match="fp8-qdq .* onnxruntime"):
        QuantizeConfig(method="modelopt-fp8", backend="onnxruntime")
    with pytest.raises(ConfigError, match="unknown"):
        QuantizeConfig(method="int3")


def test_data_aware_method_without_data_and_missing_modelopt(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="needs calibration data"):
        quantize_onnx(tmp_path / "m.onnx", tmp_path / "o" / "m.onnx", QuantizeConfig(method="int4-gptq"), None)
    monkeypatch.setitem(sys.modules, "modelopt", None)
    monkeypatch.setitem(sys.modules, "modelopt.onnx", None)
    monkeypatch.setitem(sys.modules, "modelopt.onnx.quantization", None)
    with pytest.raises(MissingDependencyError) as err:
        quantize_onnx(tmp_path / "m.onnx", tmp_path / "o" / "m.onnx", QuantizeConfig(method="modelopt-int8"), object())
    assert "pip install 'specdec[modelopt]'" in str(err.value)


def test_bundle_errors(int4_bundle, tmp_path):
    config = QuantizeConfig(method="int4-rtn", data=DATA)
    with pytest.raises(ConfigError, match="already exists"):
        quantized_bundle(int4_bundle, int4_bundle.parent, config)
    with pytest.raises(ConfigError, match="one window needs"):
        quantized_bundle(int4_bundle, tmp_path / "x", QuantizeConfig(method="int4-rtn", data=DataConfig(seq_len=100000)))
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.*"))


@pytest.mark.parametrize("method", ["int4-q41", "int8-qdq"])
def test_quantized_draft_of_a_gqa_bundle_keeps_greedy_equality(gqa_int4_bundle, tmp_path, method):
    out = quantized_bundle(gqa_int4_bundle, tmp_path / method, QuantizeConfig(method=method, data=DATA))
    assert read_manifest(out).draft.lowering == "gqa"
    _greedy_equal(out, gammas=(1, 4))
