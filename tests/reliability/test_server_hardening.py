"""Server hardening: slowloris sockets cannot lock clients out (a header timeout, a cap on
open connections that evicts the oldest connection still waiting for a request), tokenizing runs off the event
loop, a loopback server answers only requests addressed to loopback names, an empty SPECDEC_API_KEY is refused, and
SIGTERM drains: streams end with their last event or an SSE error and `[DONE]`, queued requests get a 503, and the
log carries no traceback."""
from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

pytest.importorskip("uvicorn", reason="the [serve] extra is not installed: pip install -e '.[serve]'")

import httpx  # noqa: E402

from specdec.errors import ConfigError  # noqa: E402
from specdec.serving.options import API_KEY_ENV, ServeOptions  # noqa: E402
from specdec.serving.server import BackgroundServer  # noqa: E402
from tests.conftest import free_port  # noqa: E402

SLOW_ROUNDS = (  # a subprocess `specdec serve` whose engine pauses before each round (a tiny model is too fast)
    "import sys, time\n"
    "from specdec.serving.engine import Engine\n"
    "_round = Engine._round\n"
    "def slow(self):\n"
    "    time.sleep(0.2)\n"
    "    _round(self)\n"
    "Engine._round = slow\n"
)
PARTIAL = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"



@contextmanager
def _serve_process(bundle, args=(), code="", open_files=None):
    """`specdec serve` in a subprocess (the CLI's own signal handling), with an optional open-file limit; yields
    (process, url) once /health answers."""
    port = free_port()
    argv = ["serve", str(bundle), "--port", str(port), *args]
    script = code + f"from specdec.cli import main\nsys.exit(main({argv!r}))\n"

    def limit():
        if open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    proc = subprocess.Popen([sys.executable, "-c", "import sys\n" + script], stderr=subprocess.PIPE, text=True,
                            preexec_fn=limit, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)


