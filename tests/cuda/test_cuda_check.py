"""The device check's own code (benchmarks/cuda_check.py) run on this CPU with the numpy references standing in for
the GPU (--dry-run, small shapes): every section runs and writes its record; proves the script, never the GPU."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from specdec.native import build

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cuda_check.py"


def test_the_device_check_runs_every_section_on_the_references(q41_pair, tmp_path):
    bundles = tmp_path / "bundles"
    shutil.copytree(q41_pair, bundles / "q41")
    skip = "distribution,peer" + (",parity" if build.missing_cpu_flags() else "")  # the χ² test has its own; torch
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), "--bundles", str(bundles),
                           "--dry-run", "--alpha", "0.9", "--rounds", "2", "--new-tokens", "12", "--skip", skip],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "record.json").read_text(encoding="utf-8"))
    results = record["results"]
    assert record["command"].startswith("python benchmarks/cuda_check.py") and record["failed"] == []
    assert results["kernels"]["linear q41 M=1"] == 0.0 and len(results["kernels"]) > 30  # the reference against itself
    assert results["exactness"]["q41"]["model"]["identical"] == 20 == results["exactness"]["q41"]["prompts"]
    assert set(results["latency"]["r"]) == {str(g) for g in range(1, 8)} and results["latency"]["predicted"]["gamma"]
    assert results["host"]["q41"]["rounds"] > 0
    assert "graphs vs eager" in (tmp_path / "out" / "summary.md").read_text(encoding="utf-8")
