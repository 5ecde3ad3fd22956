"""The native engine's benchmark entry points, run as a user runs them, on the tiny Q4_1 bundle for seconds: each
exits 0 and writes its table and a run record. Never timings (benchmarks are not tests)."""
from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

from specdec.weights_file import FORMAT_VERSION
from specdec.native import build
from tests.bench.test_entry_points import BENCH, read_record, run_script

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")


def test_native_ab_against_a_folder_of_sources(q41_bundle, tmp_path):
    """Both builds for one instruction set with one flag set (specdec's own, or --isa's), named in the record and the
    table: an A/B never credits an ISA difference to a code change; the record names the target's activations."""
    out = tmp_path / "ab"
    run_script("native_ab.py", q41_bundle, build.HERE, "--rounds", "2", "--tokens", "5", "--rows", "2",
               "--activations", "int8", "--out", out)
    text = (out / "native_ab.md").read_text(encoding="utf-8")
    assert "| 64 |" in text and "new / old (min)" in text
    settings = read_record(out, "native_ab.py")["settings"]["specdec native"]
    assert settings["activations"] == "int8"  # the record names what the target multiplied in
    builds = settings["builds"]
    assert builds["new"]["isa"] == builds["old"]["isa"] == build.isa()
    assert builds["new"]["flags"] == builds["old"]["flags"] == list(build.build_flags())
    assert f"- old: specdec/native; ISA {build.isa()}; " in text
    forced = tmp_path / "avx2"
    run_script("native_ab.py", q41_bundle, build.HERE, "--rounds", "1", "--isa", "avx2", "--busy", "1", "--out", forced)
    assert read_record(forced, "native_ab.py")["busy"] == 1  # timed beside a spinning process, and said so
    assert "beside 1 process spinning on a core each" in (forced / "native_ab.md").read_text(encoding="utf-8")
    builds = read_record(forced, "native_ab.py")["settings"]["specdec native"]["builds"]
    assert builds["new"]["isa"] == builds["old"]["isa"] == "avx2"
    assert builds["new"]["flags"] == builds["old"]["flags"] and "-mavx512f" not in builds["new"]["flags"]
    assert "- new: this tree; ISA avx2; " in (forced / "native_ab.md").read_text(encoding="utf-8")


