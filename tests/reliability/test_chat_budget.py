"""Chat templates on a budget in the library and the CLI, as in the server: `gen.generate/stream(..., chat=True)` and
`specdec generate --chat` render in the Generator's prompt worker (specdec.runtime.prompt_worker), so a template that
loops, builds a huge string or writes without end costs its request a SpecDecError with a hint, never a hang, a raw
MemoryError or a traceback; the next request gets a fresh worker."""
from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import threading
import time

import pytest

import specdec
from specdec import GenerationConfig
from specdec.chat_template import RENDER_MAX_BYTES, RenderLimitError, compile_chat_template, render_chat
from specdec.cli import main
from specdec.errors import BackendError
from specdec.manifest import sha256_file
from specdec.runtime.config import RequestCapacityError
from specdec.runtime.prompt_worker import Op, PromptBudget, PromptBudgetError, WorkerProcess

# One template, three ways to exhaust a process, chosen by the last message; anything else renders normally.
TEMPLATE = """{%- set text = messages[-1]['content'] -%}
{%- if text == 'grow' -%}{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}
{%- elif text == 'loop' -%}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}
{%- elif text == 'write' -%}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}
{%- endif -%}
<|im_start|>user
{{ text }}<|im_end|>
<|im_start|>assistant
"""
BUDGET = PromptBudget(timeout_s=1.5, memory_mb=256)
CHAT = GenerationConfig(max_new_tokens=2, chat=True)


@pytest.fixture(scope="module")
def greedy_bundle(gqa_int4_bundle, tmp_path_factory):
    """The tiny bundle with TEMPLATE as its chat template (its hash recorded, as a deliberately made bundle)."""
    bundle = tmp_path_factory.mktemp("greedy") / "bundle"
    shutil.copytree(gqa_int4_bundle, bundle)
    (bundle / "chat_template.jinja").write_text(TEMPLATE)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["tokenizer"]["files"]["chat_template.jinja"] = sha256_file(bundle / "chat_template.jinja")
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    return bundle


@pytest.fixture(scope="module")
def gen(greedy_bundle):
    with specdec.load(greedy_bundle, backend="onnxruntime", prompt_budget=BUDGET) as generator:
        yield generator


def test_a_looping_template_costs_its_request_the_timeout(gen):
    for call in (lambda: gen.generate("loop", CHAT), lambda: list(gen.stream("loop", CHAT))):
        with pytest.raises(PromptBudgetError, match="more than the prompt workers' 1.5 s") as info:
            call()
        assert "--prompt-timeout" in info.value.hint and "prompt_budget" in info.value.hint
    assert gen.generate("hi", CHAT).token_ids  # a fresh worker took the killed one's place


def test_a_growing_template_costs_its_request_the_memory(gen):
    with pytest.raises(PromptBudgetError, match="more than the prompt workers' 256 MB") as info:
        gen.generate("grow", CHAT)
    assert "--prompt-worker-memory" in info.value.hint
    assert gen.generate("hi", CHAT).token_ids


def test_a_template_that_writes_past_s_is_refused_by_its_bytes(gen):
    with pytest.raises(RequestCapacityError, match="grew past .* bytes") as info:
        gen.generate("write", CHAT)
    assert info.value.hint and info.value.public.startswith("the prompt is longer than this model's context")


def test_the_rendered_size_is_bounded_in_bytes_once():
    template = compile_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    messages = [{"role": "user", "content": "é" * 6}]  # 6 characters, 12 bytes
    assert render_chat(template, messages, {}, max_bytes=12) == "é" * 6
    with pytest.raises(RenderLimitError, match="grew past 11 bytes of UTF-8") as info:
        render_chat(template, messages, {}, max_bytes=11)
    assert info.value.limit == 11 and info.value.hint
    assert RENDER_MAX_BYTES == 8 << 20


