"""benchmarks/harness: the interleaved timer's order and statistics, request timing, the run record's fields and
folder, the tail every entry point ends with, and the native settings a bundle opens with."""
from __future__ import annotations

import json
import math
import os
import subprocess

import pytest

from benchmarks.harness import record, tables, timer


def test_rotation_and_interleaving_order():
    assert timer.rotated([1, 2, 3], 1) == [2, 3, 1] and timer.rotated([1, 2, 3], 4) == [2, 3, 1]
    assert timer.rotated([], 3) == []
    calls = []
    ticks = iter(range(1000))
    samples = timer.interleave({k: (lambda k=k: calls.append(k)) for k in "abc"}, rounds=3, warmup=1, calls=2,
                               clock=lambda: next(ticks))
    assert calls[:3] == ["a", "b", "c"]  # the warm-up, not recorded
    assert calls[3:] == ["a", "a", "b", "b", "c", "c", "b", "b", "c", "c", "a", "a", "c", "c", "a", "a", "b", "b"]
    assert {k: len(v) for k, v in samples.items()} == {"a": 6, "b": 6, "c": 6}
    assert all(s == 1 for v in samples.values() for s in v)  # one clock tick per call
    with pytest.raises(ValueError):
        timer.interleave({"a": lambda: None}, rounds=0)
    reported = timer.interleave({"a": lambda: 0.25, "b": lambda: 2}, rounds=2, warmup=0, reported=True)
    assert reported == {"a": [0.25, 0.25], "b": [2.0, 2.0]}  # the seconds each call measured itself


def test_spread():
    spread = timer.summarize([0.004, 0.002, 0.003])
    assert (spread.n, spread.min, spread.median, spread.max) == (3, 0.002, 0.003, 0.004)
    assert spread.spread == pytest.approx(1.0) and spread.ms() == "2.0 / 3.0"
    with pytest.raises(ValueError):
        timer.summarize([])


def test_run_record_names_commit_machine_settings_and_command(tmp_path):
    run = record.run_record("exp", {"specdec": {"backend": "onnxruntime"}}, 2, "benchmarks/step.py", ["B", "--x", "1"])
    assert run["git"]["commit"] and len(run["git"]["commit"]) == 40 and run["git"]["dirty"] in (True, False)
    assert run["command"] == "python benchmarks/step.py B --x 1"
    cpu = run["machine"]["cpu"]
    assert cpu["model"] and cpu["logical_cpus"] >= 1 and cpu["usable_cpus"] >= 1 and isinstance(cpu["flags"], list)
    assert run["machine"]["threads"] == 2 and "numpy" in run["packages"]
    assert run["settings"] == {"specdec": {"backend": "onnxruntime"}}
    folder = record.run_dir("exp", run, tmp_path / "out")
    record.write_record(folder, run, result={"x": 1})
    back = record.read_record(folder)
    assert back["result"] == {"x": 1} and back["finished"] and back["experiment"] == "exp"
    assert record.RESULTS == record.ROOT / "benchmarks" / "results"


def test_a_second_run_at_one_commit_gets_a_folder_of_its_own(tmp_path):
    run = {"date": "2026-12-03", "git": {"short": "abc1234", "dirty": False}}
    first = record.run_dir("exp", run, results=tmp_path)
    assert first == tmp_path / "exp" / "2026-12-03-abc1234"
    assert record.run_dir("exp", run, results=tmp_path) == first  # no run there yet: the same folder
    record.write_record(first, run)
    second = record.run_dir("exp", run, results=tmp_path)
    record.write_record(second, run)
    assert second.name == "2026-12-03-abc1234-2" and record.run_dir("exp", run, results=tmp_path).name.endswith("-3")
    assert record.read_record(first) and record.read_record(second)


def test_tables(tmp_path):
    assert tables.markdown(["a", "b"], [[1, "x"]]) == "| a | b |\n|---|---|\n| 1 | x |\n"
    path = tables.write_csv(tmp_path / "t.csv", [{"a": 1, "b": 2}])
    assert path.read_text().splitlines() == ["a,b", "1,2"]


