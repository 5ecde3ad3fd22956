"""benchmarks/peers/llamacpp_peer.py: the llama-server flags of each setting, the request body, the table row and
the run record's fields; where setup_llamacpp.sh has built llama.cpp (CI does not), one tiny request against a
server on 127.0.0.1 and a short lock-step run. Never timings (benchmarks are not tests)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.peers import llamacpp_peer as lc
from specdec.bench.table import COLUMNS

LOCKSTEP = Path(__file__).resolve().parents[2] / "benchmarks" / "lockstep.py"
needs_build = pytest.mark.skipif(not lc.built(), reason="llama.cpp is not built (benchmarks/peers/setup_llamacpp.sh)")


def flag(args: list, name: str) -> str:
    return args[args.index(name) + 1]


def test_server_flags_threads_slots_and_context():
    args = lc.ServerSettings(Path("m.gguf"), threads=3, parallel=4, ctx_per_slot=512).args(8080)
    assert flag(args, "-m") == "m.gguf" and flag(args, "--host") == "127.0.0.1" and flag(args, "--port") == "8080"
    assert flag(args, "-t") == flag(args, "-tb") == "3" and flag(args, "-np") == "4" and flag(args, "-c") == "2048"
    assert "-cb" in args and "--spec-type" not in args
    assert flag(lc.ServerSettings(Path("m.gguf")).args(1), "-t") == str(lc.cores())  # threads = cores by default
    with pytest.raises(ValueError):
        lc.ServerSettings(Path("m.gguf"), parallel=0)


def test_speculation_flags():
    simple = lc.NGram("ngram-simple", size_n=3, size_m=4).args()
    assert flag(simple, "--spec-type") == "ngram-simple" and flag(simple, "--spec-ngram-simple-size-n") == "3"
    assert flag(simple, "--spec-ngram-simple-size-m") == "4" and flag(simple, "--spec-ngram-simple-min-hits") == "1"
    assert flag(lc.NGram("ngram-map-k", 2, 8).args(), "--spec-ngram-map-k-size-m") == "8"
    mod = lc.NGramMod(8, 2, 8).args()
    assert flag(mod, "--spec-type") == "ngram-mod" and flag(mod, "--spec-ngram-mod-n-match") == "8"
    draft = lc.Draft(Path("d.gguf"), n_max=5).args()
    assert flag(draft, "--spec-type") == "draft-simple" and flag(draft, "-md") == "d.gguf"
    assert flag(draft, "--spec-draft-n-max") == "5" and flag(draft, "--spec-draft-n-min") == "0"
    names = [lc.Plain().name, lc.BEST_NGRAM.name, lc.Draft(Path("d.gguf")).name]
    assert names[0] == "target-only" and names[1].startswith("n-gram ") and names[2].startswith("draft ")
    assert [k.drafter for k in (lc.Plain(), lc.BEST_NGRAM, lc.Draft(Path("d.gguf")))] == [
        "none", "prompt_lookup", "model"]


def test_ngram_from_text():
    assert lc.ngram_from_text("ngram-simple:3:8") == lc.NGram("ngram-simple", 3, 8)
    for bad in ("ngram-mod:3:8", "ngram-simple:3", "ngram-simple:0:4", "ngram-simple:a:4"):
        with pytest.raises(ValueError, match="KIND:N:M"):
            lc.ngram_from_text(bad)


def test_record_settings_and_request_body():
    settings = lc.ServerSettings(Path("/x/m.gguf"), lc.Draft(Path("/x/d.gguf"), n_max=4), threads=2, parallel=2)
    described = settings.describe()
    assert described["system"] == "llama.cpp" and described["model"] == "m.gguf" and described["threads"] == 2
    assert described["parallel_slots"] == 2 and described["continuous_batching"] is True
    assert described["spec_type"] == "draft-simple" and described["draft_model"] == "d.gguf"
    assert described["n_max"] == 4 and "version" in described and "PORT" in described["flags"]
    assert not any(str(flag).startswith("/") for flag in described["flags"])  # no path of the machine that ran it
    json.dumps(described)  # goes into record.json as is
    body = lc.completion_body([1, 2, 3], 16)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 16 and body["temperature"] == 0.0
    assert body["top_k"] == 1 and body["ignore_eos"] is True and body["cache_prompt"] is False
    assert body["return_tokens"] is True and lc.completion_body("hi", 2, ignore_eos=False)["ignore_eos"] is False


def test_completion_and_row_from_the_servers_timings():
    answer = {"tokens": [5, 6, 7, 8, 9], "timings": {"prompt_ms": 40.0, "predicted_ms": 80.0, "prompt_n": 3,
                                                     "predicted_n": 5, "draft_n": 6, "draft_n_accepted": 3}}
    done = lc.completion_from_response(answer, wall=0.15)
    assert done.tokens == [5, 6, 7, 8, 9] and done.wall_s == 0.15
    assert done.ttft_s == pytest.approx(0.04) and done.tpot_s == pytest.approx(0.02)  # 80 ms over 4 tokens
    assert done.e2e_s == pytest.approx(0.12)
    settings = lc.ServerSettings(Path("m.gguf"), lc.BEST_NGRAM)
    row = lc.record(settings, done, "p1", "code", 0, [1, 2, 3])
    assert set(row) <= set(COLUMNS)
    assert row["system"] == "llama.cpp" and row["mode"] == lc.BEST_NGRAM.name and row["new_tokens"] == 5
    assert row["tpot_s"] == pytest.approx(0.02) and row["acceptance_rate"] == pytest.approx(0.5)
    assert row["prompt_tokens"] == 3 and row["token_ids"] == [5, 6, 7, 8, 9]


def test_lockstep_refuses_an_unknown_llama_mode(tmp_path):
    done = subprocess.run([sys.executable, str(LOCKSTEP), "no-bundle", "--peer-modes", "none", "--llama-modes",
                           "beam", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "unknown llama.cpp mode 'beam'" in done.stderr and "Traceback" not in done.stderr


@needs_build
def test_one_request_against_a_live_server():
    settings = lc.ServerSettings(lc.default_gguf(), lc.NGram("ngram-simple", 2, 3), ctx_per_slot=256)
    with lc.LlamaServer(settings, max_s=120, start_s=60) as server:
        done = server.complete([1, 2, 3, 4], 6, timeout=60)
        process = server.process
    assert len(done.tokens) == 6 and done.ttft_s > 0 and done.e2e_s >= done.ttft_s
    assert done.timings["prompt_n"] == 4 and done.timings.get("cache_n", 0) == 0
    assert process.poll() is not None  # the server ended with its context


@needs_build
def test_lockstep_with_llama_modes(int4_bundle, tmp_path):
    out = tmp_path / "lockstep"
    done = subprocess.run([sys.executable, str(LOCKSTEP), str(int4_bundle), "--per-class", "1", "--new-tokens", "5",
                           "--modes", "target-only", "--peer-modes", "none", "--llama-modes", "plain,ngram",
                           "--ignore-eos", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((out / "record.json").read_text(encoding="utf-8"))
    modes = record["settings"]["llama.cpp"]["modes"]
    assert set(modes) == {"plain", "ngram"} and modes["plain"]["threads"] >= 1 and record["ignore_eos"] is True
    text = (out / "summary.md").read_text(encoding="utf-8")
    assert "llama.cpp" in text and "greedy output vs specdec target-only" in (out / "pairs.md").read_text()


@needs_build
def test_llamacpp_sweep(int4_bundle, tmp_path):
    out = tmp_path / "sweep"
    done = subprocess.run([sys.executable, "-m", "benchmarks.peers.llamacpp_sweep", str(int4_bundle), "--per-class",
                           "1", "--new-tokens", "4", "--repeats", "1", "--pause", "0", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=LOCKSTEP.parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((out / "record.json").read_text(encoding="utf-8"))
    assert len(record["git"]["commit"]) == 40 and record["finished"]
    text = (out / "sweep.md").read_text(encoding="utf-8")
    assert "ngram-simple" in text and "| draft SmolLM2" in text
    assert len([line for line in text.splitlines() if line.startswith("| ")]) == 1 + 9  # the header, 9 modes
    assert len((out / "requests.csv").read_text(encoding="utf-8").splitlines()) > 1
