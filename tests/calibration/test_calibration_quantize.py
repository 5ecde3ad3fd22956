"""Quantized tiny models as drafts (and a quantized target) keep greedy equality; the manifest records the method."""
from __future__ import annotations

import dataclasses
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from specdec import GenerationConfig, load
from specdec.calibration.bundle_io import quantized_bundle, write_manifest
from specdec.calibration.data import DataConfig
from specdec.calibration.q41 import q41_from_onnx, q41_from_weight, q8_0_from_weight
from specdec.calibration.quantize import QuantizeConfig, quantize_onnx
from specdec.errors import ConfigError, MissingDependencyError
from specdec.manifest import check_bundle_files, read_manifest, sha256_file

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
    assert draft.calibration.method == method
    assert (draft.calibration.data is not None) == (method in ("int4-gptq", "int8-qdq"))
    ops = {node.op_type for node in onnx.load(str(out / draft.onnx_path), load_external_data=False).graph.node}
    assert ("QuantizeLinear" if method == "int8-qdq" else "MatMulNBits") in ops
    _greedy_equal(out)


def test_quantized_target_serves_with_the_existing_draft(int4_bundle, tmp_path):
    out = quantized_bundle(int4_bundle, tmp_path / "q8target", QuantizeConfig(method="int8-qdq", role="target", data=DATA))
    manifest = read_manifest(out)
    assert manifest.target.precision == "int8-qdq" and manifest.draft.precision == "int4"
    _greedy_equal(out, gammas=(2,))


@pytest.mark.parametrize("backend", ["onnxruntime", "tensorrt"])
def test_int8_keeps_the_mlp_down_projections_fp32(int4_bundle, tmp_path, backend):
    out = quantized_bundle(int4_bundle, tmp_path / backend, QuantizeConfig(method="int8-qdq", data=DATA, backend=backend))
    manifest = read_manifest(out)
    graph = onnx.load(str(out / manifest.draft.onnx_path)).graph
    producers = {o: node for node in graph.node for o in node.output}
    constants = {init.name for init in graph.initializer}
    weights = constants | {node.output[0] for node in graph.node
                           if node.op_type == "DequantizeLinear" and node.input[0] in constants}
    matmuls = [node for node in graph.node if node.op_type == "MatMul" and node.input[1] in weights]  # linear layers
    plain = [node for node in matmuls if producers[node.input[0]].op_type != "DequantizeLinear"]
    assert len(plain) == manifest.target.dims.num_layers  # one down projection per layer, nothing else
    assert all(producers[node.input[0]].op_type == "Mul" for node in plain)
    assert len(matmuls) - len(plain) == 6 * manifest.target.dims.num_layers  # q k v o gate up are int8
    inits = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    activation_zps = [inits[n.input[2]] for n in graph.node if n.op_type == "QuantizeLinear"]
    assert activation_zps
    if backend == "tensorrt":  # TensorRT takes symmetric int8 only
        assert all(zp.dtype == np.int8 and not zp.any() for zp in activation_zps)
    else:
        assert all(zp.dtype == np.uint8 for zp in activation_zps)
    assert manifest.draft.calibration.details["kept_fp32"].startswith(f"{manifest.target.dims.num_layers} ")


def _single_matmul(path, weight):
    k, n = weight.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "T", n])], [numpy_helper.from_array(weight, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))


