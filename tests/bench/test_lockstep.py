"""benchmarks/lockstep.py without its peer (--peer-modes none) on a tiny bundle: every request runs, greedy output
is identical across specdec's modes, the pair table holds the specdec pairs (never timings)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pl = pytest.importorskip("polars")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lockstep.py"


def lockstep(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=900)


def test_specdec_modes_in_turn(int4_bundle, tmp_path):
    out = tmp_path / "lockstep"
    done = lockstep(int4_bundle, "--per-class", 1, "--new-tokens", 6, "--modes", "target-only,model,auto,model:2",
                    "--peer-modes", "none", "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    requests = pl.read_parquet(out / "requests.parquet")
    assert sorted(requests["mode"].unique().to_list()) == ["auto γ=3", "model γ=2", "model γ=3", "target-only"]
    prompts = requests["prompt_id"].n_unique()  # the shortest of each class that fits the tiny bundle's S
    assert prompts >= 2 and requests.height == 4 * prompts  # every mode on every prompt
    assert (requests["status"] == "ok").all() and requests["identical"].all()
    pairs = (out / "pairs.md").read_text(encoding="utf-8")
    assert f"| specdec model / specdec target-only | {prompts} |" in pairs
    assert f"| specdec auto / specdec target-only | {prompts} |" in pairs
    rounds = requests.filter(pl.col("mode") == "model γ=2")
    assert rounds["gamma"].unique().to_list() == [2]  # the item's own γ, not the bundle's
    assert "onnxruntime-genai" not in pairs
    record = json.loads((out / "record.json").read_text(encoding="utf-8"))
    assert len(record["git"]["commit"]) == 40 and record["command"].startswith("python benchmarks/lockstep.py")
    assert set(record["settings"]) == {"specdec"} and record["prompts"] == prompts


def test_unknown_peer_mode_is_refused(tmp_path):
    done = lockstep("no-bundle", "--peer-modes", "beam", "--out", tmp_path)
    assert done.returncode == 1
    assert "unknown peer mode 'beam'" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("modes", ["target-only,beam", "model:0", "model:x"])
def test_a_bad_mode_is_refused(modes, tmp_path):
    done = lockstep("no-bundle", "--modes", modes, "--peer-modes", "none", "--out", tmp_path)
    assert done.returncode != 0
    assert "is not DRAFTER[:γ]" in done.stderr and "Traceback" not in done.stderr
