"""specdec's TensorRT glue end to end on the CPU stand-in for tensorrt + cuda-python (tests/engines/trt_standin.py).

What passes here is specdec's own code: the export CLI's engine step, profiles, plan records and selection, the
backend contract, buffers, profile choice, KV write-back and CUDA-graph replay. The stand-in runs the ONNX on
onnxruntime CPU; it says nothing about TensorRT itself (README: what was seen on real GPUs).
"""
from __future__ import annotations

import inspect

import numpy as np
import pytest

import specdec
from specdec import GenerationConfig
from specdec.cli import export_main
from specdec.engines.tensorrt import build_bundle_engines
from specdec.errors import BackendError, EngineBuildError
from specdec.manifest import read_manifest
from specdec.runtime.backend import Backend
from specdec.runtime.registry import BACKENDS
from tests.engines.trt_standin import Device, install

PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time", "brown fox jumps over the lazy dog. The quick",
           "a + b\n", "Summarize the following text in one sentence. Summarize"]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def device():
    with pytest.MonkeyPatch.context() as patch:
        yield install(patch, Device())


@pytest.fixture(scope="module")
def trt_bundle(device, tmp_path_factory, tiny_llama):
    """`specdec-export --engine tensorrt` of a plain bundle with a 1-layer draft: both models get a plan."""
    out = tmp_path_factory.mktemp("trt") / "b"
    argv = ["--target", str(tiny_llama), "--out", str(out), "--draft-layers", "1", "--engine", "tensorrt",
            "--max-seq-len", "96", "--max-batch", "4", "--gamma", "3", "--gamma-max", "6", "--max-prefill-chunk", "16"]
    assert export_main(argv) == 0
    return out


def test_export_with_engine_builds_and_records_a_plan_per_model(trt_bundle, device):
    manifest = read_manifest(trt_bundle)
    for entry in manifest.models.values():
        (record,) = entry.engines
        assert record.path == f"engines/{entry.role}.sm89.trt{device.trt_version}.plan"
        assert (trt_bundle / record.path).is_file() and record.compute_capability == "8.9"
        assert list(record.profiles) == ["prefill", "step"]
    assert (trt_bundle / "engines" / "timing.cache").is_file()


def _parameters(function) -> list:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def test_every_backend_class_keeps_the_contract():
    """A signature drift (TrtBackend.forward once lost `last_only`) fails here, on any machine."""
    for name, cls in BACKENDS.items():
        assert cls.name == name and issubclass(cls, Backend)
        for method in ("forward", "_forward", "reset", "_reset", "open", "close", "for_target", "runs_draft", "for_draft"):
            assert _parameters(getattr(cls, method)) == _parameters(getattr(Backend, method)), (name, method)


@pytest.mark.parametrize("drafter", ["model", "auto", "prompt_lookup"])
def test_tensorrt_greedy_equals_onnxruntime(trt_bundle, device, drafter):
    with specdec.load(trt_bundle) as ort, specdec.load(trt_bundle, backend="tensorrt", device="cuda:0") as trt:
        assert type(trt.target.backend).__name__ == type(trt.draft.backend).__name__ == "TrtBackend"
        for prompt in PROMPTS:
            expected = ort.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="none")).token_ids
            for gamma in (1, 3, 6):
                config = GenerationConfig(max_new_tokens=NEW_TOKENS, drafter=drafter, gamma=gamma)
                assert trt.generate(prompt, config).token_ids == expected, (prompt, gamma)
        assert trt.target.backend.replays > 0  # CUDA graphs captured and replayed
        assert any(call == "graph:execute" for call in device.calls)


def test_tensorrt_batch_with_ragged_rollback_equals_single_runs(trt_bundle, device):
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[5]]  # ragged prompt lengths and acceptance
    with specdec.load(trt_bundle, backend="tensorrt", device="cuda:0") as trt:
        singles = [trt.generate(p, GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="none")).token_ids
                   for p in prompts]
        batch = trt.generate(prompts, GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="model", gamma=4))
        assert [r.token_ids for r in batch] == singles
        assert batch[0].stats.proposed > batch[0].stats.accepted  # a 1-layer draft is rejected: rollback ran


def test_an_int4_draft_without_a_plan_runs_on_onnxruntime(device, export_tiny, tmp_path, tiny_llama):
    bundle = export_tiny(tmp_path / "b", tiny_llama, lowering="plain", draft_from_target="int4")
    with pytest.raises(EngineBuildError, match="MatMulNBits"):
        build_bundle_engines(bundle)  # the int4 draft is refused before anything is built
    build_bundle_engines(bundle, roles=("target",))
    with specdec.load(bundle) as ort, specdec.load(bundle, backend="tensorrt") as trt:
        assert type(trt.draft.backend).__name__ == "OrtBackend"
        for prompt in PROMPTS[:3]:
            expected = ort.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="none")).token_ids
            assert trt.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="model")).token_ids == expected


@pytest.mark.parametrize("change, reason", [
    ({"capability": (9, 0)}, "built for compute capability 8.9, this GPU is 9.0"),
    ({"trt_version": "10.14.1.48"}, "installed is TensorRT 10.14.1.48"),
])
def test_plans_for_another_gpu_or_tensorrt_are_refused(trt_bundle, device, change, reason):
    saved = (device.capability, device.trt_version)
    try:
        for key, value in change.items():
            setattr(device, key, value)
        with pytest.MonkeyPatch.context() as patch:
            install(patch, device)  # modules that report the changed GPU / version
            with pytest.raises(BackendError, match="no TensorRT engine of target runs here") as info:
                specdec.load(trt_bundle, backend="tensorrt")
        assert reason in info.value.message and "--engine tensorrt" in info.value.hint
    finally:
        device.capability, device.trt_version = saved


def test_a_forward_beyond_every_profile_is_refused(trt_bundle, device):
    with specdec.load(trt_bundle, backend="tensorrt") as trt:
        backend = trt.target.backend
        backend.reset(1)
        with pytest.raises(BackendError, match="exceeds the engine's profiles") as info:
            backend.forward(np.ones((1, 17), np.int64), np.zeros(1, np.int64))  # prefill chunk is 16
        assert "max_prefill_chunk" in info.value.hint
        logits = backend.forward(np.ones((1, 16), np.int64), np.zeros(1, np.int64), True)
        assert logits.shape == (1, 1, backend.vocab_size)


def test_a_plan_that_does_not_load_says_how_to_rebuild(trt_bundle, device, tmp_path):
    import shutil

    copy = tmp_path / "b"
    shutil.copytree(trt_bundle, copy)
    record = read_manifest(copy).target.engines[0]
    (copy / record.path).write_bytes(b"{}")  # not the recorded plan
    with pytest.raises(BackendError, match="sha256") as info:
        specdec.load(copy, backend="tensorrt")
    assert "--engine tensorrt" in info.value.hint