def test_close_kills_the_worker(greedy_bundle):
    generator = specdec.load(greedy_bundle, backend="onnxruntime")
    assert generator.generate("hi", CHAT).token_ids
    process = generator.prompt_worker._worker.process
    generator.close()
    assert process.poll() is not None
    with pytest.raises(BackendError, match="closed"):
        generator.prompt_worker.chat_ids([{"role": "user", "content": "hi"}])


def test_a_worker_stopped_mid_render_keeps_its_pipe_until_the_waiting_thread_lets_go(greedy_bundle):
    """A server's shutdown stops workers from its own thread while request threads wait on their pipes. The pipe is
    closed once, by the last thread to let go: closed under a waiting thread, its descriptor's number could be reused
    by a file opened meanwhile (CI saw the double close as EBADF)."""
    worker = WorkerProcess(greedy_bundle, 256 << 20)
    worker.ready()
    outcome = []
    waiting = threading.Thread(target=lambda: outcome.append(_failure(
        lambda: worker.exchange((Op.CHAT, [{"role": "user", "content": "loop"}], None), 60))))
    waiting.start()
    deadline = time.monotonic() + 10
    while worker._users == 0 and time.monotonic() < deadline:  # the request thread holds the pipe
        time.sleep(0.01)
    assert worker._users == 1
    stopped = []
    stoppers = [threading.Thread(target=lambda: stopped.append(_failure(worker.kill))) for _ in range(8)]  # at once
    for stopper in stoppers:
        stopper.start()
    for stopper in stoppers:
        stopper.join()
    assert stopped == [None] * 8
    waiting.join(10)
    assert not waiting.is_alive() and worker.conn.closed and worker.process.poll() is not None
    assert isinstance(outcome[0], PromptBudgetError) and "died" in str(outcome[0])
    with pytest.raises(PromptBudgetError, match="was stopped"):
        worker.exchange((Op.TEXT, "hi", None), 1)
    worker.stop()  # once more: nothing left to close


def _failure(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc
    return None


@pytest.mark.parametrize("text, message", [("loop", "more than the prompt workers' 1 s"),
                                           ("grow", "more than the prompt workers' 256 MB")])
def test_generate_chat_cli_is_bounded_and_prints_no_traceback(greedy_bundle, capsys, text, message):
    argv = ["generate", str(greedy_bundle), "--prompt", text, "--chat", "--max-new-tokens", "2",
            "--backend", "onnxruntime", "--prompt-timeout", "1", "--prompt-worker-memory", "256"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "Hint:" in err and "Traceback" not in err, err


def _address_space(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS as `ulimit -v` sets it")
def test_generate_chat_under_a_4_gb_address_space_is_a_message(greedy_bundle):
    """The report's case: `ulimit -v 4000000; specdec generate --chat` with a growing template ended in a raw
    MemoryError traceback. The worker's data limit (1024 MB by default) is reached first, in the worker."""
    command = [sys.executable, "-m", "specdec.cli", "generate", str(greedy_bundle), "--prompt", "grow", "--chat",
               "--backend", "onnxruntime", "--prompt-timeout", "240"]  # time enough that memory is what stops it,
    # on a loaded machine too
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          preexec_fn=_address_space(4_000_000 << 10))
    assert done.returncode == 1, done.stderr
    assert "more than the prompt workers' 1024 MB" in done.stderr and "Hint:" in done.stderr
    assert "Traceback" not in done.stderr and "MemoryError" not in done.stderr, done.stderr


def test_generate_refuses_a_budget_this_machine_cannot_give(greedy_bundle, capsys):
    for flag, value, message in (("--prompt-timeout", "0", "prompt timeout_s must be a number of seconds in (0, 3600"),
                                 ("--prompt-timeout", "nan", "got nan"),
                                 ("--prompt-worker-memory", str(1 << 40), "prompt worker memory_mb must be an integer")):
        assert main(["generate", str(greedy_bundle), "--prompt", "hi", "--chat", flag, value]) == 1
        err = capsys.readouterr().err
        assert message in err and "Hint:" in err and "Traceback" not in err, err
