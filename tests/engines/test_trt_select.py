"""Engine selection and every compatibility error, with the rebuild hint; plan file checks."""
from __future__ import annotations

import dataclasses
import json

import pytest

from specdec.engines.trt_config import build_config_for, engine_record, with_engine
from specdec.engines.trt_select import check_plan_file, select_engine
from specdec.errors import BackendError, ManifestError
from specdec.manifest import json_from_manifest, manifest_from_json, read_manifest, sha256_file

TRT = "10.13.3.9"


@pytest.fixture(scope="module")
def manifest(int4_bundle):
    return read_manifest(int4_bundle)


def _entry(manifest, *specs):
    """The target entry with one record per (capability, version, build overrides)."""
    entry = manifest.target
    for capability, version, overrides in specs:
        build = build_config_for(manifest, **overrides)
        entry = with_engine(entry, engine_record(build, entry, capability, version, "00" * 32))
    return entry


def _hint_ok(error: BackendError, bundle: str) -> None:
    assert "specdec-export" in error.hint and "--engine tensorrt" in error.hint and bundle in error.hint


def test_selects_the_matching_plan(manifest):
    entry = _entry(manifest, ((8, 6), TRT, {}), ((9, 0), TRT, {}))
    assert select_engine(entry, (9, 0), TRT).path == f"engines/target.sm90.trt{TRT}.plan"
    assert select_engine(entry, "8.6", TRT).compute_capability == "8.6"


def test_no_engine_built(manifest):
    with pytest.raises(BackendError) as info:
        select_engine(manifest.target, (9, 0), TRT, bundle="/b/smollm2")
    assert "target has no TensorRT engine" in info.value.message
    assert "9.0" in info.value.message and TRT in info.value.message
    _hint_ok(info.value, "/b/smollm2")


def test_wrong_compute_capability(manifest):
    entry = _entry(manifest, ((9, 0), TRT, {}))
    with pytest.raises(BackendError) as info:
        select_engine(entry, (8, 6), TRT, bundle="/b/x")
    assert "built for compute capability 9.0, this GPU is 8.6" in info.value.message
    _hint_ok(info.value, "/b/x")


def test_wrong_tensorrt_version(manifest):
    entry = _entry(manifest, ((9, 0), TRT, {}))
    for installed in ("10.13.3.10", "10.12.0.36", "11.0.0"):
        with pytest.raises(BackendError) as info:
            select_engine(entry, (9, 0), installed, bundle="/b/x")
        assert f"built with TensorRT {TRT}" in info.value.message
        assert f"installed is TensorRT {installed}" in info.value.message
        _hint_ok(info.value, "/b/x")


def test_version_compatible_plan_runs_on_later_tensorrt_only(manifest):
    entry = _entry(manifest, ((9, 0), TRT, {"version_compatible": True}))
    assert select_engine(entry, (9, 0), "10.14.1.48").version_compatible is True
    assert select_engine(entry, (9, 0), "11.0.0").tensorrt_version == TRT
    with pytest.raises(BackendError, match="version-compatible, needs that"):
        select_engine(entry, (9, 0), "10.8.0.43")


def test_hardware_compatible_plan_runs_on_ampere_and_later_only(manifest):
    entry = _entry(manifest, ((8, 6), TRT, {"hardware_compatibility": "ampere_plus"}))
    assert select_engine(entry, (9, 0), TRT).compute_capability == "8.6"
    with pytest.raises(BackendError, match="this GPU is 7.5"):
        select_engine(entry, (7, 5), TRT)
    same = _entry(manifest, ((8, 6), TRT, {"hardware_compatibility": "same_compute_capability"}))
    with pytest.raises(BackendError, match="this GPU is 8.9"):
        select_engine(same, (8, 9), TRT)


def test_exact_plan_is_preferred_over_compatible_ones(manifest):
    portable = {"hardware_compatibility": "ampere_plus", "version_compatible": True}
    entry = _entry(manifest, ((8, 0), "10.8.0.43", portable), ((9, 0), TRT, {}))
    assert select_engine(entry, (9, 0), TRT).path == f"engines/target.sm90.trt{TRT}.plan"
    assert select_engine(entry, (8, 9), TRT).path == "engines/target.sm80.trt10.8.0.43.plan"


def test_every_mismatch_is_listed(manifest):
    entry = _entry(manifest, ((9, 0), TRT, {}), ((8, 9), "10.8.0.43", {}))
    with pytest.raises(BackendError) as info:
        select_engine(entry, (8, 9), TRT)
    assert "sm90" in info.value.message and "sm89" in info.value.message


def test_a_corrupt_record_is_a_manifest_error(manifest):
    data = json.loads(json_from_manifest(manifest))
    data["models"]["target"]["engines"] = [{"backend": "tensorrt", "path": "engines/x.plan"}]
    with pytest.raises(ManifestError, match="engines.compute_capability is missing") as info:
        manifest_from_json(json.dumps(data))
    assert "re-export" in info.value.hint


def test_plan_file_must_exist_and_match_its_hash(tmp_path, manifest):
    record = _entry(manifest, ((9, 0), TRT, {})).engines[0]
    with pytest.raises(BackendError, match="missing") as info:
        check_plan_file(tmp_path, record)
    _hint_ok(info.value, str(tmp_path))
    plan = tmp_path / record.path
    plan.parent.mkdir()
    plan.write_bytes(b"not a plan")
    with pytest.raises(BackendError, match="sha256"):
        check_plan_file(tmp_path, record)
    assert check_plan_file(tmp_path, dataclasses.replace(record, sha256=sha256_file(plan))) == plan