def test_native_ab_refuses_sources_of_another_weights_format(q41_bundle, tmp_path):
    """Sources that read another format would take the bundle's blocks for other weights: refused, pointing at
    tree_ab.py."""
    old = tmp_path / "old"
    shutil.copytree(build.HERE, old, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    header = old / "specdec_native.h"
    header.write_text(header.read_text().replace(f"SPECDEC_FORMAT_VERSION {FORMAT_VERSION}\n",
                                                 f"SPECDEC_FORMAT_VERSION {FORMAT_VERSION - 1}\n"))
    done = subprocess.run([sys.executable, str(BENCH / "native_ab.py"), str(q41_bundle), str(old), "--rounds", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert f"read native weights of format {FORMAT_VERSION - 1}, this specdec writes format {FORMAT_VERSION}" in \
        done.stderr and "tree_ab.py" in done.stderr


def test_tree_ab_times_two_checkouts_in_turn(q41_bundle, tmp_path):
    """Each side a process of its own checkout on its own bundle (here this tree on both sides), named in the table;
    a checkout that cannot decode its bundle is named with its error, no traceback."""
    root = build.HERE.parents[1]
    out = tmp_path / "tree"
    run_script("tree_ab.py", q41_bundle, root, q41_bundle, "--rounds", "2", "--steps", "3", "--out", out)
    text = (out / "tree_ab.md").read_text(encoding="utf-8")
    assert "- new: this tree (commit " in text and f"ISA {build.isa()}" in text and "new / old (min)" in text
    sides = read_record(out, "tree_ab.py")["settings"]["specdec native"]["sides"]
    assert sides["new"]["isa"] == sides["old"]["isa"] == build.isa()
    done = subprocess.run([sys.executable, str(BENCH / "tree_ab.py"), str(q41_bundle), str(root), str(tmp_path),
                           "--rounds", "1", "--steps", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "could not decode" in done.stderr and "Traceback" not in done.stderr


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


def test_step_floor_pairs_each_target_step_with_a_read_of_the_same_round(q41_bundle, tmp_path):
    """--floor times a read of the step's bytes in every round: the decode case at --floor-cache-len is added when
    --cases lacks it, and the record holds the paired ratios (a ratio of round times, so positive and finite)."""
    out = tmp_path / "floor"
    run_script("step.py", q41_bundle, "--backends", "native", "--roles", "target", "--cases", "3@8", "--rounds", "3",
               "--floor", "--floor-gib", "0.01", "--floor-cache-len", "8", "--out", out)
    text = (out / "step.md").read_text(encoding="utf-8")
    assert "decode T=1 @8" in text and "Paired by round" in text and "min step / min read" in text
    paired = read_record(out, "step.py")["floor"]["paired"]
    (name, ratios), = paired.items()
    assert name.endswith("(native) target") and ratios["rounds"] == 3
    assert 0 < ratios["min_over_min"] < float("inf") and 0 < ratios["median_paired"] < float("inf")


def _step_module():
    import importlib
    import sys

    from tests.bench.test_entry_points import BENCH
    sys.path.insert(0, str(BENCH))  # step.py imports its harness as a script does
    try:
        return importlib.import_module("step")
    finally:
        sys.path.remove(str(BENCH))


def test_floor_reader_reads_the_weights_own_pages():
    """The reader of a native target's floor reads the arrays a step reads, where they lie: adjacent tensors of one
    buffer as one span, a far one (past the gap) as another, another buffer's apart; the rest of the bytes (the KV)
    from a buffer of its own."""
    step = _step_module()
    whole, other = np.arange(1 << 20, dtype=np.uint8), np.zeros(4096, np.uint8)
    near = [whole[:1000], whole[1000:5000], whole[5000:9000].view(np.uint32)]
    far = whole[(1 << 20) - 4096:]
    spans = step._merged([far, *near, other])
    assert len(spans) == 3
    assert sorted((s.ctypes.data - whole.ctypes.data, s.nbytes) for s in spans if np.shares_memory(s, whole)) == [
        (0, 9000), ((1 << 20) - 4096, 4096)]
    assert [s.nbytes for s in spans if np.shares_memory(s, other)] == [4096]
    reader = step.Reader(9000 + 4096 + 800, [far, *near])
    try:
        reader()
        assert reader.nbytes == 9000 + 4096 + 800  # whole words of the weights' spans, then 800 bytes of its own
        assert sum(piece.nbytes for part in reader.parts for piece in part) == reader.nbytes
        own = [piece for part in reader.parts for piece in part if not np.shares_memory(piece, whole)]
        assert sum(piece.nbytes for piece in own) == 800
    finally:
        reader.close()


def test_paired_floor_divides_round_by_round():
    step = _step_module()
    samples = {("m target", (1, 8)): [2.0, 9.0, 3.0], ("m draft", (1, 8)): [1.0, 1.0, 1.0], "read m": [1.5, 3.0, 1.0],
               ("n target", (1, 8)): [4.0, 4.0, 4.0], "read n": [2.0, 1.0, 4.0]}
    models = {"m target": None, "m draft": None, "n target": None}
    text, found = step.paired_floor(samples, models, (1, 8), {"m target": "read m", "n target": "read n"})
    # least disturbed: 2 / 1; same round: 2 / 1.5, 9 / 3, 3 / 1 -> median 3 (a draft is not scored); each target
    # against the reader of its own bytes: n's 4 / 1, and 2, 4, 1 -> median 2
    assert found == {"m target": {"min_over_min": 2.0, "median_paired": 3.0, "rounds": 3},
                     "n target": {"min_over_min": 4.0, "median_paired": 2.0, "rounds": 3}}
    assert "| m target | read m | 2.00× | 3.00× | 3 |" in text
    assert "| n target | read n | 4.00× | 2.00× | 3 |" in text
