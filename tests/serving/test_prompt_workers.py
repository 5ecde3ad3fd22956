"""Chat templates on a budget (serving/prompts.py): a template that builds a huge string, loops for ever or writes
without end costs its one request an error, never the server; plain completions are answered meanwhile; /health
reports the workers saturated; SIGTERM stops the server whatever the workers are doing."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specdec.manifest import sha256_file
from tests.serving.conftest import start

# One template, three ways to exhaust a server, chosen by the last message; anything else renders normally.
TEMPLATE = """{%- set text = messages[-1]['content'] -%}
{%- if text == 'grow' -%}{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}
{%- elif text == 'loop' -%}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}
{%- elif text == 'write' -%}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}
{%- endif -%}
<|im_start|>user
{{ text }}<|im_end|>
<|im_start|>assistant
"""
TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def greedy_bundle(gqa_int4_bundle, tmp_path_factory):
    """The tiny bundle with TEMPLATE as its chat template (its hash recorded, as a deliberately made bundle)."""
    import json

    bundle = tmp_path_factory.mktemp("greedy") / "bundle"
    shutil.copytree(gqa_int4_bundle, bundle)
    (bundle / "chat_template.jinja").write_text(TEMPLATE)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["tokenizer"]["files"]["chat_template.jinja"] = sha256_file(bundle / "chat_template.jinja")
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    return bundle


def _chat(url: str, text: str, timeout: float = 60) -> httpx.Response:
    body = {"model": "bundle", "messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)


def _complete(url: str) -> httpx.Response:
    body = {"model": "bundle", "prompt": "hello there", "max_tokens": 2, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_a_template_over_its_budget_costs_one_request(greedy_bundle):
    with start(greedy_bundle, prompt_timeout_s=TIMEOUT_S, prompt_memory_mb=256) as server:
        grown = _chat(server.url, "grow")  # doubles a string until the worker's 256 MB are spent
        assert grown.status_code == 500 and grown.json()["error"]["code"] == "prompt_budget_exceeded", grown.text
        assert "MB" in grown.json()["error"]["message"]
        written = _chat(server.url, "write")  # 100 MB of output: more than S tokens could hold
        assert written.status_code == 400, written.text
        assert written.json()["error"]["code"] == "context_length_exceeded"
        with ThreadPoolExecutor(1) as pool:
            looping = pool.submit(_chat, server.url, "loop")  # 10^10 iterations
            time.sleep(0.3)
            plain = _complete(server.url)
            assert plain.status_code == 200 and not looping.done()  # answered while the template runs
            looped = looping.result()
        assert looped.status_code == 500 and looped.json()["error"]["code"] == "prompt_budget_exceeded"
        assert f"{TIMEOUT_S:g} s" in looped.json()["error"]["message"]
        fine = _chat(server.url, "hi")  # the workers that were killed were replaced
        assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == 2
        assert httpx.get(f"{server.url}/health").status_code == 200


def test_health_reports_the_workers_saturated(greedy_bundle):
    with start(greedy_bundle, prompt_workers=1, prompt_timeout_s=TIMEOUT_S) as server:
        with ThreadPoolExecutor(2) as pool:
            loops = [pool.submit(_chat, server.url, "loop") for _ in range(2)]  # one runs, one waits
            time.sleep(0.5)
            health = httpx.get(f"{server.url}/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "prompt_workers_saturated"
            assert _complete(server.url).status_code == 200
            assert [loop.result().status_code for loop in loops] == [500, 500]
        deadline = time.monotonic() + 30  # the killed worker's replacement starts in the background
        while httpx.get(f"{server.url}/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert httpx.get(f"{server.url}/health").status_code == 200


def _running(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads processes from /proc")
def test_sigterm_stops_the_server_while_workers_render(greedy_bundle):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url, drain = f"http://127.0.0.1:{port}", 1
    command = [sys.executable, "-m", "specdec.cli", "serve", str(greedy_bundle), "--port", str(port),
               "--prompt-timeout", "600", "--drain-timeout", str(drain)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        workers = _children(server.pid)
        assert len(workers) == 2, workers
        with ThreadPoolExecutor(3) as pool:
            loops = [pool.submit(_chat, url, "loop", 120) for _ in range(3)]  # both workers busy, one waiting
            time.sleep(1.0)
            stopped = time.monotonic()
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=drain + 5 + 10)  # the drain, uvicorn's margin (server.SHUTDOWN_MARGIN_S), slack
            took = time.monotonic() - stopped
            for loop in loops:
                try:
                    loop.result()
                except httpx.TransportError:
                    pass  # the connection closed by the stop: an answer is not owed, a hang is not allowed
        assert took < drain + 15
        time.sleep(0.5)
        assert not [pid for pid in workers if _running(pid)], "a prompt worker outlived the server"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
