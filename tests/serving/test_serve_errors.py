"""Bad input gets an OpenAI-style error JSON with a 4xx (never a 500) and the server keeps serving; a full queue is
answered 429 with Retry-After; a client that disconnects mid-stream frees its row."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from tests.conftest import MAX_SEQ_LEN
from tests.serving.conftest import KEY, client, metric, start, start_slow

MODEL = "gqa"
AUTH = {"authorization": f"Bearer {KEY}"}
NEW_TOKENS = MAX_SEQ_LEN - 16  # one token per round, 50 ms a round: the stream would last about 4 s
GOOD = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 4}


@pytest.fixture(scope="module")
def served(gqa_int4_bundle):
    with start(gqa_int4_bundle, api_key=KEY, max_body_bytes=4096) as server:
        yield server


BAD_BODIES = {
    "missing prompt": ({"model": MODEL, "max_tokens": 4}, 400, "/v1/completions"),
    "missing messages": ({"model": MODEL}, 400, "/v1/chat/completions"),
    "empty messages": ({"model": MODEL, "messages": []}, 400, "/v1/chat/completions"),
    "unknown model": ({**GOOD, "model": "gpt-4"}, 404, "/v1/completions"),
    "n > 1": ({**GOOD, "n": 2}, 400, "/v1/completions"),
    "max_tokens 0": ({**GOOD, "max_tokens": 0}, 400, "/v1/completions"),
    "max_tokens negative": ({**GOOD, "max_tokens": -3}, 400, "/v1/completions"),
    "negative temperature": ({**GOOD, "temperature": -0.5}, 400, "/v1/completions"),
    "top_p above 1": ({**GOOD, "top_p": 1.5}, 400, "/v1/completions"),
    "top_p 0": ({**GOOD, "top_p": 0}, 400, "/v1/completions"),
    "prompt longer than S": ({**GOOD, "prompt": list(range(5, 5 + MAX_SEQ_LEN + 1))}, 400, "/v1/completions"),
    "unknown drafter": ({**GOOD, "specdec": {"drafter": "medusa"}}, 400, "/v1/completions"),
    "gamma above gamma_max": ({**GOOD, "specdec": {"gamma": 99}}, 400, "/v1/completions"),
    "token id outside the vocabulary": ({**GOOD, "prompt": [1, 10**9]}, 400, "/v1/completions"),
    "two prompts": ({**GOOD, "prompt": ["a", "b"]}, 400, "/v1/completions"),
    "prompt of the wrong type": ({**GOOD, "prompt": {"text": "x"}}, 400, "/v1/completions"),
    "logprobs": ({**GOOD, "logprobs": 2}, 400, "/v1/completions"),
    "echo": ({**GOOD, "echo": True}, 400, "/v1/completions"),
    "best_of": ({**GOOD, "best_of": 3}, 400, "/v1/completions"),
    "logit_bias": ({**GOOD, "logit_bias": {"5": 100}}, 400, "/v1/completions"),
    "suffix": ({**GOOD, "suffix": "end"}, 400, "/v1/completions"),
    "tools": ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
               "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "/v1/chat/completions"),
    "json response_format": ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_object"}}, 400, "/v1/chat/completions"),
    "seed true": ({**GOOD, "seed": True}, 400, "/v1/completions"),
    "seed text": ({**GOOD, "seed": "7"}, 400, "/v1/completions"),
}
NAMED = {"echo", "best_of", "logit_bias", "suffix", "tools", "seed true"}  # the message names the field


def _check_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in response.text and KEY not in response.text
    return error


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_body_gets_a_4xx_error_json(served, case):
    body, status, path = BAD_BODIES[case]
    error = _check_error(httpx.post(served.url + path, json=body, headers=AUTH), status)
    if case in NAMED:
        assert case.split()[0] in error["message"], error


def test_no_op_values_of_unsupported_fields_are_served(served):
    body = {**GOOD, "echo": False, "best_of": 1, "logit_bias": {}, "seed": 7, "user": "me"}
    assert httpx.post(served.url + "/v1/completions", json=body, headers=AUTH).status_code == 200
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [],
            "response_format": {"type": "text"}}
    assert httpx.post(served.url + "/v1/chat/completions", json=chat, headers=AUTH).status_code == 200


def test_invalid_json_wrong_key_oversized_body_and_unknown_route(served):
    for headers in (AUTH, {**AUTH, "content-type": "application/json"}):
        raw = httpx.post(served.url + "/v1/completions", content=b'{"model": "gqa", "prompt": ', headers=headers)
        assert "JSON" in _check_error(raw, 400)["message"]
    assert "JSON" in _check_error(httpx.post(served.url + "/v1/completions", json=[1, 2], headers=AUTH), 400)["message"]
    for headers in ({"authorization": "Bearer wrong-key"}, {}, {"authorization": KEY}):
        _check_error(httpx.post(served.url + "/v1/completions", json=GOOD, headers=headers), 401)
    _check_error(httpx.get(served.url + "/metrics"), 401)
    big = {**GOOD, "prompt": "x" * 5000}
    assert _check_error(httpx.post(served.url + "/v1/completions", json=big, headers=AUTH), 413)["code"]
    _check_error(httpx.post(served.url + "/v1/nothing", json=GOOD, headers=AUTH), 404)


def test_the_openai_client_sees_the_errors_and_the_server_keeps_serving(served):
    api = client(served)
    with pytest.raises(openai.AuthenticationError):
        client(served, key="nope").completions.create(**GOOD)
    with pytest.raises(openai.NotFoundError):
        api.completions.create(**{**GOOD, "model": "nope"})
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3)
    assert api.completions.create(**GOOD).choices[0].finish_reason == "length"
    exposition = httpx.get(served.url + "/metrics", headers=AUTH).text
    assert metric(exposition, "specdec_requests_total", 'status="error"') == 0
    assert metric(exposition, "specdec_requests_total", 'status="invalid"') >= 2
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    models = httpx.get(served.url + "/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


BIG, HTML = "A" * 900_000, "<script>alert(1)</script><img src=x onerror=alert(2)>"
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ECHOES = {  # (path, body): a value a client sent that a 400 could repeat
    "suffix": ("/v1/completions", {**GOOD, "suffix": BIG}),
    "logit_bias html": ("/v1/completions", {**GOOD, "logit_bias": {"5": HTML}}),
    "logit_bias key": ("/v1/completions", {**GOOD, "logit_bias": {HTML + BIG[:100_000]: 1}}),
    "echo": ("/v1/completions", {**GOOD, "echo": HTML}),
    "best_of": ("/v1/completions", {**GOOD, "best_of": int("9" * 4000)}),
    "tools": ("/v1/chat/completions", {**CHAT_BODY, "tools": [{"type": HTML, "function": BIG}]}),
    "response_format": ("/v1/chat/completions", {**CHAT_BODY, "response_format": {"type": HTML}}),
    "unknown specdec key": ("/v1/completions", {**GOOD, "specdec": {"A" * 100_000: 1, HTML: 2}}),
    "drafter": ("/v1/completions", {**GOOD, "specdec": {"drafter": HTML + BIG}}),
    "role": ("/v1/chat/completions", {**CHAT_BODY, "messages": [{"role": HTML + BIG, "content": "hi"}]}),
    "content part": ("/v1/chat/completions", {**CHAT_BODY, "messages": [{"role": "user",
                                                                         "content": [{"type": HTML, "text": BIG}]}]}),
    "max_tokens": ("/v1/completions", {**GOOD, "max_tokens": HTML + BIG}),
    "temperature": ("/v1/completions", {**GOOD, "temperature": HTML}),
    "stop": ("/v1/completions", {**GOOD, "stop": [HTML] * 5}),
    "seed": ("/v1/completions", {**GOOD, "seed": BIG}),
    "prompt": ("/v1/completions", {**GOOD, "prompt": [HTML, BIG]}),
}


@pytest.fixture(scope="module")
def roomy(gqa_int4_bundle):
    """A server that takes bodies of 2 MiB: room for a 900 KB value."""
    with start(gqa_int4_bundle, max_body_bytes=2 << 20) as server:
        yield server


@pytest.mark.parametrize("case", list(ECHOES))
def test_a_400_never_echoes_a_large_or_html_value(roomy, case):
    """docs/serving.md promises no echo: a 900 KB suffix got a 900 KB error, HTML in logit_bias came back."""
    path, body = ECHOES[case]
    response = httpx.post(roomy.url + path, json=body, timeout=60)
    error = _check_error(response, 400)
    assert len(response.content) < 1000, response.text[:300]
    for sent in ("AAAAAAAA", "<", "script", "onerror", "9999999999"):
        assert sent not in response.text, (case, response.text)
    assert error["code"] == "invalid_value" and error["param"].split(".")[0] in {*body, "body"}, error


def _open_stream(url: str, max_tokens: int):
    """A streaming request whose first chunk has arrived; -> (client, response, its line iterator). Keep the
    iterator: dropping it closes the connection."""
    session = httpx.Client(timeout=30)
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "specdec": {"drafter": "none"}}
    request = session.build_request("POST", url + "/v1/completions", json=body)
    response = session.send(request, stream=True)
    assert response.status_code == 200
    lines = response.iter_lines()
    first = next(line for line in lines if line.startswith("data: "))
    assert json.loads(first[6:])["choices"][0]["text"] is not None
    return session, response, lines


def _wait_for(url: str, name: str, labels: str, value: float, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        exposition = httpx.get(url + "/metrics").text
        if metric(exposition, name, labels) == value:
            return exposition
        time.sleep(0.05)
    raise AssertionError(f"{name}{{{labels}}} never reached {value}")


def test_disconnect_frees_the_row_and_a_full_queue_answers_429(gqa_int4_bundle):
    """One row, one queue place: a long stream holds the row, a second request waits, a third gets 429 with
    Retry-After. Closing the stream mid-way frees the row at the next round, and the waiting request runs."""
    with start_slow(gqa_int4_bundle, max_batch=1, max_queue=1, speculation="off") as server:
        session, stream, lines = _open_stream(server.url, NEW_TOKENS)
        waiting = {}
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
        thread = threading.Thread(target=lambda: waiting.update(r=httpx.post(server.url + "/v1/completions",
                                                                              json=body, timeout=60)))
        thread.start()
        _wait_for(server.url, "specdec_queue_depth", "", 1.0)
        refused = httpx.post(server.url + "/v1/completions", json=body)
        assert _check_error(refused, 429)["code"] == "queue_full" and refused.headers["retry-after"] == "1"
        assert next(lines) is not None and metric(httpx.get(server.url + "/metrics").text, "specdec_active_rows") == 1
        stream.close()
        session.close()
        exposition = _wait_for(server.url, "specdec_requests_total", 'status="cancelled"', 1.0)
        thread.join(timeout=60)
        assert waiting["r"].status_code == 200
        exposition = _wait_for(server.url, "specdec_active_rows", "", 0.0)
        assert metric(exposition, "specdec_requests_total", 'status="rejected"') == 1
        assert metric(exposition, "specdec_generation_tokens_total", "") < NEW_TOKENS / 2  # the stream stopped early
