"""On a GPU: the cuda-python glue for real, and TensorRT plans against onnxruntime CPU. Skipped without them."""
from __future__ import annotations

import numpy as np
import pytest

import specdec
from specdec import GenerationConfig
from specdec.engines.trt_compat import import_tensorrt
from specdec.errors import SpecDecError
from specdec.manifest import read_manifest
from specdec.runtime.ort_backend import OrtBackend

PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time there was", "a + b\n"]


def _gpu_or_skip() -> tuple:
    from specdec.engines.cuda_glue import compute_capability

    try:
        return compute_capability()
    except SpecDecError as exc:
        pytest.skip(f"no usable GPU: {exc.message}")


def _tensorrt_or_skip():
    try:
        return import_tensorrt()
    except SpecDecError as exc:
        pytest.skip(exc.message)


@pytest.mark.gpu
def test_cuda_session_kv_write_back_and_graph_replay():
    from specdec.engines.cuda_glue import CudaSession, kv_row_copies

    assert _gpu_or_skip() >= (5, 0)
    layers, batch, heads, size, dim, steps = 2, 3, 2, 16, 8, 3
    rng = np.random.default_rng(0)
    past = rng.standard_normal((layers, batch, heads, size, dim)).astype(np.float16)  # [L, B, Hkv, S, D]
    new = rng.standard_normal((layers, batch, heads, steps, dim)).astype(np.float16)  # [L, B, Hkv, T, D]
    cache_len = np.asarray([0, 7, 13], dtype=np.int64)
    expected = past.copy()
    for row, start in enumerate(cache_len):
        expected[:, row, :, start : start + steps] = new[:, row]
    with CudaSession() as cuda:
        assert isinstance(cuda.stream_handle, int) and cuda.stream_handle != 0  # what TensorRT is given
        host_past, host_new = cuda.pinned(past.shape, past.dtype), cuda.pinned(new.shape, new.dtype)
        host_past[...], host_new[...] = past, new
        d_past, d_new = cuda.malloc(past.nbytes), cuda.malloc(new.nbytes)
        cuda.upload(d_past, host_past, past.nbytes)
        cuda.upload(d_new, host_new, new.nbytes)
        for copy in kv_row_copies(layers, batch, heads, dim, size, steps, cache_len, 2):
            cuda.copy_3d(d_new, d_past, copy)
        host_past[...] = 0
        cuda.download(host_past, d_past, past.nbytes)
        cuda.synchronize()
        np.testing.assert_array_equal(host_past, expected)
        # a graph of upload + download replays with whatever the pinned input holds at launch time
        source, sink, scratch = cuda.pinned((64,), np.int64), cuda.pinned((64,), np.int64), cuda.malloc(512)
        graph = cuda.capture(lambda: (cuda.upload(scratch, source, 512), cuda.download(sink, scratch, 512)))
        for value in (3, 11):
            source[...] = np.arange(64) * value
            cuda.launch(graph)
            cuda.synchronize()
            np.testing.assert_array_equal(sink, np.arange(64) * value)


@pytest.fixture(scope="module")
def trt_bundle(tmp_path_factory, tiny_llama, export_tiny):
    """A tiny fp32 bundle with a 1-layer draft (TensorRT parses it; the int4 draft's MatMulNBits it does not)."""
    _gpu_or_skip()
    _tensorrt_or_skip()
    from specdec.engines.tensorrt import build_bundle_engines

    bundle = export_tiny(tmp_path_factory.mktemp("b") / "trt", tiny_llama, draft_layers=1, lowering="plain")
    build_bundle_engines(bundle)
    return bundle


def _logits_gap(trt, ort, steps: list) -> float:
    """Run (ids, cache_len) forwards through both backends; max |gap| / max |logit|."""
    worst = 0.0
    for ids, cache_len in steps:
        a, b = trt.forward(ids, cache_len), ort.forward(ids, cache_len)  # [B, T, V]
        worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
    return worst


@pytest.mark.gpu
@pytest.mark.tensorrt
@pytest.mark.parametrize("graphs", [True, False])
def test_tensorrt_logits_match_onnxruntime_across_profiles(trt_bundle, graphs):
    from specdec.runtime.trt_backend import TrtBackend, TrtOptions

    manifest = read_manifest(trt_bundle)
    rng = np.random.default_rng(0)
    ids = lambda b, t: rng.integers(0, 200, (b, t), dtype=np.int64)  # noqa: E731
    steps = [(ids(2, 10), np.asarray([0, 0])), (ids(2, 1), np.asarray([10, 10])),  # prefill, then step profile
             (ids(2, 4), np.asarray([11, 9])), (ids(2, 4), np.asarray([15, 12])),  # ragged verify, replayed graph
             (ids(2, 12), np.asarray([19, 16])), (ids(2, 1), np.asarray([31, 20]))]  # back to prefill and step
    with TrtBackend(trt_bundle, manifest.target, TrtOptions(cuda_graphs=graphs)) as trt, \
            OrtBackend(trt_bundle, manifest.target) as ort:
        trt.reset(2)
        ort.reset(2)
        assert _logits_gap(trt, ort, [(i, c.astype(np.int64)) for i, c in steps]) < 1e-3
        assert trt.replays == (2 if graphs else 0)  # (2, 4) and (2, 1) ran twice


@pytest.mark.gpu
@pytest.mark.tensorrt
def test_tensorrt_greedy_equals_onnxruntime_cpu(trt_bundle):
    from specdec.runtime.generator import Generator
    from specdec.runtime.text import TextCodec
    from specdec.runtime.trt_backend import TrtBackend

    manifest = read_manifest(trt_bundle)
    config = GenerationConfig(max_new_tokens=24, drafter="none")
    with specdec.load(trt_bundle) as cpu:
        expected = [cpu.generate(p, config).token_ids for p in PROMPTS]
    target = TrtBackend(trt_bundle, manifest.target).open()
    draft = TrtBackend(trt_bundle, manifest.draft).open()
    with Generator(manifest, TextCodec(trt_bundle).open(), target, draft) as gpu:
        for drafter in ("none", "model", "auto"):
            for gamma in (1, 3, 6):
                config = GenerationConfig(max_new_tokens=24, drafter=drafter, gamma=gamma)
                assert [gpu.generate(p, config).token_ids for p in PROMPTS] == expected, (drafter, gamma)
