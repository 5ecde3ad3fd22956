"""The native backend (specdec.native, specdec.runtime.native_backend) against onnxruntime, on a tiny LLaMA whose
weights lie on the GGUF grids: logits of prefill, one- and several-token calls and of batched slots within fp32
rounding; greedy output of every drafter and γ identical to onnxruntime's target-only; every refusal with its
hint (weights off the grids, the plain lowering, no compiler, a failed compile, a CPU without AVX2)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specdec.errors import BackendError
from specdec.manifest import read_manifest
from specdec.native import build
from specdec.runtime import load
from specdec.runtime.config import GenerationConfig
from specdec.runtime.native_backend import NativeBackend
from specdec.runtime.ort_backend import OrtBackend

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")
TOLERANCE = 1e-4  # of the largest |logit|: fp32 summation order


@pytest.fixture(scope="module")
def backends(grid_bundle):
    manifest = read_manifest(grid_bundle)
    native, ort = NativeBackend(grid_bundle, manifest.target, 2).open(), OrtBackend(grid_bundle, manifest.target, 2).open()
    yield native, ort
    native.close()


def _close(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape
    assert np.abs(a - b).max() <= TOLERANCE * np.abs(b).max()
    assert (a.argmax(-1) == b.argmax(-1)).all()


def test_logits_match_onnxruntime_call_by_call(backends):
    native, ort = backends
    ids = np.random.default_rng(0).integers(3, native.vocab_size, (1, 40))
    native.reset(2)
    ort.reset(1)
    for start, stop, last_only in ((0, 13, False), (13, 14, False), (14, 19, False), (19, 40, True)):
        # prefill (row tiles of 6 and a rest), T = 1, T = 5 (a verify pass), a chunk with last_only; native in slot 1
        got = native.forward(ids[:, start:stop], np.array([start]), last_only=last_only, slots=np.array([1]))
        _close(got, ort.forward(ids[:, start:stop], np.array([start]), last_only=last_only))


def test_batched_slots_match_onnxruntime(backends):
    native, ort = backends
    rng = np.random.default_rng(1)
    first, second = rng.integers(3, native.vocab_size, (1, 10)), rng.integers(3, native.vocab_size, (1, 14))
    for backend in backends:
        backend.reset(2)
        backend.forward(first, np.array([0]), slots=np.array([0]))
        backend.forward(second, np.array([0]), slots=np.array([1]))
    step = rng.integers(3, native.vocab_size, (2, 1))
    calls = [b.forward(step, np.array([14, 10]), slots=np.array([1, 0])) for b in backends]  # rows in slot order 1, 0
    _close(*calls)


@pytest.mark.parametrize("drafter,gamma", [("none", None), ("model", 1), ("model", 3), ("prompt_lookup", 3),
                                           ("auto", 3)])
def test_greedy_identical_to_onnxruntime_target_only(grid_bundle, drafter, gamma):
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown"
    with load(grid_bundle) as ort, load(grid_bundle, backend="native") as native:
        reference = ort.generate(prompt, GenerationConfig(max_new_tokens=40, drafter="none")).token_ids
        got = native.generate(prompt, GenerationConfig(max_new_tokens=40, drafter=drafter, gamma=gamma))
    assert got.token_ids == reference and len(reference) > 8


def test_the_family_record_says_what_the_weights_hold(grid_bundle, tmp_path):
    """Export writes the family's facts from its Architecture; the engine checks the weights file against them, and
    a bundle written before the record (its facts in the record's older fields) still opens and decodes the same."""
    import json
    import shutil

    from specdec.native_record import FamilyRecord

    family = read_manifest(grid_bundle).target.native.family
    assert family == FamilyRecord(norm="rms", positions="rotary", activation="silu-gated", biases=[], qk_norm=False,
                                  window=0, epsilon=family.epsilon, scale=0.25)  # head size 16
    config = GenerationConfig(max_new_tokens=12, drafter="none")
    with load(grid_bundle) as gen:
        want = gen.generate([5, 9, 14], config).token_ids
    for edit, match in ((lambda f: {**f, "qk_norm": True}, "disagree on q/k norms"),
                        (lambda f: {**f, "biases": ["qkv"]}, "disagree on qkv biases"),
                        (lambda f: {**f, "norm": "group"}, "names what this engine does not run"),
                        (lambda f: None, None)):  # no record: the facts of its older fields
        bundle = shutil.copytree(grid_bundle, tmp_path / f"edited{len(list(tmp_path.iterdir()))}")
        data = json.loads((bundle / "manifest.json").read_text())
        native = data["models"]["target"]["native"]
        native["family"] = edit(native["family"])
        if native["family"] is None:
            native.update(epsilon=family.epsilon, scale=family.scale, window=0, activation="silu-gated")
        (bundle / "manifest.json").write_text(json.dumps(data))
        if match is None:
            with load(bundle, verify=False) as gen:
                assert gen.backend == "native" and gen.generate([5, 9, 14], config).token_ids == want
            continue
        with pytest.raises(BackendError, match=match):
            NativeBackend(bundle, read_manifest(bundle).target).open()


def test_weights_off_the_grids_run_as_fp32_rows(off_grid_bundle):
    """Random fp32 weights lie on no grid and in no narrower precision: the native weights keep them as fp32 rows,
    and the native target computes onnxruntime's greedy tokens."""
    from specdec.export.native_pack import NativeSkipped, _rows

    manifest = read_manifest(off_grid_bundle)
    assert manifest.target.native.layout == "f32"
    config = GenerationConfig(max_new_tokens=24, drafter="none")
    with load(off_grid_bundle, backend="onnxruntime") as ort, load(off_grid_bundle) as native:
        assert native.backend == "native"
        assert native.generate([5, 9, 14], config).token_ids == ort.generate([5, 9, 14], config).token_ids
    weight = np.ones((4, 32), np.float32)
    weight[1, 3] = np.nan
    with pytest.raises(NativeSkipped, match="NaN or inf"):
        _rows({"layers.0.qkv": weight}, np.ones((4, 32), np.float32), np.ones((4, 32), np.float32))


def test_a_model_outside_the_layout_gets_no_native_weights(gqa_int4_bundle, int4_bundle):
    manifest = read_manifest(gqa_int4_bundle)  # head size 8: rotary outside the attention op
    assert manifest.target.native is None and "rotates whole heads of a multiple of 16" in manifest.target.native_note
    plain = read_manifest(int4_bundle).target
    assert plain.native is None and "runs gqa exports" in plain.native_note
    with pytest.raises(BackendError, match="carries no native weights"):
        NativeBackend(int4_bundle, plain).open()


def test_cli_refusal_is_a_message(gqa_int4_bundle):
    done = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", str(gqa_int4_bundle), "--prompt", "Hi",
                           "--backend", "native"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "no native weights" in done.stderr and "Hint:" in done.stderr and "Traceback" not in done.stderr


def test_auto_opens_native_where_it_can(grid_bundle, gqa_int4_bundle):
    """load()'s default: the native backend for a bundle it runs, onnxruntime (saying why) for one it does not (head
    size 8: its graph's rotary lies outside the attention op); the same greedy tokens either way."""
    config = GenerationConfig(max_new_tokens=12, drafter="none")
    with load(grid_bundle) as generator:
        assert (generator.backend, generator.backend_note) == ("native", None)
        assert isinstance(generator.target.backend, NativeBackend)
        native_ids = generator.generate([5, 9, 14], config).token_ids
    with load(grid_bundle, backend="onnxruntime") as generator:
        assert generator.backend == "onnxruntime" and generator.backend_note is None
        assert generator.generate([5, 9, 14], config).token_ids == native_ids
    with load(gqa_int4_bundle) as generator:
        assert generator.backend == "onnxruntime" and isinstance(generator.target.backend, OrtBackend)
        assert "native backend did not open" in generator.backend_note and "no native weights" in generator.backend_note


def test_auto_runs_on_the_cpu_or_a_gpu_only(grid_bundle):
    with pytest.raises(BackendError, match="runs on the CPU or a CUDA GPU") as caught:
        load(grid_bundle, device="tpu:0")
    assert "cuda:N" in caught.value.hint


def test_cli_names_the_backend_auto_chose(grid_bundle, gqa_int4_bundle):
    for bundle, chosen in ((grid_bundle, "native"), (gqa_int4_bundle, "onnxruntime")):
        done = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", str(bundle), "--prompt", "Hi",
                               "--max-new-tokens", "4"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert f"[auto, {chosen}, fp32]" in done.stderr  # the drafter, the backend, the activations that ran
        assert ("no native weights" in done.stderr) == (chosen == "onnxruntime")


def test_no_compiler(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", str(fresh_build / "no-such-cc"))
    monkeypatch.setenv("PATH", str(fresh_build))
    with pytest.raises(BackendError, match="no C compiler") as caught:
        build.load_kernels()
    assert "install gcc" in caught.value.hint


def test_failed_compile(fresh_build, monkeypatch):
    broken = fresh_build / "cc"
    broken.write_text("#!/bin/sh\necho 'kernels.c:1: error: no AVX2 here' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    with pytest.raises(BackendError, match="failed: kernels.c:1: error: no AVX2 here"):
        build.load_kernels()
    assert not list((fresh_build / "cache").rglob("*.so"))  # nothing half-written is left to load next time


def test_cpu_without_avx2(fresh_build, monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu sse2 fma f16c\n")
    assert build.missing_cpu_flags(cpuinfo) == ["avx2"]
    assert build.missing_cpu_flags(tmp_path / "missing") == ["avx2", "fma", "f16c"]
    monkeypatch.setattr(build, "missing_cpu_flags", lambda: ["avx2"])
    with pytest.raises(BackendError, match="lacks avx2"):
        build.load_kernels()


def test_native_runtime_imports_no_torch(grid_bundle):
    code = (
        "import sys, specdec\n"
        f"g = specdec.load({str(grid_bundle)!r}, backend='native')\n"
        "assert g.generate('The quick brown fox', specdec.GenerationConfig(max_new_tokens=8)).token_ids\n"
        "print('LOADED:' + ','.join(m for m in ('torch', 'transformers', 'specdec.export') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "LOADED:\n" in done.stdout


def test_draft_copies_the_native_targets_kv(grid_bundle, backends):
    native, _ = backends
    draft = OrtBackend(grid_bundle, read_manifest(grid_bundle).draft, 2).open()
    assert draft.takes_kv_from(native)
    native.reset(2)
    draft.reset(2)
    native.forward(np.random.default_rng(2).integers(3, native.vocab_size, (1, 12)), np.array([0]), slots=np.array([1]))
    draft.copy_kv(native, 1, 0, 12)
    layers = native.entry.dims.num_layers
    for i in range(layers):  # the draft's per-layer keys, then values: [slots, Hkv, S, D]
        assert np.array_equal(draft.driver.buffers[i][1, :, :12], native.model.keys[i, 1, :, :12])
        assert np.array_equal(draft.driver.buffers[layers + i][1, :, :12], native.model.values[i, 1, :, :12])


def test_lockstep_runs_both_backends_as_systems(grid_bundle, tmp_path):
    pl = pytest.importorskip("polars")
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "lockstep.py"
    out = tmp_path / "lockstep"
    done = subprocess.run([sys.executable, str(script), str(grid_bundle), "--per-class", "1", "--new-tokens", "6",
                           "--modes", "target-only,auto", "--backends", "onnxruntime,native", "--peer-modes", "none",
                           "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    requests = pl.read_parquet(out / "requests.parquet")
    assert sorted(requests["system"].unique().to_list()) == ["specdec", "specdec native"]
    assert (requests["status"] == "ok").all() and requests["identical"].all()  # both against onnxruntime's target-only
    assert "specdec native target-only / specdec target-only" in (out / "pairs.md").read_text(encoding="utf-8")
    refused = subprocess.run([sys.executable, str(script), str(grid_bundle), "--backends", "onnxruntime,gpu",
                              "--peer-modes", "none", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1
    assert "unknown backend in 'onnxruntime,gpu'" in refused.stderr and "Traceback" not in refused.stderr


def test_load_hashes_the_files_the_opened_backend_reads(q41_bundle, tmp_path):
    """verify=True hashes what each backend reads before it opens it: a changed native weights file stops native
    (and auto falls back, saying why); a changed target graph stops onnxruntime, not native, which never reads it."""
    import shutil

    from specdec.errors import ManifestError

    for name, stopped in (("target/native.bin", "native"), ("target/model.onnx", "onnxruntime")):
        bundle = tmp_path / name.replace("/", "-")
        shutil.copytree(q41_bundle, bundle)
        with open(bundle / name, "r+b") as handle:
            handle.seek(-1, 2)
            last = handle.read(1)
            handle.seek(-1, 2)
            handle.write(bytes([last[0] ^ 1]))
        with pytest.raises(ManifestError, match=f"{name}.*sha256"):
            load(bundle, backend=stopped)
        other = "onnxruntime" if stopped == "native" else "native"
        with load(bundle, backend=other) as generator:
            assert generator.generate([5, 9], GenerationConfig(max_new_tokens=2)).token_ids
        with load(bundle) as generator:
            assert generator.backend == other
            assert (generator.backend_note is None) == (other == "native")
