"""benchmarks/step.py --roles head: a bundle's draft head timed as a model (a chain step at T = 1, a catch-up of T
positions above), set against the target's decode step of the same rounds. Never timings: what the tables hold."""
from __future__ import annotations

import pytest

from specdec.native import build
from tests.bench.test_entry_points import read_record, run_script

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA, F16C")


def test_step_times_the_head_against_the_target_step(random_head_bundle, tmp_path):
    out = tmp_path / "step"
    run_script("step.py", random_head_bundle, "--backends", "native", "--roles", "target,head", "--cases",
               "1@8,3@8,2@20", "--rounds", "2", "--out", out)
    text = (out / "step.md").read_text(encoding="utf-8")
    assert "(native) head |" in text and "The head against the target's decode step" in text
    ratios = read_record(out, "step.py")["head"]
    assert [(r["tokens"], r["cache_len"]) for r in ratios] == [(1, 8), (3, 8)]  # no target step at 20: no ratio
    assert all(0 < r["head_over_step_min"] < float("inf") and r["head_over_step_median"] > 0 for r in ratios)


def test_step_refuses_an_unknown_role(random_head_bundle, tmp_path):
    import subprocess
    import sys

    from tests.bench.test_entry_points import BENCH

    done = subprocess.run([sys.executable, str(BENCH / "step.py"), str(random_head_bundle), "--roles", "heads",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "unknown role in 'heads'" in done.stderr and "Traceback" not in done.stderr
