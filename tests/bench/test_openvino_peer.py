"""benchmarks/peers/openvino_peer.py with OpenVINO absent: the settings (threads = cores, the latency config), the
worker's command line, the table row and the record's settings; lockstep's refusals and its record without the peer.
Where setup_openvino.sh has made its venv and int4 export (CI has not), a short lock-step run. Never timings
(benchmarks are not tests)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.peers import openvino_peer as ovp
from specdec.bench.table import COLUMNS

LOCKSTEP = Path(__file__).resolve().parents[2] / "benchmarks" / "lockstep.py"
needs_openvino = pytest.mark.skipif(
    not (ovp.installed() and (ovp.model_dir("int4") / "openvino_model.xml").is_file()),
    reason="OpenVINO GenAI's venv and int4 export are not there (benchmarks/peers/setup_openvino.sh)")


def lockstep(*args, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LOCKSTEP), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def test_settings_threads_and_the_latency_config(tmp_path):
    settings = ovp.Settings(tmp_path)
    config = settings.plugin_config()
    assert config["INFERENCE_NUM_THREADS"] == ovp.cores()  # threads = cores by default
    assert config["PERFORMANCE_HINT"] == "LATENCY" and config["NUM_STREAMS"] == "1"
    assert config["KV_CACHE_PRECISION"] == "u8" and config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == "32"
    assert ovp.Settings(tmp_path, threads=3).plugin_config()["INFERENCE_NUM_THREADS"] == 3
    assert settings.model == tmp_path / "models" / "openvino-int4" and settings.draft_model == settings.model
    assert ovp.Settings(tmp_path, "fp16").draft_model == tmp_path / "models" / "openvino-int4"
    for bad in (dict(precision="int3"), dict(modes=("beam",)), dict(modes=()), dict(threads=-1),
                dict(assistant_tokens=0), dict(max_ngram_size=0)):
        with pytest.raises(ValueError):
            ovp.Settings(tmp_path, **bad)


def test_modes_and_the_workers_command_line(tmp_path):
    settings = ovp.Settings(tmp_path, "fp16", ("plain", "draft", "lookup"), draft=tmp_path / "d",
                            assistant_tokens=4, max_ngram_size=2, ignore_eos=True)
    kinds = settings.kinds()
    assert list(kinds) == ["plain", "draft", "lookup"]
    assert [k.drafter for k in kinds.values()] == ["none", "model", "prompt_lookup"]
    assert [k.gamma for k in kinds.values()] == [0, 4, 4] and kinds["draft"].model == tmp_path / "d"
    names = [k.name for k in kinds.values()]  # the prefixes lockstep's pair table matches
    assert names[0] == "target-only" and names[1].startswith("draft ") and names[2].startswith("n-gram ")
    assert ovp.settings_from_args(settings.worker_args()) == settings
    assert ovp.settings_from_args(ovp.Settings(tmp_path).worker_args()) == ovp.Settings(tmp_path)
    command = settings.command()
    assert command[0] == str(tmp_path / "openvino" / "bin" / "python") and command[1].endswith("openvino_peer.py")
    assert not ovp.installed(tmp_path)


def test_row_in_the_tables_columns(tmp_path):
    prompt = {"id": "p1", "class": "code"}
    lookup = ovp.row(ovp.Lookup(), prompt, 0, [1, 2, 3], [5, 6, 7, 8, 9], 0.04, 0.12,
                     {"own_ttft_s": 0.03, "verify_passes": 2}, note="n")
    assert set(lookup) <= set(COLUMNS)
    assert lookup["system"] == ovp.SYSTEM and lookup["mode"] == ovp.Lookup().name and lookup["new_tokens"] == 5
    assert lookup["tpot_s"] == pytest.approx(0.02) and lookup["prefill_s"] == pytest.approx(0.03)  # 80 ms / 4
    assert lookup["mean_acceptance_length"] == pytest.approx(2.5) and lookup["acceptance_rate"] is None
    assert lookup["token_ids"] == [5, 6, 7, 8, 9] and lookup["prompt_tokens"] == 3 and lookup["note"] == "n"
    draft = ovp.row(ovp.Draft(tmp_path / "d", 3), prompt, 1, [1], [5, 6], 0.01, 0.02,
                    {"accepted": 3, "proposed": 4, "verify_passes": 1})
    assert draft["acceptance_rate"] == pytest.approx(0.75) and draft["gamma"] == 3 and draft["drafted_rounds"] == 1
    assert lookup["drafted_rounds"] is None  # prompt lookup does not count its proposals
    plain = ovp.row(ovp.Plain(), prompt, 0, [1], [5], 0.01, 0.01, {})
    assert plain["tpot_s"] == 0.0 and plain["verify_passes"] is None and plain["drafter"] == "none"
    failed = ovp.failed(ovp.Plain(), prompt, 0, "x" * 900)
    assert failed["status"] == "failed" and len(failed["note"]) == 400 and set(failed) <= set(COLUMNS)


def test_record_settings_from_the_workers_first_line(tmp_path):
    settings = ovp.Settings(tmp_path, "int4", ("plain", "lookup"), ignore_eos=True)
    notes = {name: kind.describe() | {"mode": kind.name} for name, kind in settings.kinds().items()}
    hello = {"ready": True, "notes": notes, "versions": {"openvino_genai": "9.9"},
             "in_effect": {"INFERENCE_PRECISION_HINT": "bf16", "KV_CACHE_PRECISION": "u8",
                           "DYNAMIC_QUANTIZATION_GROUP_SIZE": "32"}, "export": {"command": "optimum-cli ..."}}
    described = ovp.record_settings(settings, hello)
    assert described["system"] == ovp.SYSTEM and described["version"] == "9.9" and described["precision"] == "int4"
    assert described["inference_precision"] == "bf16" and described["kv_cache_precision"] == "u8"
    assert described["threads"] == ovp.cores() and described["ignore_eos"] is True
    assert described["modes"] == notes and described["export"]["command"].startswith("optimum-cli")
    assert "token agreement" in described["note"]
    assert described["model"] == "openvino-int4"  # outside the repository: its name only, never a machine's path
    json.dumps(described)  # goes into record.json as is


def test_lockstep_refuses_an_unknown_mode_or_precision(tmp_path):
    done = lockstep("no-bundle", "--peer-modes", "none", "--ov-modes", "beam", "--out", tmp_path)
    assert done.returncode == 1
    assert "mode 'beam' is not one of plain, draft, lookup" in done.stderr and "Traceback" not in done.stderr
    done = lockstep("no-bundle", "--peer-modes", "none", "--ov-modes", "plain", "--ov-precision", "int3")
    assert done.returncode == 2 and "invalid choice: 'int3'" in done.stderr


def test_lockstep_without_its_venv(tmp_path):
    done = lockstep("no-bundle", "--peer-modes", "none", "--ov-modes", "plain,lookup", "--peers-dir", tmp_path,
                    "--out", tmp_path / "out")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "benchmarks/peers/setup_openvino.sh" in done.stderr and "--ov-modes none" in done.stderr


def test_lockstep_record_without_the_peer(int4_bundle, tmp_path):
    out = tmp_path / "lockstep"
    done = lockstep(int4_bundle, "--per-class", 1, "--new-tokens", 3, "--modes", "target-only", "--peer-modes",
                    "none", "--ov-modes", "none", "--ignore-eos", "--out", out, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((out / "record.json").read_text(encoding="utf-8"))
    assert set(record["settings"]) == {"specdec"} and "--ov-modes none" in record["command"]
    assert ovp.SYSTEM not in (out / "pairs.md").read_text(encoding="utf-8")


@needs_openvino
def test_lockstep_with_ov_modes(int4_bundle, tmp_path):
    out = tmp_path / "lockstep"
    done = lockstep(int4_bundle, "--per-class", 1, "--new-tokens", 5, "--modes", "target-only", "--peer-modes",
                    "none", "--ov-modes", "plain,lookup", "--ignore-eos", "--out", out, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((out / "record.json").read_text(encoding="utf-8"))
    settings = record["settings"][ovp.SYSTEM]
    assert set(settings["modes"]) == {"plain", "lookup"} and settings["threads"] >= 1 and settings["ignore_eos"]
    assert settings["in_effect"]["PERFORMANCE_HINT"] == "LATENCY" and settings["inference_precision"] != "?"
    assert "nncf_bitwidth" in settings["export"] and settings["in_effect"]["INFERENCE_PRECISION_HINT"] in ("bf16", "f32")
    assert str(ovp.ROOT) not in json.dumps(record)  # no path of the machine that ran it
    summary = (out / "summary.md").read_text(encoding="utf-8")
    assert ovp.SYSTEM in summary and "failed" not in summary
    assert f"| {ovp.SYSTEM} target-only |" in (out / "pairs.md").read_text(encoding="utf-8")
