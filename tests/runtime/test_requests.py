"""Bad requests, stops, capacity, and the generate CLI."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest

import specdec
from specdec import GenerationConfig
from specdec.cli import main
from specdec.errors import CapacityError, ConfigError, ManifestError
from tests.conftest import GAMMA_MAX, MAX_SEQ_LEN

SAMPLING_DEFAULTS = {"temperature": 0.8, "top_k": 5, "top_p": 0.9}  # a bundle whose manifest samples by default


def bundle_with_defaults(bundle, copy, **defaults):
    """A copy of `bundle` whose manifest's defaults hold `defaults` (SAMPLING_DEFAULTS unless given)."""
    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["defaults"].update(defaults or SAMPLING_DEFAULTS)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


@pytest.fixture(scope="module")
def gen(int4_bundle):
    with specdec.load(int4_bundle) as generator:
        yield generator


@pytest.fixture(scope="module")
def sampling_bundle(int4_bundle, tmp_path_factory):
    return bundle_with_defaults(int4_bundle, tmp_path_factory.mktemp("defaults") / "sampling")


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(gen, prompt):
    with pytest.raises(ConfigError, match="empty|no token ids"):
        gen.generate(prompt)


def test_token_id_outside_vocabulary(gen):
    with pytest.raises(ConfigError, match="outside the vocabulary") as info:
        gen.generate([1, 2, 10_000])
    assert info.value.hint


def test_gamma_above_gamma_max(gen):
    with pytest.raises(ConfigError, match="gamma_max"):
        gen.generate("hello", GenerationConfig(gamma=GAMMA_MAX + 1))


def test_prompt_longer_than_s_and_batch_above_max_batch(gen):
    with pytest.raises(CapacityError, match="max_seq_len"):
        gen.generate([5] * (MAX_SEQ_LEN + 1))
    with pytest.raises(CapacityError, match="max_batch"):
        gen.generate(["a", "b", "c", "d", "e"])


def test_a_failed_request_leaves_the_generator_usable(gen):
    expected = gen.generate("The quick", GenerationConfig(max_new_tokens=8)).token_ids
    with pytest.raises(CapacityError):
        gen.generate(["a"] * 9)
    assert gen.generate("The quick", GenerationConfig(max_new_tokens=8)).token_ids == expected


def test_length_stop_never_writes_out_of_bounds(gen):
    for drafter in ("model", "auto", "none"):
        for prompt_len in (MAX_SEQ_LEN - 20, MAX_SEQ_LEN - 1, MAX_SEQ_LEN):
            result = gen.generate([7] * prompt_len, GenerationConfig(max_new_tokens=500, drafter=drafter,
                                                                     gamma=GAMMA_MAX, eos_token_ids=()))
            assert result.finish_reason == "length"
            assert prompt_len + len(result.token_ids) == max(MAX_SEQ_LEN, prompt_len + 1)


def test_max_new_tokens_and_eos(gen):
    result = gen.generate("Once upon", GenerationConfig(max_new_tokens=5, eos_token_ids=()))
    assert len(result.token_ids) == 5 and result.finish_reason == "max_new_tokens"
    stop_at = result.token_ids[2]
    cut = gen.generate("Once upon", GenerationConfig(max_new_tokens=5, eos_token_ids=(stop_at,)))
    assert cut.finish_reason == "eos"
    assert cut.token_ids == result.token_ids[: result.token_ids.index(stop_at) + 1]


