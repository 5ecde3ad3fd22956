"""Safe direct use of a Generator: concurrent callers, interleaved and suspended streams, stop strings in streams,
reproducible seeds, EOS inside an accepted run, use after close; and exports that die or are stopped."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import specdec
from specdec import GenerationConfig
from specdec.cli import main
from specdec import publish
from specdec.errors import BackendError, Terminated
from specdec.publish import remove_stale_leftovers, staged_bundle

PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time", "a + b\n", "Summarize the following text"]


@pytest.fixture(scope="module")
def gen(gqa_int4_bundle):
    with specdec.load(gqa_int4_bundle) as generator:
        yield generator


def _greedy(gen, prompt, drafter="auto", tokens=16):
    return gen.generate(prompt, GenerationConfig(max_new_tokens=tokens, drafter=drafter)).token_ids


def test_eight_threads_share_one_generator(gen):
    expected = {p: _greedy(gen, p) for p in PROMPTS}
    results, errors = [], []

    def worker(index):
        try:
            for k in range(5):
                prompt = PROMPTS[(index + k) % len(PROMPTS)]
                results.append((prompt, _greedy(gen, prompt)))
        except Exception as exc:  # noqa: BLE001 - any failure of a worker fails the test below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors and len(results) == 40
    assert all(tokens == expected[prompt] for prompt, tokens in results)


def test_interleaved_streams_in_one_thread_stay_correct(gen):
    config = GenerationConfig(max_new_tokens=20, drafter="model")
    a, b = gen.generate(PROMPTS[0], config).text, gen.generate(PROMPTS[2], config).text
    pieces_a, pieces_b = [], []
    for piece_a, piece_b in zip(gen.stream(PROMPTS[0], config), gen.stream(PROMPTS[2], config)):
        pieces_a.append(piece_a)
        pieces_b.append(piece_b)
    stream_a = gen.stream(PROMPTS[0], config)
    first = next(stream_a)
    assert gen.generate(PROMPTS[3], config).token_ids  # another request uses the models meanwhile
    assert first + "".join(stream_a) == a  # the suspended stream re-prefills its own tokens and goes on
    assert "".join(pieces_a) == a[: len("".join(pieces_a))] and "".join(pieces_b) == b[: len("".join(pieces_b))]


def _stop_cases(gen):
    full = gen.generate(PROMPTS[2], GenerationConfig(max_new_tokens=30, eos_token_ids=(), drafter="model")).text
    middle = len(full) // 2
    return full, [full[middle : middle + 3], full[middle : middle + 1], full[5:14], "never appears"]


@pytest.mark.parametrize("drafter", ["model", "none", "auto"])
def test_streamed_text_equals_generate_for_every_stop(gen, drafter):
    full, stops = _stop_cases(gen)
    for stop in stops:
        config = GenerationConfig(max_new_tokens=30, eos_token_ids=(), drafter=drafter, gamma=4, stop=stop)
        expected = gen.generate(PROMPTS[2], config)
        streamed = list(gen.stream(PROMPTS[2], config))
        assert "".join(streamed) == expected.text, (stop, streamed)
        if stop in full:
            assert expected.finish_reason == "stop" and expected.text == full[: full.index(stop)]
        shown = ""
        for piece in streamed:  # no prefix of what is shown ever ends inside the stop string
            shown += piece
            assert stop not in shown


def test_generate_cli_prints_nothing_past_the_stop(gqa_int4_bundle, capsys, gen):
    full, stops = _stop_cases(gen)
    stop = stops[0]
    assert main(["generate", str(gqa_int4_bundle), "--prompt", PROMPTS[2], "--max-new-tokens", "30",
                 "--drafter", "model", "--stop", stop]) == 0
    assert capsys.readouterr().out == full[: full.index(stop)] + "\n"


def test_stop_given_as_one_string_is_one_stop_string():
    assert GenerationConfig(stop="abc").stop == ("abc",)


DRAFTERS = ["model", "prompt_lookup", "auto", "none"]
POLICIES = ["fixed", "adaptive", "heuristic"]


def _sampled(gen, drafter, policy, seed=11):
    config = GenerationConfig(max_new_tokens=24, temperature=0.9, top_k=20, seed=seed, drafter=drafter,
                              gamma_policy=policy)
    return gen.generate(PROMPTS[0], config).token_ids


def test_the_same_seed_gives_the_same_tokens_on_a_reused_generator(gen):
    first = {(d, p): _sampled(gen, d, p) for d in DRAFTERS for p in POLICIES}
    for prompt in PROMPTS:  # other requests, greedy and sampled, teach the shared gate and move every clock
        _greedy(gen, prompt)
        gen.generate(prompt, GenerationConfig(max_new_tokens=12, temperature=1.0, seed=5))
    assert {(d, p): _sampled(gen, d, p) for d in DRAFTERS for p in POLICIES} == first


def test_the_same_seed_gives_the_same_tokens_in_fresh_processes(gen, gqa_int4_bundle):
    code = (
        "import json, sys, specdec\n"
        "from specdec import GenerationConfig\n"
        f"g = specdec.load({str(gqa_int4_bundle)!r})\n"
        "out = {}\n"
        f"for d in {DRAFTERS!r}:\n"
        f"    for p in {POLICIES!r}:\n"
        "        c = GenerationConfig(max_new_tokens=24, temperature=0.9, top_k=20, seed=11, drafter=d, gamma_policy=p)\n"
        f"        out[d + '/' + p] = g.generate({PROMPTS[0]!r}, c).token_ids\n"
        "print(json.dumps(out))\n"
    )
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, PYTHONPATH=os.getcwd())) for _ in range(2)]
    assert all(run.returncode == 0 for run in runs), runs[0].stderr
    outputs = [json.loads(run.stdout) for run in runs]
    assert outputs[0] == outputs[1]
    assert outputs[0] == {f"{d}/{p}": _sampled(gen, d, p) for d in DRAFTERS for p in POLICIES}


def test_an_eos_inside_an_accepted_run_ends_the_row_there(gen):
    plain = gen.generate(PROMPTS[0], GenerationConfig(max_new_tokens=24, drafter="none", eos_token_ids=()))
    eos = plain.token_ids[5]
    cut = plain.token_ids[: plain.token_ids.index(eos) + 1]
    for gamma in (2, 4, 6):
        result = gen.generate(PROMPTS[0], GenerationConfig(max_new_tokens=24, drafter="model", gamma=gamma,
                                                           eos_token_ids=(eos,)))
        assert result.token_ids == cut and result.finish_reason == "eos"
        assert result.stats.accepted > 0  # drafts were accepted, so the EOS sat inside an accepted run


def test_use_after_close_is_a_clear_error(gqa_int4_bundle):
    generator = specdec.load(gqa_int4_bundle)
    stream = generator.stream(PROMPTS[0], GenerationConfig(max_new_tokens=12))
    next(stream)
    generator.close()
    generator.close()  # twice is harmless
    with pytest.raises(BackendError, match="closed") as info:
        generator.generate("x")
    assert "specdec.load" in info.value.hint
    with pytest.raises(BackendError, match="closed"):
        next(stream)


def test_stale_partials_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    stale = tmp_path / f".b.{pid}-abc.partial"
    stale.mkdir()
    (stale / "model.onnx").write_bytes(b"x" * 1000)
    live = tmp_path / f".b.{os.getpid()}-def.partial"  # this process is alive: its partial stays
    live.mkdir()
    other = tmp_path / f".c.{pid}-abc.partial"  # another bundle's leftovers are not ours to judge
    other.mkdir()
    assert remove_stale_leftovers(tmp_path, "b") == [stale]
    assert not stale.exists() and live.exists() and other.exists()


def _partials(folder: Path) -> list:
    return [p for p in folder.iterdir() if p.name.startswith(".o.")]


def test_sigterm_during_an_export_leaves_nothing(tmp_path, tiny_llama):
    args = [sys.executable, "-m", "specdec.cli", "export", "--target", str(tiny_llama), "--out", str(tmp_path / "o"),
            "--max-seq-len", "64"]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    deadline = time.monotonic() + 120
    while not _partials(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _partials(tmp_path), "the export never started staging"
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1].decode()
    assert proc.returncode == 143 and "terminated" in err and "Traceback" not in err, err
    assert _partials(tmp_path) == [] and not (tmp_path / "o").exists()


def test_a_swallowed_termination_still_publishes_nothing(tmp_path, monkeypatch):
    """Third-party code may catch the Terminated a SIGTERM raises; the flag set beside it still stops publication."""
    monkeypatch.setattr(publish, "_STOPPING", threading.Event())
    out = tmp_path / "o"
    with staged_bundle(out) as stage:
        (stage / "manifest.json").write_text("{}")
    assert out.exists()  # control: without the flag the staged bundle is published
    publish.stop_publishing()
    with pytest.raises(Terminated), staged_bundle(tmp_path / "p") as stage:
        (stage / "manifest.json").write_text("{}")
    assert not (tmp_path / "p").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".p.")]


def test_a_killed_exports_partial_is_removed_by_the_next_export(tmp_path, tiny_llama):
    args = [sys.executable, "-m", "specdec.cli", "export", "--target", str(tiny_llama), "--out", str(tmp_path / "o"),
            "--max-seq-len", "64", "--skip-parity"]
    proc = subprocess.Popen(args, stderr=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    deadline = time.monotonic() + 120
    while not _partials(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.kill()
    proc.wait(timeout=60)
    left = _partials(tmp_path)
    assert left, "kill -9 leaves the partial behind (nothing can clean up)"
    again = subprocess.run(args, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert again.returncode == 0, again.stderr
    assert _partials(tmp_path) == [] and (tmp_path / "o" / "manifest.json").is_file()
    assert "left behind by process" in again.stderr  # the user is told what was removed


def test_a_termination_a_library_rewraps_still_ends_as_terminated(monkeypatch, capsys):
    """A SIGTERM during transformers' lazy import came out as its ModuleNotFoundError (a flaky CI run): the stop flag
    set beside the Terminated still makes the command end as terminated, with no traceback."""
    cli = importlib.import_module("specdec.cli.main")  # the module (specdec.cli.main is also its function's name)
    monkeypatch.setattr(publish, "_STOPPING", threading.Event())

    def rewrapped(args):
        publish.stop_publishing()  # what the SIGTERM handler does before it raises Terminated
        raise ModuleNotFoundError("Could not import module 'LlamaForCausalLM'")

    parser = argparse.ArgumentParser()
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.set_defaults(run=rewrapped)
    assert cli._dispatch(parser, []) == 143
    assert "terminated" in capsys.readouterr().err
    monkeypatch.setattr(publish, "_STOPPING", threading.Event())  # control: with no termination the error stays

    def failing(args):
        raise ModuleNotFoundError("Could not import module 'LlamaForCausalLM'")

    parser.set_defaults(run=failing)
    with pytest.raises(ModuleNotFoundError):
        cli._dispatch(parser, [])
