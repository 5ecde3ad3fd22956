"""The native engine's benchmark entry points, run as a user runs them, on the tiny Q4_1 bundle for seconds: each
exits 0 and writes its table and a run record. Never timings (benchmarks are not tests)."""
from __future__ import annotations

import pytest

from specdec.native import build
from tests.bench.test_entry_points import read_record, run_script

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")


def test_native_ab_against_a_folder_of_sources(q41_bundle, tmp_path):
    out = tmp_path / "ab"
    run_script("native_ab.py", q41_bundle, build.HERE, "--rounds", "2", "--tokens", "5", "--rows", "2", "--out", out)
    text = (out / "native_ab.md").read_text(encoding="utf-8")
    assert "| 64 |" in text and "new / old (min)" in text
    read_record(out, "native_ab.py")


def test_open_cost(q41_bundle, tmp_path):
    out = tmp_path / "open"
    run_script("open_cost.py", q41_bundle, "--rounds", "1", "--out", out)
    text = (out / "open_cost.md").read_text(encoding="utf-8")
    assert "| native (native) |" in text and "| onnxruntime (onnxruntime) |" in text
    assert set(read_record(out, "open_cost.py")["results"]) == {"onnxruntime", "native"}


def test_rows(q41_bundle, tmp_path):
    out = tmp_path / "rows"
    run_script("rows.py", q41_bundle, "--rows", "3", "--rounds", "2", "--lengths", "10,40", "--out", out)
    text = (out / "rows.md").read_text(encoding="utf-8")
    assert "| native (native) target |" in text and "| onnxruntime (onnxruntime) target |" in text
    run_script("rows.py", q41_bundle, "--rows", "2", "--rounds", "1", "--role", "draft", "--backends", "native",
               "--out", tmp_path / "draft")
    read_record(out, "rows.py")


def test_contention(q41_bundle, tmp_path):
    out = tmp_path / "contention"
    run_script("contention.py", q41_bundle, "--busy", "0,1", "--tokens", "6", "--rounds", "1", "--no-llamacpp",
               "--out", out)
    text = (out / "contention.md").read_text(encoding="utf-8")
    assert "| specdec native |" in text and "1 busy / idle" in text and "llama.cpp: not measured" in text
    assert read_record(out, "contention.py")["busy"] == [0, 1]


def test_step_of_a_native_draft_alone_both_ways_of_holding_weights(q41_bundle, tmp_path):
    """--roles draft on native: the draft shares its target's KV, so the target's slots are set up too; --pages opens
    native once per way of holding its weights."""
    out = tmp_path / "step"
    run_script("step.py", q41_bundle, "--backends", "native", "--roles", "draft", "--cases", "1@8,3@8", "--rounds", "1",
               "--pages", "private,shared", "--out", out)
    text = (out / "step.md").read_text(encoding="utf-8")
    assert "(native, private pages) draft |" in text and "(native, shared pages) draft |" in text
    assert "target |" not in text
    assert {s.get("pages") for s in read_record(out, "step.py")["settings"].values()} == {"private", "shared"}
