"""The head in the bundle: its manifest record (absent for a bundle without one, as before), its file's hash, and
the refusals at open of a head that does not fit its target or its own record, and of drafter="head" where it
cannot run."""
from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

import specdec
from specdec import GenerationConfig
from specdec.errors import ConfigError, ManifestError
from specdec.head.format import HEAD_PATH, attach_head
from specdec.head.random import random_head
from specdec.manifest import json_from_manifest, manifest_from_json, read_manifest, sha256_file
from specdec.native import build
from tests.head.conftest import attach_random_head, export_head_bundle


@pytest.fixture(scope="module")
def featureless_bundle(tmp_path_factory, head_model_dir):
    """A head beside a graph that returns no hidden states (exported without --feature-layers)."""
    bundle = export_head_bundle(tmp_path_factory.mktemp("nofeat") / "b", head_model_dir, feature_layers=())
    attach_random_head(bundle)
    return bundle


def _edited(bundle, tmp_path, edit) -> object:
    """A copy of `bundle` whose manifest's head section `edit(head: dict)` changed."""
    copy = shutil.copytree(bundle, tmp_path / "edited")
    data = json.loads((copy / "manifest.json").read_text())
    edit(data["head"])
    (copy / "manifest.json").write_text(json.dumps(data))
    return copy


def test_a_bundle_without_a_head_writes_and_reads_the_manifest_as_before(random_head_bundle):
    manifest = read_manifest(random_head_bundle)
    head_file = random_head_bundle / HEAD_PATH
    assert manifest.head is not None and manifest.head.files == {HEAD_PATH: sha256_file(head_file)}
    assert manifest_from_json(json_from_manifest(manifest)) == manifest
    plain = dataclasses.replace(manifest, head=None)
    assert "head" not in json.loads(json_from_manifest(plain))
    assert manifest_from_json(json_from_manifest(plain)).head is None


def test_a_head_that_does_not_fit_the_target_is_refused(random_head_bundle, tmp_path):
    dims = read_manifest(random_head_bundle).target.dims
    narrow = dataclasses.replace(dims, hidden_size=32)
    with pytest.raises(ManifestError, match=r"(?s)does not fit its target: the head has hidden size 32; the target's is "
                                            r"64.*Hint: attach a head made for this target"):
        attach_head(random_head_bundle, *random_head(narrow, (1, 3, 4)))
    cases = [(lambda head: head.update(vocab_size=100), r"vocabulary of 100 tokens; the target's has"),
             (lambda head: head.update(feature_layers=[1, 3, 8]), r"feature layers \[1, 3, 8\]; the target has layers "
                                                                  r"0..7"),
             (lambda head: head.update(num_kv_heads=3), r"4 query heads, 3 key-value heads")]
    for edit, message in cases:
        shutil.rmtree(tmp_path / "edited", ignore_errors=True)
        with pytest.raises(ManifestError, match=message):
            specdec.load(_edited(random_head_bundle, tmp_path, edit), backend="onnxruntime")


def test_a_head_file_unlike_its_record_or_its_hash_is_refused(random_head_bundle, tmp_path):
    copy = shutil.copytree(random_head_bundle, tmp_path / "shapes")
    with np.load(copy / HEAD_PATH) as archive:
        arrays = dict(archive)
    arrays["q"] = arrays["q"][:, :64]
    np.savez(copy / HEAD_PATH, **arrays)
    with pytest.raises(ManifestError, match=r"(?s)head/head.npz' has sha256 .*Hint: the file was modified"):
        specdec.load(copy, backend="onnxruntime")
    data = json.loads((copy / "manifest.json").read_text())
    data["head"]["files"] = {HEAD_PATH: sha256_file(copy / HEAD_PATH)}
    (copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"(?s)tensor q in head/head.npz is float32 \[64, 64\]; its record needs "
                                            r"float32 \[64, 128\].*Hint"):
        specdec.load(copy, backend="onnxruntime")


def test_drafter_head_needs_a_head(tmp_path, head_model_dir):
    bundle = export_head_bundle(tmp_path / "none", head_model_dir, feature_layers=())
    with specdec.load(bundle) as gen:
        assert gen.head is None
        with pytest.raises(ConfigError, match=r"(?s)needs a trained draft head, and this bundle has none.*calibrate "
                                              r"head"):
            gen.generate("hi", GenerationConfig(drafter="head"))
        assert gen.generate("hi", GenerationConfig(max_new_tokens=4)).token_ids  # auto, unchanged


def test_a_target_that_returns_no_hidden_states_refuses_drafter_head_and_names_the_fix(featureless_bundle):
    with specdec.load(featureless_bundle, backend="onnxruntime") as gen:
        with pytest.raises(ConfigError, match=r"(?s)hidden states at layers \[1, 3, 4\], which the target on the "
                                              r"onnxruntime backend does not return.*--feature-layers head.*native"):
            gen.generate("hi", GenerationConfig(drafter="head"))
        plain = gen.generate("hi", GenerationConfig(max_new_tokens=8, drafter="none")).token_ids
        assert gen.requests.head_gate is None  # auto leaves a head its target cannot feed, and drafts as before
        assert gen.generate("hi", GenerationConfig(max_new_tokens=8)).token_ids == plain
    if build.missing_cpu_flags():
        return
    with specdec.load(featureless_bundle, backend="native") as gen:  # the native engine returns any layer's
        assert gen.generate("hi", GenerationConfig(max_new_tokens=8, drafter="head")).token_ids == plain
