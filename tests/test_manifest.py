"""Manifest round trip and every validation error."""
from __future__ import annotations

import json
import shutil

import pytest

from specdec.errors import ManifestError
from specdec.manifest import (
    SCHEMA_VERSION,
    check_bundle_files,
    json_from_manifest,
    manifest_from_json,
    read_manifest,
)


@pytest.fixture
def manifest_dict(int4_bundle):
    return json.loads((int4_bundle / "manifest.json").read_text())


def test_round_trip(int4_bundle):
    manifest = read_manifest(int4_bundle)
    again = manifest_from_json(json_from_manifest(manifest))
    assert again == manifest
    assert manifest.schema_version == SCHEMA_VERSION
    assert manifest.draft.derived == "int4" and manifest.draft.precision == "int4"
    assert manifest.target.files and all(len(h) == 64 for h in manifest.target.files.values())
    check_bundle_files(int4_bundle, manifest)


def _error(data) -> ManifestError:
    with pytest.raises(ManifestError) as info:
        manifest_from_json(json.dumps(data) if not isinstance(data, str) else data)
    assert info.value.hint
    return info.value


def test_bad_json():
    assert "not valid JSON" in _error("{not json").message


def test_schema_version(manifest_dict):
    manifest_dict["schema_version"] = 99
    assert "99" in _error(manifest_dict).message


def test_missing_field(manifest_dict):
    del manifest_dict["models"]["target"]["dims"]
    assert "models.target.dims" in _error(manifest_dict).message


def test_missing_target_and_unknown_role(manifest_dict):
    manifest_dict["models"]["critic"] = manifest_dict["models"].pop("target")
    assert "target" in _error(manifest_dict).message


def test_gamma_outside_gamma_max(manifest_dict):
    manifest_dict["defaults"]["gamma"] = manifest_dict["defaults"]["gamma_max"] + 1
    assert "gamma" in _error(manifest_dict).message


def test_vocabulary_disagreement(manifest_dict):
    manifest_dict["models"]["draft"]["dims"]["vocab_size"] = manifest_dict["tokenizer"]["vocab_size"] - 1
    assert "vocab_size" in _error(manifest_dict).message


def test_padded_vocabulary_is_allowed(manifest_dict):
    manifest_dict["models"]["draft"]["dims"]["vocab_size"] += 64
    manifest_from_json(json.dumps(manifest_dict))


def test_draft_shorter_than_target(manifest_dict):
    manifest_dict["models"]["draft"]["max_seq_len"] = 8
    assert "max_seq_len" in _error(manifest_dict).message


def test_unknown_precision(manifest_dict):
    manifest_dict["models"]["target"]["precision"] = "fp8"
    assert "precision" in _error(manifest_dict).message


def test_missing_bundle_and_missing_manifest(tmp_path):
    with pytest.raises(ManifestError, match="does not exist"):
        read_manifest(tmp_path / "nope")
    with pytest.raises(ManifestError, match="not a specdec bundle"):
        read_manifest(tmp_path)


def test_hash_mismatch_and_missing_file(int4_bundle, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(int4_bundle, copy)
    manifest = read_manifest(copy)
    data = copy / "draft" / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(ManifestError, match="sha256"):
        check_bundle_files(copy, manifest)
    data.unlink()
    with pytest.raises(ManifestError, match="missing"):
        check_bundle_files(copy, manifest)
