"""BuildConfig checks, optimization profiles of a real bundle's entries, plan names, manifest records."""
from __future__ import annotations

import dataclasses

import pytest

from specdec.engines.trt_config import (
    BuildConfig,
    build_config_for,
    check_fits,
    engine_record,
    optimization_profiles,
    plan_name,
    profile_for,
    token_limits,
    with_engine,
)
from specdec.errors import BackendError, ConfigError, EngineBuildError
from specdec.manifest import json_from_manifest, manifest_from_json, read_manifest
from tests.conftest import GAMMA_MAX, MAX_SEQ_LEN

VALID = dict(max_batch=4, max_prefill_chunk=16, gamma=3, gamma_max=6, max_seq_len=96)


@pytest.fixture(scope="module")
def manifest(int4_bundle):
    return read_manifest(int4_bundle)


@pytest.fixture(scope="module")
def build(manifest):
    return build_config_for(manifest)


@pytest.mark.parametrize("change, words", [
    (dict(max_batch=0), "max_batch"),
    (dict(max_prefill_chunk=-1), "max_prefill_chunk"),
    (dict(gamma=True), "gamma"),
    (dict(gamma=7), "outside 1..gamma_max"),
    (dict(gamma_max=96), "gamma_max + 1 = 97"),
    (dict(max_prefill_chunk=97), "max_prefill_chunk = 97"),
    (dict(opt_batch=5), "opt_batch 5"),
    (dict(hardware_compatibility="all"), "'all'"),
    (dict(workspace_bytes=0), "workspace_bytes"),
    (dict(builder_optimization_level=6), "outside 0..5"),
])
def test_build_config_rejects_bad_values_with_a_hint(change, words):
    with pytest.raises(ConfigError) as info:
        BuildConfig(**{**VALID, **change})
    assert words in info.value.message and info.value.hint


def test_build_config_accepts_the_documented_options(tmp_path):
    config = BuildConfig(**VALID, version_compatible=True, hardware_compatibility="same_compute_capability",
                         timing_cache=str(tmp_path / "t.cache"), workspace_bytes=1 << 30, builder_optimization_level=5)
    assert config.timing_cache == tmp_path / "t.cache"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.gamma = 2


def test_build_config_comes_from_the_bundle(manifest, build):
    assert (build.max_batch, build.max_prefill_chunk, build.gamma, build.gamma_max, build.max_seq_len) == (
        4, 16, 3, GAMMA_MAX, MAX_SEQ_LEN)
    assert build_config_for(manifest, max_batch=2, opt_batch=2).max_batch == 2


def test_profiles_of_the_target(manifest, build):
    d = manifest.target.dims
    profiles = optimization_profiles(build, manifest.target)
    assert list(profiles) == ["prefill", "step"]
    prefill, step = profiles["prefill"], profiles["step"]
    assert prefill["input_ids"] == {"min": (1, 1), "opt": (1, 16), "max": (4, 16)}
    assert step["input_ids"] == {"min": (1, 1), "opt": (1, 3 + 1), "max": (4, GAMMA_MAX + 1)}
    assert step["cache_len"] == {"min": (1,), "opt": (1,), "max": (4,)}
    for name in ("past_keys", "past_values"):
        kv = step[name]
        assert kv["min"] == (d.num_layers, 1, d.num_kv_heads, MAX_SEQ_LEN, d.head_dim)
        assert kv["max"] == (d.num_layers, 4, d.num_kv_heads, MAX_SEQ_LEN, d.head_dim)
        assert prefill[name] == kv  # S is static, B spans the same range
    assert set(prefill) == {s.name for s in manifest.target.inputs}


def test_draft_step_profile_is_tuned_for_one_token(manifest, build):
    step = optimization_profiles(build, manifest.draft)["step"]
    assert step["input_ids"]["opt"] == (1, 1) and step["input_ids"]["max"] == (4, GAMMA_MAX + 1)


def test_profiles_must_fit_the_exported_graph(manifest, build):
    with pytest.raises(EngineBuildError, match="static S 96"):
        check_fits(dataclasses.replace(build, max_seq_len=64), manifest.target)
    with pytest.raises(EngineBuildError, match="exported max_batch 4"):
        check_fits(dataclasses.replace(build, max_batch=8), manifest.target)


def test_forward_lengths_pick_a_profile(manifest, build):
    profiles = optimization_profiles(build, manifest.target)
    assert token_limits(profiles) == {"prefill": (1, 16), "step": (1, GAMMA_MAX + 1)}
    assert [profile_for(profiles, t) for t in (1, 4, GAMMA_MAX + 1, GAMMA_MAX + 2, 16)] == [1, 1, 1, 0, 0]
    with pytest.raises(BackendError, match="T=17") as info:
        profile_for(profiles, 17)
    assert "max_prefill_chunk" in info.value.hint


def test_plan_names_are_keyed_by_role_gpu_and_tensorrt():
    assert plan_name("target", (9, 0), "10.13.3.9") == "engines/target.sm90.trt10.13.3.9.plan"
    assert plan_name("draft", "8.6", "11.0.0") == "engines/draft.sm86.trt11.0.0.plan"
    with pytest.raises(ConfigError, match="role"):
        plan_name("critic", (9, 0), "10.0")
    with pytest.raises(ConfigError, match="dotted"):
        plan_name("target", (9, 0), "10/../x")
    with pytest.raises(ConfigError, match="compute capability"):
        plan_name("target", "sm90", "10.0")


def test_engine_record_round_trips_through_the_manifest(manifest, build):
    record = engine_record(build, manifest.target, (9, 0), "10.13.3.9", "ab" * 32)
    assert record.path == "engines/target.sm90.trt10.13.3.9.plan"
    assert record.compute_capability == "9.0" and record.tensorrt_version == "10.13.3.9"
    assert record.backend == "tensorrt" and record.profile_order == ["prefill", "step"]
    models = {**manifest.models, "target": with_engine(manifest.target, record)}
    text = json_from_manifest(dataclasses.replace(manifest, models=models))
    again = manifest_from_json(text)
    assert again.target.engines == [record]
    limits = token_limits(optimization_profiles(build, manifest.target))
    assert token_limits(again.target.engines[0].profiles) == limits
    newer = dataclasses.replace(record, sha256="cd" * 32)
    assert with_engine(again.target, newer).engines == [newer]  # same plan path: replaced, not appended