def test_every_committed_run_has_a_record_naming_its_commit():
    results = record.RESULTS
    runs = [p for p in results.glob("*/*") if p.is_dir()]
    assert runs
    for run in runs:
        data = json.loads((run / record.RECORD).read_text(encoding="utf-8"))
        # the folder names the experiment, or the experiment and a qualifier (lockstep-openvino: lockstep runs kept
        # apart from the newest of each bundle that docs/performance.md shows)
        assert run.parent.name == data["experiment"] or run.parent.name.startswith(data["experiment"] + "-")
        assert run.name.startswith(data["date"]) and data["git"]["short"] in run.name
        assert data["command"] and data["machine"]["cpu"]["model"]
    tracked = subprocess.run(["git", "-C", str(record.ROOT), "ls-files", "benchmarks/results"], capture_output=True,
                             text=True).stdout.split()
    assert not [f for f in tracked if f.endswith(".parquet")]  # one format per table: markdown, CSV for data


def test_finish_writes_the_tables_the_record_and_says_where(tmp_path, capsys):
    run = record.run_record("exp", {"specdec": {"backend": "onnxruntime"}}, None, "benchmarks/x.py", [])
    folder = record.finish(run, tmp_path / "out", {"t.md": "| a |\n|---|\n| 1 |", "t.csv": [{"a": 1, "b": 2}]},
                           shown="the table", result={"x": 1})
    assert folder == tmp_path / "out"
    assert (folder / "t.md").read_text() == "| a |\n|---|\n| 1 |\n" and (folder / "t.csv").read_text().split() == \
        ["a,b", "1,2"]
    back = record.read_record(folder)
    assert back["result"] == {"x": 1} and back["finished"] and back["experiment"] == "exp"
    assert capsys.readouterr().out == f"the table\nwritten: {folder}\n"


def test_request_timing():
    ticks = iter([10.0, 11.0])
    assert timer.timed(lambda: "got", clock=lambda: next(ticks)) == ("got", 1.0)
    ticks = iter([0.0, 0.5, 0.7, 1.1, 1.2])  # sent, three pieces, the end
    with timer.Request(clock=lambda: next(ticks)) as clock:
        for _ in range(3):
            clock.arrived()
    assert clock.times(5) == pytest.approx({"e2e_s": 1.2, "ttft_s": 0.5, "tpot_s": 0.6 / 4})
    ticks = iter([0.0, 2.0])
    with timer.Request(clock=lambda: next(ticks)) as silent:  # nothing came: TTFT is the whole request
        pass
    times = silent.times(0)
    assert times["e2e_s"] == times["ttft_s"] == 2.0 and math.isnan(times["tpot_s"])
    requests = [{"e2e_s": 1.0, "ttft_s": 0.2, "new_tokens": 5}, {"e2e_s": 0.5, "ttft_s": 0.1, "new_tokens": 3}]
    assert timer.token_weighted_tpot(requests) == pytest.approx(1.2 / 6)  # (0.8 + 0.4) s over 4 + 2 tokens
    assert math.isnan(timer.token_weighted_tpot([{"e2e_s": 1.0, "ttft_s": 1.0, "new_tokens": 1}]))  # none after


def test_compared_cells():
    a, b = timer.summarize([0.002, 0.004]), timer.summarize([0.004, 0.004])
    assert timer.compared(a, b) == ["2.00 / 3.00", "4.00 / 4.00", "0.500", "0.750"]


def test_native_env_sets_and_restores_the_native_settings(monkeypatch):
    from specdec.native import build
    from specdec.runtime.native_backend import PAGES_ENV

    from benchmarks.harness import opening

    monkeypatch.delenv(build.ISA_ENV, raising=False)
    monkeypatch.setenv(PAGES_ENV, "private")
    with opening.native_env(pages="shared", isa="avx2"):
        assert build.isa() == "avx2" and os.environ[PAGES_ENV] == "shared"
        assert "-mavx512f" not in build.build_flags()
    assert build.ISA_ENV not in os.environ and os.environ[PAGES_ENV] == "private"
    with opening.native_env():  # None: as this process has them
        assert os.environ[PAGES_ENV] == "private"


def test_a_command_holds_no_absolute_path_of_this_machine(tmp_path):
    """An absolute path among a command's arguments is written relative to the repository where it lies inside it,
    else by its name alone; other arguments as given."""
    inside = record.ROOT / "bundles" / "smollm2-q41"
    got = record.command_line(str(record.ROOT / "benchmarks" / "tree_ab.py"),
                              [str(inside), str(tmp_path / "old"), "bundles/x", "--rounds", "6"])
    assert got == "python benchmarks/tree_ab.py bundles/smollm2-q41 old bundles/x --rounds 6"