def test_stop_strings(gen):
    full = gen.generate("Once upon", GenerationConfig(max_new_tokens=20, eos_token_ids=()))
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    assert stop.strip(), full.text
    cut = gen.generate("Once upon", GenerationConfig(max_new_tokens=20, eos_token_ids=(), stop=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert full.token_ids[: len(cut.token_ids)] == cut.token_ids


def test_stream_yields_the_generated_text(gen):
    config = GenerationConfig(max_new_tokens=16, drafter="model")
    assert "".join(gen.stream("The lazy dog", config)) == gen.generate("The lazy dog", config).text
    assert gen.last_stats.emitted >= 1


def test_chat_template(gen):
    result = gen.generate("Hello", GenerationConfig(max_new_tokens=4, chat=True))
    assert gen.codec.decode(result.prompt_ids).startswith("user\nHello")


def test_stats_are_consistent(gen):
    stats = gen.generate("The quick brown fox", GenerationConfig(max_new_tokens=30, drafter="model",
                                                                 eos_token_ids=())).stats
    assert stats.emitted >= 30  # counted before truncation to max_new_tokens
    assert stats.emitted == stats.accepted + stats.verify_passes  # each pass emits its accepted drafts + 1
    assert stats.verify_passes >= 1 and 0 <= stats.acceptance_rate <= 1
    assert stats.mean_acceptance_length == stats.emitted / stats.verify_passes
    assert len(stats.per_position_acceptance) >= 1
    assert stats.draft_s > 0 and stats.verify_s > 0 and stats.host_s >= 0


def test_corrupt_bundle(int4_bundle, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(int4_bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["schema_version"] = 0
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="schema_version"):
        specdec.load(copy)
    with pytest.raises(ManifestError, match="does not exist"):
        specdec.load(tmp_path / "missing")


def test_generate_cli_streams_text_and_prints_stats(int4_bundle, capsys):
    assert main(["generate", str(int4_bundle), "--prompt", "The quick", "--max-new-tokens", "6"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "tok/s" in captured.err and "acceptance" in captured.err
    assert main(["generate", str(int4_bundle), "--prompt", "x", "--gamma", str(GAMMA_MAX + 1)]) == 1
    assert "Hint:" in capsys.readouterr().err


def test_runtime_never_imports_torch_or_transformers(int4_bundle):
    code = (
        "import sys, specdec\n"
        f"g = specdec.load({str(int4_bundle)!r})\n"
        "r = g.generate('The quick brown fox', specdec.GenerationConfig(max_new_tokens=8, drafter='auto'))\n"
        "assert r.token_ids, r\n"
        "bad = [m for m in ('torch', 'transformers', 'specdec.export') if m in sys.modules]\n"
        "print('LOADED:' + ','.join(bad))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert proc.returncode == 0, proc.stderr
    assert "LOADED:\n" in proc.stdout


# --- the bundle's sampling defaults: filled in by the request layer, for what a config leaves unset ---------------
def test_a_config_leaves_sampling_to_the_bundle_until_it_sets_a_value():
    config = GenerationConfig(max_new_tokens=4)
    assert config.unset == ("temperature", "top_k", "top_p")
    assert dataclasses.replace(config, seed=3).unset == config.unset  # replace keeps what was left unset
    assert GenerationConfig(temperature=0.0, top_k=0, top_p=1.0).unset == ()
    with pytest.raises(ConfigError, match="leaves temperature to the bundle") as info:
        config.greedy  # noqa: B018 - whether it samples is the bundle's to say
    assert "generator.requests.config(config)" in info.value.hint
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-1)):
        with pytest.raises(ConfigError, match="or None for the bundle's default"):
            GenerationConfig(**bad)


def test_the_request_layer_fills_the_bundles_defaults_and_keeps_every_value_set(sampling_bundle, gen):
    with specdec.load(sampling_bundle) as sampling:
        layer = sampling.requests
        assert dataclasses.asdict(layer.config(GenerationConfig())) == dataclasses.asdict(
            GenerationConfig(**SAMPLING_DEFAULTS))
        explicit = layer.config(GenerationConfig(temperature=0.0, top_k=0, top_p=1.0))  # the library's own defaults
        assert (explicit.temperature, explicit.top_k, explicit.top_p) == (0.0, 0, 1.0) and explicit.greedy
        partly = layer.config(GenerationConfig(temperature=0.3))
        assert (partly.temperature, partly.top_k, partly.top_p) == (0.3, 5, 0.9)
        assert gen.requests.config(GenerationConfig()).greedy  # a bundle exported with no sampling defaults
        unset = GenerationConfig(max_new_tokens=12, seed=7, eos_token_ids=())
        sampled = sampling.generate("The quick", unset)
        assert sampled.token_ids == sampling.generate("The quick", GenerationConfig(
            max_new_tokens=12, seed=7, eos_token_ids=(), **SAMPLING_DEFAULTS)).token_ids
        greedy = sampling.generate("The quick", dataclasses.replace(unset, temperature=0.0))
    assert greedy.token_ids == gen.generate("The quick", dataclasses.replace(unset, seed=None)).token_ids
    assert sampled.token_ids != greedy.token_ids


def test_generate_cli_takes_the_bundles_defaults_and_its_own_options_over_them(sampling_bundle, capsys):
    command = ["generate", str(sampling_bundle), "--prompt", "The quick", "--max-new-tokens", "12", "--seed", "7"]
    with specdec.load(sampling_bundle) as generator:
        expected = [generator.generate("The quick", GenerationConfig(max_new_tokens=12, seed=7, **extra)).text
                    for extra in ({}, {"temperature": 0.0})]
    got = []
    for extra in ([], ["--temperature", "0"]):
        assert main(command + extra) == 0
        got.append(capsys.readouterr().out[:-1])  # the text, then a newline
    assert got == expected and expected[0] != expected[1]