def _q41_grid_weight(rng, k: int, n: int) -> np.ndarray:
    scale = rng.uniform(0.01, 0.1, (k // 32, 1, n)).astype(np.float32)
    low = rng.uniform(-0.5, 0.0, (k // 32, 1, n)).astype(np.float32)
    codes = rng.integers(0, 16, (k // 32, 32, n))
    codes[:, 0], codes[:, 1] = 0, 15  # each block spans its whole grid, as a Q4_1 block does
    return (codes * scale + low).reshape(k, n).astype(np.float32)


def test_q41_grid_weight_is_reproduced_exactly(tmp_path):
    """minimum="exact": the fp32 correction MatMul keeps the float minimum, so x @ W comes back to fp32 rounding."""
    rng = np.random.default_rng(0)
    k, n = 64, 24
    weight = _q41_grid_weight(rng, k, n)
    assert q41_from_weight(weight)["grid_error"] < 1e-3
    _single_matmul(tmp_path / "fp32.onnx", weight)
    stats = q41_from_onnx(tmp_path / "fp32.onnx", tmp_path / "q41" / "model.onnx", accuracy_level=1, minimum="exact")
    assert stats == {"quantized": 1, "on_grid": 1, "max_grid_error": stats["max_grid_error"], "minimum": "exact",
                     "max_minimum_error": 0.0}
    x = rng.standard_normal((2, 3, k)).astype(np.float32)
    session = ort.InferenceSession(str(tmp_path / "q41" / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": x})[0]
    assert np.abs(got - x @ weight).max() <= 1e-5 * np.abs(x @ weight).max()


def test_q41_minimum_as_rows_of_the_same_matmulnbits(tmp_path):
    """minimum="rows": one MatMulNBits over [x, blocksum(x)] (no correction MatMul or Add); the residual minimum is
    held to half a step of its column's 4-bit scale, so x @ W differs from the exact product by at most
    sum_b |blocksum_b| * max|r| / 14, and by far less than dropping the residual would."""
    rng = np.random.default_rng(3)
    k, n = 96, 24  # nb = 3 block sums: a partial last block of MatMulNBits' inputs
    weight = _q41_grid_weight(rng, k, n)
    q = q41_from_weight(weight)
    _single_matmul(tmp_path / "fp32.onnx", weight)
    stats = q41_from_onnx(tmp_path / "fp32.onnx", tmp_path / "q41" / "model.onnx", accuracy_level=1)
    assert (stats["minimum"], stats["on_grid"]) == ("rows", 1) and stats["max_minimum_error"] > 0
    graph = onnx.load(str(tmp_path / "q41" / "model.onnx")).graph
    assert [node.op_type for node in graph.node] == ["Reshape", "ReduceSum", "Concat", "MatMulNBits"]
    assert {a.name: a.i for a in graph.node[-1].attribute}["K"] == k + k // 32
    x = rng.standard_normal((2, 3, k)).astype(np.float32)
    session = ort.InferenceSession(str(tmp_path / "q41" / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": x})[0]
    sums = x.reshape(2, 3, k // 32, 32).sum(axis=-1)  # [2, 3, nb]
    bound = np.abs(sums).sum(axis=-1, keepdims=True) * np.abs(q["residual"]).max(axis=0) / 14  # [2, 3, N]
    error = np.abs(got - x @ weight)
    assert (error <= bound * 1.001 + 1e-5).all()
    without = np.abs(sums @ q["residual"])  # what leaving the residual out would cost
    assert error.mean() < 0.2 * without.mean()


@pytest.mark.parametrize("minimum", ["rows", "exact"])
def test_q41_fuses_matmuls_that_share_an_input(tmp_path, minimum):
    """q/k/v-like MatMuls over one input become one MatMulNBits and a Split, with the same outputs as one by one."""
    rng = np.random.default_rng(2)
    k, widths = 64, (16, 8, 8)
    weights = [rng.standard_normal((k, n)).astype(np.float32) for n in widths]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"], name=f"mm{i}") for i in range(3)]
    graph = helper.make_graph(
        nodes, "three", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", k])],
        [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["B", "T", n]) for i, n in enumerate(widths)],
        [numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(weights)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "three.onnx"))
    x = rng.standard_normal((2, 3, k)).astype(np.float32)
    outputs = {}
    for fuse in (True, False):
        dest = tmp_path / f"fuse{fuse}" / "model.onnx"
        stats = q41_from_onnx(tmp_path / "three.onnx", dest, accuracy_level=1, fuse=fuse, minimum=minimum)
        assert stats["quantized"] == 3
        ops = [node.op_type for node in onnx.load(str(dest)).graph.node]
        assert ops.count("MatMulNBits") == (1 if fuse else 3) and ops.count("Split") == (1 if fuse else 0)
        assert ops.count("ReduceSum") == 1 and ops.count("Concat") == (minimum == "rows")  # one per input
        assert ops.count("MatMul") == (0 if minimum == "rows" else ops.count("MatMulNBits"))
        session = ort.InferenceSession(str(dest), providers=["CPUExecutionProvider"])
        outputs[fuse] = session.run(None, {"x": x})
    for fused, single in zip(outputs[True], outputs[False]):
        assert fused.shape == single.shape and np.abs(fused - single).max() <= 1e-5 * np.abs(single).max()


def test_q8_0_lm_head_is_reproduced_exactly(tmp_path):
    """The tied LM head Gemm(x, E, transB=1) becomes 8-bit MatMulNBits; a weight on the Q8_0 grid stays exact."""
    rng = np.random.default_rng(1)
    n, k = 40, 64
    scale = rng.uniform(0.01, 0.05, (n, k // 32, 1)).astype(np.float16).astype(np.float32)
    codes = rng.integers(-127, 128, (n, k // 32, 32))
    codes[:, :, 0] = 127  # Q8_0 puts the block's largest |w| at ±127
    weight = (codes * scale).reshape(n, k).astype(np.float32)
    assert q8_0_from_weight(weight)["grid_error"] < 1e-3
    assert q8_0_from_weight(rng.standard_normal((n, k)).astype(np.float32))["grid_error"] > 0.01  # off the grid
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "E"], ["y"], name="head", transB=1, alpha=1.0, transA=0)], "head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])], [numpy_helper.from_array(weight, "E")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "head.onnx"))
    stats = q41_from_onnx(tmp_path / "head.onnx", tmp_path / "q8" / "model.onnx", accuracy_level=1)
    assert stats["quantized"] == 0 and stats["lm_head"] == {"bits": 8, "grid": "Q8_0", "max_grid_error": 0.0}
    ops = [node.op_type for node in onnx.load(str(tmp_path / "q8" / "model.onnx")).graph.node]
    assert ops == ["MatMulNBits"]
    x = rng.standard_normal((3, k)).astype(np.float32)
    session = ort.InferenceSession(str(tmp_path / "q8" / "model.onnx"), providers=["CPUExecutionProvider"])
    got, want = session.run(None, {"x": x})[0], x @ weight.T
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


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


def test_modelopt_int8_and_fp8_drafts_on_the_cpu(int4_bundle, tmp_path):
    """ModelOpt calibrates on the CPU; its INT8 draft runs on onnxruntime with greedy equality, its FP8 graph carries
    float8 Q/DQ for TensorRT. It must leave the input bundle untouched and onnxruntime's own quantizer working."""
    pytest.importorskip("modelopt.onnx.quantization", reason="the [modelopt] extra is not installed")
    before = sha256_file(int4_bundle / "target" / "model.onnx")
    int8 = quantized_bundle(int4_bundle, tmp_path / "mo8", QuantizeConfig(method="modelopt-int8", data=DATA))
    fp8 = quantized_bundle(int4_bundle, tmp_path / "mo-fp8",
                           QuantizeConfig(method="modelopt-fp8", backend="tensorrt", data=DATA))
    assert sha256_file(int4_bundle / "target" / "model.onnx") == before
    for bundle, precision, zero_point in ((int8, "int8-qdq", TensorProto.INT8), (fp8, "fp8-qdq", TensorProto.FLOAT8E4M3FN)):
        manifest = read_manifest(bundle)
        check_bundle_files(bundle, manifest)
        assert manifest.draft.precision == precision and manifest.draft.calibration.details["tool"].startswith(
            "nvidia-modelopt")
        graph = onnx.load(str(bundle / manifest.draft.onnx_path)).graph
        inits = {init.name: init for init in graph.initializer}
        types = {inits[n.input[2]].data_type for n in graph.node if n.op_type == "QuantizeLinear" and len(n.input) > 2}
        assert types == {zero_point}
        layers = manifest.target.dims.num_layers
        assert manifest.draft.calibration.details["kept_fp32"].startswith(f"{layers} MLP down projections")
        producers = {o: node for node in graph.node for o in node.output}
        down = [n for n in graph.node if n.op_type == "MatMul" and producers[n.input[0]].op_type == "Mul"]
        assert len(down) == layers  # their activations are not quantized
    _greedy_equal(int8, gammas=(3,))
    after = quantized_bundle(int4_bundle, tmp_path / "q8", QuantizeConfig(method="int8-qdq", data=DATA))
    assert read_manifest(after).draft.precision == "int8-qdq"  # onnxruntime's quantizer, un-patched


@pytest.mark.parametrize("method, backend", [("modelopt-int8", "onnxruntime"), ("int8-qdq", "tensorrt")])
def test_modelopt_and_tensorrt_need_the_plain_lowering(gqa_int4_bundle, tmp_path, method, backend):
    with pytest.raises(ConfigError, match="needs the plain lowering") as err:
        quantized_bundle(gqa_int4_bundle, tmp_path / "o", QuantizeConfig(method=method, backend=backend, data=DATA))
    assert "--lowering plain" in str(err.value) and not (tmp_path / "o").exists()


def test_bundle_errors(int4_bundle, tmp_path):
    config = QuantizeConfig(method="int4-rtn", data=DATA)
    with pytest.raises(ConfigError, match="contains the source"):
        quantized_bundle(int4_bundle, int4_bundle.parent, config)  # would replace the folder holding the input
    with pytest.raises(ConfigError, match="is the source"):
        quantized_bundle(int4_bundle, int4_bundle, config, overwrite=True)
    (tmp_path / "notes").mkdir()
    with pytest.raises(ConfigError, match="already exists"):
        quantized_bundle(int4_bundle, tmp_path / "notes", config)
    with pytest.raises(ConfigError, match="not a specdec bundle"):
        quantized_bundle(int4_bundle, tmp_path / "notes", config, overwrite=True)
    with pytest.raises(ConfigError, match="one window needs"):
        quantized_bundle(int4_bundle, tmp_path / "x", QuantizeConfig(method="int4-rtn", data=DataConfig(seq_len=100000)))
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.*"))


@pytest.mark.parametrize("method", ["int4-q41", "int8-qdq"])
def test_quantized_draft_of_a_gqa_bundle_keeps_greedy_equality(gqa_int4_bundle, tmp_path, method):
    out = quantized_bundle(gqa_int4_bundle, tmp_path / method, QuantizeConfig(method=method, data=DATA))
    assert read_manifest(out).draft.lowering == "gqa"
    _greedy_equal(out, gammas=(1, 4))


@pytest.mark.parametrize("method", ["int4-rtn", "int4-q41", "int8-qdq"])
def test_quantized_layer_draft_keeps_greedy_equality(layer_draft_bundle, tmp_path, method):
    out = quantized_bundle(layer_draft_bundle, tmp_path / method, QuantizeConfig(method=method, data=DATA),
                           source="draft")
    manifest = read_manifest(out)
    check_bundle_files(out, manifest)
    draft, fp32 = manifest.draft, read_manifest(layer_draft_bundle).draft
    assert (draft.dims.num_layers, manifest.target.dims.num_layers) == (1, 2)
    assert draft.derived == f"layers:1+{method}" and draft.lowering == fp32.lowering
    assert draft.calibration.origin == "draft/model.onnx (fp32 draft, layers:1)"
    assert manifest.target.files == read_manifest(layer_draft_bundle).target.files  # the target is untouched
    _greedy_equal(out, gammas=(1, 4))


def test_source_draft_errors(bundle_copy, tmp_path):
    with pytest.raises(ConfigError, match="--source draft with --role target") as err:
        quantized_bundle(bundle_copy, tmp_path / "o", QuantizeConfig(method="int4-rtn", role="target"), source="draft")
    assert "Hint: " in str(err.value)
    with pytest.raises(ConfigError, match=r"draft of .* is int4 \(int4\)") as err:
        quantized_bundle(bundle_copy, tmp_path / "o", QuantizeConfig(method="int4-rtn"), source="draft")
    assert "--draft-layers K" in str(err.value)
    manifest = read_manifest(bundle_copy)
    write_manifest(bundle_copy, dataclasses.replace(manifest, models={"target": manifest.target}))
    with pytest.raises(ConfigError, match="has no draft to quantize") as err:
        quantized_bundle(bundle_copy, tmp_path / "o", QuantizeConfig(method="int4-rtn"), source="draft")
    assert "--draft-layers K" in str(err.value) and "--source target" in str(err.value)
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))
