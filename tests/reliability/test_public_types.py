"""The public API checks the types of what it is handed, at its entry points (specdec.load, Generator.generate /
stream / run, GenerationConfig's fields): a value of the wrong type is a SpecDecError with a hint, never a bare
TypeError or AttributeError from deeper down, and its message repeats at most a short escaped prefix of the value."""
from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

import specdec
from specdec import GenerationConfig
from specdec.errors import SHOWN_CHARS, ConfigError, SpecDecError, shown


@pytest.fixture(scope="module")
def gen(gqa_int4_bundle):
    with specdec.load(gqa_int4_bundle, backend="onnxruntime") as generator:
        yield generator


class Folder(os.PathLike):
    def __init__(self, path):
        self.path = path

    def __fspath__(self):
        return self.path


def _refused(call, message: str, hint: str, kind=ConfigError) -> SpecDecError:
    with pytest.raises(kind) as info:
        call()
    assert message in info.value.message, info.value.message
    assert info.value.hint and hint in info.value.hint, info.value.hint
    assert len(str(info.value)) < 400  # a message, not the value
    return info.value


@pytest.mark.parametrize("bundle, message, hint", [
    (5, "the bundle must be a path (str or os.PathLike), not int: 5", "specdec.load('bundles/"),
    (None, "not NoneType", "pass the bundle's directory"),
    (["a"], "not list", "pass the bundle's directory"),
    (b"bundles/x", "the bundle path must be text, not bytes: b'bundles/x'", "os.fsdecode(path)"),
    (Folder(b"bundles/x"), "not bytes", "os.fsdecode(path)"),
    (Folder(7), "not Folder", "pass the bundle's directory"),
    ("", "is empty or holds a NUL character", "pass the bundle's directory"),
    ("bundles/a\0b", "is empty or holds a NUL character", "pass the bundle's directory"),
])
def test_load_refuses_a_bundle_that_is_not_a_text_path(bundle, message, hint):
    _refused(lambda: specdec.load(bundle), message, hint)


def test_load_takes_str_and_pathlike(gqa_int4_bundle):
    for bundle in (str(gqa_int4_bundle), pathlib.Path(gqa_int4_bundle), Folder(str(gqa_int4_bundle))):
        with specdec.load(bundle, backend="onnxruntime") as generator:
            assert generator.generate("The quick", GenerationConfig(max_new_tokens=2)).token_ids


@pytest.mark.parametrize("options, message, hint", [
    (dict(backend=5), "backend must be a str, not int: 5", "backend='auto'"),
    (dict(backend=["onnxruntime"]), "backend must be a str, not list", "backend='auto'"),
    (dict(device=0), "device must be a str or None, not int: 0", "device='cpu'"),
    (dict(verify="no"), "verify must be a bool, not str: 'no'", "verify=True"),
    (dict(prompt_budget={"timeout_s": 1}), "prompt_budget must be a PromptBudget or None, not dict", "PromptBudget("),
])
def test_load_refuses_options_of_the_wrong_type(gqa_int4_bundle, options, message, hint):
    _refused(lambda: specdec.load(gqa_int4_bundle, **options), message, hint)


@pytest.mark.parametrize("config", [{"max_new_tokens": 5}, 5, "greedy", [("max_new_tokens", 5)]])
def test_generate_stream_and_run_refuse_a_config_that_is_not_a_generation_config(gen, config):
    kind = type(config).__name__
    hint = "specdec.GenerationConfig(**options)"
    _refused(lambda: gen.generate("hi", config), f"config must be a GenerationConfig or None, not {kind}", hint)
    _refused(lambda: gen.stream("hi", config), f"not {kind}", hint)  # at the call, not at the first piece
    _refused(lambda: gen.run(["hi"], config), f"not {kind}", hint)


def test_run_refuses_prompts_that_are_not_a_list(gen):
    _refused(lambda: gen.run("hi"), "prompts must be a list of prompts, not str: 'hi'", "generator.run(['Hello'")


@pytest.mark.parametrize("prompt, seen", [
    ([True, 2], "[True, 2]"), ([1.5, 2.0], "1.5"), (np.array([1.0, 2.0]), "array("), (None, "None"),
    ({"text": "hi"}, "{'text': 'hi'}"), (3.0, "3.0"),
])
def test_token_ids_are_integers_not_bools_floats_or_other_things(gen, prompt, seen):
    error = _refused(lambda: gen.generate(prompt, GenerationConfig(max_new_tokens=2)),
                     "the prompt is neither text nor token ids", "a list of integer token ids")
    assert seen in error.message
    assert gen.generate(np.array([5, 6], dtype=np.int32), GenerationConfig(max_new_tokens=2)).token_ids


@pytest.mark.parametrize("fields, message, hint", [
    (dict(max_new_tokens="5"), "max_new_tokens must be an integer >= 1, got '5'", "max_new_tokens=1"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer >= 1, got True", "max_new_tokens=1"),
    (dict(temperature=[0.5]), "temperature must be a finite number, got [0.5]", "use 0 for greedy"),
    (dict(temperature="0.5"), "temperature must be a finite number, got '0.5'", "use 0 for greedy"),
    (dict(seed=1.5), "seed must be an integer >= 0, got 1.5", "pass a seed >= 0"),
    (dict(seed=False), "seed must be an integer >= 0, got False", "pass a seed >= 0"),
    (dict(top_k=2.0), "top_k must be an integer >= 0, got 2.0", "top-k off"),
    (dict(gamma="4"), "gamma must be an integer >= 1, got '4'", "gamma=1"),
    (dict(stop=5), "stop must be a string or a list of strings, got 5", "stop=['###']"),
    (dict(stop={"###": 1}), "stop must be a string or a list of strings, got {'###': 1}", "stop=['###']"),
    (dict(stop=b"###"), "stop must be a string or a list of strings, got b'###'", "stop=['###']"),
    (dict(stop=[5]), "stop strings must be non-empty strings, got 5", "drop empty stop strings"),
    (dict(eos_token_ids="2"), "eos_token_ids must be a list of token ids, got '2'", "token ids"),
    (dict(eos_token_ids={2: 1}), "eos_token_ids must be a list of token ids", "token ids"),
    (dict(chat=1), "chat must be True or False, got 1", "chat=True"),
    (dict(drafter=None), "drafter None is unknown", "choose one of"),
])
def test_generation_config_fields_of_the_wrong_type(fields, message, hint):
    _refused(lambda: GenerationConfig(**fields), message, hint)


@pytest.mark.parametrize("field", ["max_new_tokens", "temperature", "drafter", "stop", "chat", "eos_token_ids"])
def test_a_huge_or_html_value_is_shown_as_a_short_escaped_prefix(field):
    for value in ("A" * 1_000_000, "<script>alert(1)</script>" * 100, ["<b>"] * 100_000):
        with pytest.raises(ConfigError) as info:
            GenerationConfig(**{field: value if field != "stop" else [value, 5]})
        text = str(info.value)
        assert len(text) < 300 and "<" not in text and "A" * (SHOWN_CHARS + 1) not in text, text


def test_shown_cuts_and_escapes():
    assert shown("x" * 10**6).startswith("'xxx") and len(shown("x" * 10**6)) <= SHOWN_CHARS
    assert shown("<img src=x onerror=alert(1)>") == "'\\x3cimg src=x onerror=alert(1)\\x3e'"
    assert shown("é\udce9") == "'\\xe9\\udce9'"
    assert shown(10**5000) == "(a int too long to show)"  # past Python's digit limit for int -> str
    assert shown([1, 2, 3, 4, 5]) == "[1, 2, 3, ...]"