def test_slowloris_sockets_beyond_the_open_file_limit_leave_other_clients_answered(gqa_int4_bundle):
    """1,100 sockets that open and never finish their headers, against a server whose open-file limit is the common
    default of 1024: the server keeps its connections below that limit by closing the oldest waiting socket for
    each new one, so a client that sends a whole request is answered."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1400:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    with _serve_process(gqa_int4_bundle, open_files=1024) as (proc, url):
        port = int(url.rsplit(":", 1)[1])
        sockets = []
        try:
            for _ in range(1100):
                sock = socket.create_connection(("127.0.0.1", port), timeout=10)
                sock.sendall(PARTIAL)
                sockets.append(sock)
            started = time.monotonic()
            response = httpx.get(url + "/health", timeout=10)
            print(f"answered in {time.monotonic() - started:.3f} s with 1,100 slowloris sockets open")
            assert response.status_code == 200
        finally:
            for sock in sockets:
                sock.close()
        assert proc.poll() is None


def _closed_by_server(sock: socket.socket, wait_s: float) -> bool:
    sock.settimeout(wait_s)
    try:
        while sock.recv(4096):  # a response first (keep-alive), then the close
            pass
        return True
    except (socket.timeout, TimeoutError):
        return False
    except OSError:  # reset by the server
        return True


def test_headers_must_come_in_time_and_the_oldest_waiting_connection_makes_way(gqa_int4_bundle):
    options = ServeOptions(bundle=str(gqa_int4_bundle), port=0, header_timeout_s=1.0, keep_alive_s=30,
                           max_connections=12)
    with BackgroundServer(options) as server:
        address = ("127.0.0.1", server.port)
        slow = socket.create_connection(address)
        slow.sendall(PARTIAL)  # never finishes its headers
        kept = socket.create_connection(address)  # a keep-alive connection that then sends headers slowly
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert kept.recv(4096).startswith(b"HTTP/1.1 200")
        kept.sendall(b"GET /health HTTP/1.1\r\n")
        assert _closed_by_server(slow, 15) and _closed_by_server(kept, 15)
        idle = [socket.create_connection(address) for _ in range(20)]  # beyond the cap of 12
        try:
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
            assert _closed_by_server(idle[0], 0.5)  # the oldest waiting one made way
            assert not _closed_by_server(idle[-1], 0.2)
        finally:
            for sock in idle + [slow, kept]:
                sock.close()


def test_a_body_must_come_in_time(gqa_int4_bundle):
    """Headers sent whole, then a body that stops short of its Content-Length: the connection is closed after the
    body timeout, so such sockets cannot hold the connection cap; a body that comes in time is answered."""
    options = ServeOptions(bundle=str(gqa_int4_bundle), port=0, header_timeout_s=0.5, body_timeout_s=1.5,
                           keep_alive_s=30)
    with BackgroundServer(options) as server:
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 2}).encode()
        head = PARTIAL + b"Content-Length: %d\r\n\r\n" % len(body)
        address = ("127.0.0.1", server.port)
        stalled = socket.create_connection(address)
        stalled.sendall(head + body[:5])  # the rest never comes
        slow = socket.create_connection(address)
        slow.sendall(head + body[:5])
        time.sleep(0.6)  # slower than the header timeout, well within the body timeout
        slow.sendall(body[5:])
        slow.settimeout(30)
        assert slow.recv(4096).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        assert _closed_by_server(stalled, 15)
        assert time.monotonic() - started < 10
        slow.close()
        stalled.close()


def test_tokenizing_runs_off_the_event_loop(gqa_int4_bundle):
    """A prompt whose tokenizing takes long (held here on purpose) must not stop the server answering others."""
    with BackgroundServer(ServeOptions(bundle=str(gqa_int4_bundle), port=0)) as server:
        codec = server.app.state.engine.gen.codec
        entered, release, original = threading.Event(), threading.Event(), codec.encode

        def held(text, special=True):
            if "HOLD" in text:
                entered.set()
                release.wait(60)
            return original(text, special)

        codec.encode = held
        body = {"model": "gqa", "prompt": "HOLD the quick brown fox", "max_tokens": 2}
        slow = threading.Thread(target=lambda: httpx.post(server.url + "/v1/completions", json=body, timeout=90))
        slow.start()
        try:
            assert entered.wait(30)
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
            other = httpx.post(server.url + "/v1/completions", json={**body, "prompt": "The quick"}, timeout=30)
            assert other.status_code == 200 and other.json()["choices"][0]["text"] is not None
        finally:
            release.set()
            slow.join(timeout=90)


def test_a_loopback_server_answers_only_loopback_host_names(gqa_int4_bundle):
    with BackgroundServer(ServeOptions(bundle=str(gqa_int4_bundle), port=0)) as server:
        for host in ("localhost", f"localhost:{server.port}", "127.0.0.1:9", "[::1]", "[::1]:8000", "LOCALHOST"):
            assert httpx.get(server.url + "/health", headers={"host": host}).status_code == 200, host
        for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.evil", "::1"):
            response = httpx.get(server.url + "/v1/models", headers={"host": host})
            assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_host", host
            assert "evil" not in response.text


def test_an_empty_api_key_in_the_environment_is_refused(gqa_int4_bundle, monkeypatch, capsys):
    from specdec.cli import main

    for empty in ("", "  "):
        monkeypatch.setenv(API_KEY_ENV, empty)
        with pytest.raises(ConfigError, match=f"{API_KEY_ENV} is set but empty") as info:
            ServeOptions(bundle=str(gqa_int4_bundle))
        assert "unset it" in info.value.hint
        assert main(["serve", str(gqa_int4_bundle), "--port", "0"]) == 1
        assert "is set but empty" in capsys.readouterr().err
    monkeypatch.setenv(API_KEY_ENV, "a-key")
    assert ServeOptions(bundle=str(gqa_int4_bundle)).key == "a-key"


def _sse_events(lines: list) -> list:
    return [line[6:] for line in lines if line.startswith("data: ")]


def test_sigterm_drains_streams_answers_the_queue_503_and_logs_no_traceback(gqa_int4_bundle):
    args = ["--max-batch", "1", "--max-queue", "4", "--speculation", "off", "--drain-timeout", "1"]
    with _serve_process(gqa_int4_bundle, args, code=SLOW_ROUNDS) as (proc, url):
        results = {}

        def stream(name: str) -> None:
            body = {"model": "gqa", "prompt": "The quick", "max_tokens": 60, "stream": True, "temperature": 0}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
                results[name] = (response.status_code, list(response.iter_lines()))

        def plain() -> None:
            response = httpx.post(url + "/v1/completions", json={"model": "gqa", "prompt": "hi", "max_tokens": 4},
                                  timeout=60)
            results["queued"] = (response.status_code, response.json())

        workers = [threading.Thread(target=stream, args=("running",))]
        workers[0].start()
        time.sleep(1.0)  # the stream holds the only row
        workers += [threading.Thread(target=plain), threading.Thread(target=stream, args=("queued stream",))]
        for worker in workers[1:]:
            worker.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        for worker in workers:
            worker.join(timeout=60)
        err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 143 and "terminated" in err and "Traceback" not in err, err
    for name in ("running", "queued stream"):
        status, lines = results[name]
        events = _sse_events(lines)
        assert status == 200 and events[-1] == "[DONE]", (name, lines)
        last = json.loads(events[-2])
        assert "error" in last or last["choices"][0]["finish_reason"], (name, last)
    assert "error" in json.loads(_sse_events(results["running"][1])[-2])  # cut at the grace, with an error event
    status, body = results["queued"]
    assert status == 503 and body["error"]["type"] == "service_unavailable"
