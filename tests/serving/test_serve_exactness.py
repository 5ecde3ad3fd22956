"""Served output equals offline `Generator.generate`: greedy token for token (alone, streamed, and batched with
other requests under every speculation mode), and seeded sampled requests reproduce. The official `openai`
client is the client."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import NOT_GIVEN

import specdec
from specdec import GenerationConfig
from tests.runtime.test_requests import bundle_with_defaults
from tests.serving.conftest import KEY, client, metric, start

MODEL = "gqa"  # the bundle directory's name
PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time", "Summarize the following text",
           "brown fox jumps over the lazy dog. The quick brown fox", "a + b\n", "there was a tiny model",
           "Speculative decoding drafts"]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def offline(gqa_int4_bundle):
    with specdec.load(gqa_int4_bundle) as gen:
        yield gen


@pytest.fixture(scope="module")
def served(gqa_int4_bundle):
    with start(gqa_int4_bundle, api_key=KEY) as server:
        yield server


def _complete(api, prompt, stream=False, **options):
    options.setdefault("max_tokens", NEW_TOKENS)
    options.setdefault("temperature", 0)
    if not stream:
        result = api.completions.create(model=MODEL, prompt=prompt, **options)
        return result.choices[0].text, result.choices[0].finish_reason, result.usage.completion_tokens
    pieces, finish, usage = [], None, None
    for chunk in api.completions.create(model=MODEL, prompt=prompt, stream=True,
                                        stream_options={"include_usage": True}, **options):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    return "".join(pieces), finish, usage.completion_tokens


def _expected(offline, prompt, **config):
    config.setdefault("max_new_tokens", NEW_TOKENS)
    result = offline.generate(prompt, GenerationConfig(**config))
    finish = {"eos": "stop", "stop": "stop"}.get(result.finish_reason, "length")
    return result.text, finish, len(result.token_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_completions_equal_offline_generate(served, offline, stream):
    api = client(served)
    for prompt in PROMPTS[:5]:
        assert _complete(api, prompt, stream) == _expected(offline, prompt), prompt


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_chat_equals_offline_chat_template(served, offline, stream):
    api = client(served)
    for prompt in PROMPTS[:3]:
        messages = [{"role": "user", "content": prompt}]
        if stream:
            chunks = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW_TOKENS,
                                                      temperature=0, stream=True))
            assert chunks[0].choices[0].delta.role == "assistant"
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            result = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW_TOKENS, temperature=0)
            text = result.choices[0].message.content
            assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
        assert text == _expected(offline, prompt, chat=True)[0], prompt


@pytest.mark.parametrize("speculation", ["off", "fixed", "adaptive"])
def test_concurrent_greedy_requests_equal_offline(gqa_int4_bundle, offline, speculation):
    """8 requests on 4 rows: they join and leave the running batch; batched T = 1 steps (γ = 0) and batched
    draft steps give the same tokens as each prompt alone."""
    expected = [_expected(offline, prompt) for prompt in PROMPTS]
    with start(gqa_int4_bundle, speculation=speculation) as server, ThreadPoolExecutor(len(PROMPTS)) as pool:
        api = client(server, key="unused")
        got = list(pool.map(lambda i: _complete(api, PROMPTS[i], stream=i % 2 == 1), range(len(PROMPTS))))
        exposition = httpx.get(f"{server.url}/metrics").text
    assert got == expected
    rows, rounds = metric(exposition, "specdec_round_rows_sum"), metric(exposition, "specdec_round_rows_count")
    assert rows / rounds > 1.5  # rounds really ran several rows together


def test_seeded_sampled_requests_reproduce_offline(served, offline):
    """Alone and batched with greedy neighbours: a seeded sampled request keeps its own γ policy, gate and
    random stream (row_rng(seed, 0)), so it equals offline generate with the same seed."""
    cases = [(PROMPTS[i], {"temperature": 0.9, "top_p": 0.95, "seed": 10 + i}) for i in range(4)]
    expected = [_expected(offline, p, temperature=o["temperature"], top_p=o["top_p"], seed=o["seed"]) for p, o in cases]
    api = client(served)
    assert [_complete(api, p, **o) for p, o in cases] == expected
    with ThreadPoolExecutor(8) as pool:
        sampled = [pool.submit(_complete, api, p, i % 2 == 1, **o) for i, (p, o) in enumerate(cases)]
        greedy = [pool.submit(_complete, api, p) for p in PROMPTS[4:]]
        assert [f.result() for f in sampled] == expected
        assert all(f.result()[1] for f in greedy)


def test_stop_strings_and_drafters_equal_offline(served, offline):
    api = client(served)
    for drafter in ("model", "prompt_lookup", "none"):
        for prompt in PROMPTS[:3]:
            full = _expected(offline, prompt)[0]
            stop = full[5:8] if len(full) > 8 else "zz"
            got = _complete(api, prompt, stop=[stop], extra_body={"specdec": {"drafter": drafter, "gamma": 2}})
            want = _expected(offline, prompt, stop=(stop,), drafter=drafter, gamma=2)
            assert got == want, (drafter, prompt)
            assert stop not in got[0]


def test_a_bundles_sampling_defaults_are_served_as_generated_offline(gqa_int4_bundle, tmp_path):
    """A bundle whose manifest samples by default (temperature, top_k, top_p): a request that leaves them out gets
    them from the one request layer, served as offline; a value it sets wins, temperature 0 and top_k 0 included."""
    bundle = bundle_with_defaults(gqa_int4_bundle, tmp_path / MODEL)
    cases = [  # (what the client sends, the GenerationConfig offline)
        ({"seed": 5, "temperature": NOT_GIVEN}, {"seed": 5}),
        ({"seed": 5, "temperature": 0}, {"seed": 5, "temperature": 0.0}),
        ({"seed": 6, "temperature": NOT_GIVEN, "top_p": 1.0, "extra_body": {"specdec": {"top_k": 0}}},
         {"seed": 6, "top_p": 1.0, "top_k": 0}),
    ]
    with specdec.load(bundle) as offline:
        expected = [_expected(offline, PROMPTS[0], **config) for _, config in cases]
    with start(bundle) as server:
        api = client(server, key="unused")
        for stream in (False, True):
            assert [_complete(api, PROMPTS[0], stream, **sent) for sent, _ in cases] == expected, stream
    assert expected[0] != expected[1]  # the bundle's default sampled; the client's temperature 0 did not
