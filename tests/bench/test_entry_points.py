"""Every benchmark entry point in benchmarks/, run as a user runs it, on a tiny bundle for seconds: it exits 0 and
writes its tables and a run record naming the commit and the command. Never timings (benchmarks are not tests).
lockstep.py has its own file (test_lockstep.py); gpu_check.py runs on the TensorRT stand-in below."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def run_script(name: str, *args, timeout: int = 300) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(BENCH / name), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def read_record(folder: Path, script: str) -> dict:
    record = json.loads((folder / "record.json").read_text(encoding="utf-8"))
    assert len(record["git"]["commit"]) == 40 and record["command"].startswith(f"python benchmarks/{script}")
    assert record["machine"]["cpu"]["logical_cpus"] >= 1 and record["packages"]["numpy"]
    assert record["settings"] and record["finished"]
    return record


def test_step(gqa_int4_bundle, tmp_path):
    out = tmp_path / "step"
    run_script("step.py", gqa_int4_bundle, "--cases", "1@16,4@16,32@0,90@40", "--rounds", "2", "--by-op",
               "--floor", "--floor-gib", "0.01", "--backends", "onnxruntime", "--out", out)
    text = (out / "step.md").read_text(encoding="utf-8")
    assert "| gqa (onnxruntime) target |" in text and "| gqa (onnxruntime) draft |" in text
    assert "decode T=1 @16" in text and "verify T=4 @16" in text and "prefill T=32 @0" in text
    assert "| – |" in text  # 90 tokens at 40 do not fit S = 96: left out, not run
    assert "floor at the GEMV bandwidth" in text and "**all nodes**" in text
    rows = (out / "steps.csv").read_text(encoding="utf-8").splitlines()
    assert rows[0].startswith("model,case,tokens,cache_len,calls,min_ms") and len(rows) == 1 + 2 * 4  # + the floor's 1@64
    assert read_record(out, "step.py")["cases"] == [[1, 16], [4, 16], [32, 0], [90, 40]]


def test_modes_greedy_and_gumbel(gqa_int4_bundle, int4_bundle, tmp_path):
    out = tmp_path / "modes"
    run_script("modes.py", gqa_int4_bundle, int4_bundle, "--modes", "none,model:2,auto,head:1", "--per-class", "1",
               "--new-tokens", "6", "--repeats", "2", "--out", out)
    text = (out / "modes.md").read_text(encoding="utf-8")
    assert "| target-only |" in text and "| gqa model γ=2 |" in text and "| int4 auto |" in text
    assert "every check held" in text
    assert "- gqa head γ=1: not run (drafter 'head' needs a trained draft head" in text  # the others ran
    assert "- int4 head γ=1: not run" in text and "| int4 head" not in text
    read_record(out, "modes.py")
    sampled = tmp_path / "sampled"
    run_script("modes.py", gqa_int4_bundle, "--modes", "model,prompt_lookup", "--couplings", "leviathan,gumbel",
               "--temperature", "0.8", "--per-class", "1", "--new-tokens", "6", "--repeats", "1", "--out", sampled)
    text = (sampled / "modes.md").read_text(encoding="utf-8")
    assert "(gumbel)" in text and "every check held" in text  # gumbel: the same tokens whatever the drafter


def test_draft_quality(gqa_int4_bundle, tmp_path):
    out = tmp_path / "quality"
    run_script("draft_quality.py", gqa_int4_bundle, "--per-class", "1", "--continue", "6", "--kv", "target",
               "--confidence", "--gammas", "2,3", "--cache-len", "32", "--rounds", "2", "--layer-skip", "--out", out)
    text = (out / "quality.md").read_text(encoding="utf-8")
    assert "| gqa | int4 (int4), onnxruntime | target |" in text
    assert "stop below 0.5" in text and "| layer left out | top-1 agreement |" in text
    read_record(out, "draft_quality.py")


def test_draft_quality_of_a_head(export_tiny, tmp_path):
    from specdec.export.tiny import save_tiny
    from specdec.head.format import attach_head
    from specdec.head.random import random_head
    from specdec.manifest import read_manifest
    from specdec.runtime.forward import head_feature_layers

    model = save_tiny(tmp_path / "model", "llama", layers=8, seed=0, hidden=64, init_range=0.5)
    bundle = export_tiny(tmp_path / "bundle", model, no_draft=True)
    dims = read_manifest(bundle).target.dims
    attach_head(bundle, *random_head(dims, head_feature_layers(dims.num_layers), seed=1))
    out = tmp_path / "quality"
    run_script("draft_quality.py", bundle, "--head", "--prompts", BENCH / "head_prompts", "--per-class", "3",
               "--continue", "6", "--head-gammas", "1,3", "--temperatures", "0,0.7", "--backend", "native", "--out", out)
    text = (out / "quality.md").read_text(encoding="utf-8")
    assert "| 0.0 | 3 |" in text and "| 0.7 | 1 |" in text and "| yes |" in text and "NO" not in text
    assert read_record(out, "draft_quality.py")["settings"]["bundle"]["head"]["t=0.0 γ=3"]["proposed"] > 0


def test_soak(gqa_int4_bundle, tmp_path):
    out = tmp_path / "soak"
    run_script("soak.py", gqa_int4_bundle, "--requests", "6", "--new-tokens", "4", "--every", "3", "--out", out)
    result = read_record(out, "soak.py")["result"]
    assert [s["kind"] for s in result["samples"]] == ["start", "warm", "run", "run"]
    assert "Growth after warm-up" in (out / "soak.md").read_text(encoding="utf-8")


def test_serve_load(gqa_int4_bundle, tmp_path):
    for module in ("fastapi", "uvicorn", "httpx", "psutil", "matplotlib"):
        pytest.importorskip(module)
    out = tmp_path / "serve"
    run_script("serve_load.py", "--bundle", gqa_int4_bundle, "--modes", "plain,fixed", "--concurrency", "1,2",
               "--requests", "2", "--repeats", "1", "--max-tokens", "4", "--max-batch", "2", "--out", out)
    summary = (out / "summary.csv").read_text(encoding="utf-8").splitlines()
    assert summary[0].startswith("mode,concurrency,requests,errors") and len(summary) == 1 + 2 * 2
    assert all(line.split(",")[3] == "0" for line in summary[1:])  # no errors
    reused = summary[0].split(",").index("prompt_reused_share")  # onnxruntime's K/V are not exact by position
    assert all(float(line.split(",")[reused]) == 0.0 for line in summary[1:])
    record = read_record(out, "serve_load.py")
    same, compared = record["identical_greedy_outputs"]
    assert same == compared >= 1
    assert (out / "throughput.png").read_bytes().startswith(b"\x89PNG")


def test_serve_load_says_why_a_server_stopped_and_refuses_a_missing_bundle(gqa_int4_bundle, tmp_path):
    for module in ("fastapi", "uvicorn", "httpx", "psutil"):
        pytest.importorskip(module)
    script = [sys.executable, str(BENCH / "serve_load.py"), "--modes", "plain", "--requests", "1", "--out",
              str(tmp_path / "out")]
    done = subprocess.run(script + ["--bundle", str(gqa_int4_bundle), "--max-batch", "99"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0 and "exceeds this bundle's max_batch" in done.stderr  # the server's own words
    done = subprocess.run(script + ["--bundle", str(tmp_path / "none")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "does not exist" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_prompt_stall(gqa_int4_bundle, tmp_path):
    for module in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(module)
    out = tmp_path / "stall"
    run_script("prompt_stall.py", gqa_int4_bundle, "--rounds", "1", "--tokens", "8", "--flood", "2", "--size-kb", "64",
               "--after", "0", "--out", out)
    result = read_record(out, "prompt_stall.py")["result"]
    assert set(result) == {"none", "huge-text", "bound-text", "huge-chat"}
    for kind in ("huge-text", "bound-text", "huge-chat"):  # each too long for the tiny bundle: refused, not a 5xx
        assert result[kind]["statuses"] == [400, 400], (kind, result[kind])
    assert "longest gap" in (out / "prompt_stall.md").read_text(encoding="utf-8")


def test_thread_schemes(gqa_int4_bundle, tmp_path):
    out = tmp_path / "threads"
    run_script("thread_schemes.py", gqa_int4_bundle, "--rounds", "1", "--cache-len", "16", "--out", out)
    text = (out / "threads.md").read_text(encoding="utf-8")
    assert all(f"| {scheme} |" in text for scheme in ("nospin", "spin", "spinstop", "global"))
    read_record(out, "thread_schemes.py")


def test_head_scatter(tmp_path):
    out = tmp_path / "scatter"
    run_script("head_scatter.py", "--kept", "40", "--vocab", "128", "--repeats", "3", "--out", out)
    assert "the bundle's form" in (out / "scatter.md").read_text(encoding="utf-8")
    read_record(out, "head_scatter.py")


def test_bad_arguments_are_refused_without_a_traceback(gqa_int4_bundle, tmp_path):
    for script, args, message in (("step.py", ["--cases", "1x64"], "is not T@L"),
                                  ("step.py", ["--backends", "gpu"], "unknown backend"),
                                  ("modes.py", ["--modes", "beam:2"], "is not DRAFTER[:γ]"),
                                  ("thread_schemes.py", ["--schemes", "turbo"], "unknown scheme")):
        done = subprocess.run([sys.executable, str(BENCH / script), str(gqa_int4_bundle), *args, "--out",
                               str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_gpu_check_on_the_tensorrt_stand_in(tiny_llama, tmp_path, monkeypatch):
    """The GPU one-shot check's own code on the CPU stand-in for tensorrt + cuda-python: proves the script's glue,
    never TensorRT (which only `make gpu-check-tensorrt` on a GPU machine can)."""
    from specdec.cli import export_main
    from tests.engines.trt_standin import Device, install

    install(monkeypatch, Device())
    monkeypatch.syspath_prepend(str(BENCH))  # gpu_check imports its harness as a script does
    bundle = tmp_path / "trt"
    assert export_main(["--target", str(tiny_llama), "--out", str(bundle), "--draft-layers", "1", "--engine",
                        "tensorrt", "--max-seq-len", "96", "--max-batch", "2", "--gamma", "3", "--gamma-max", "4",
                        "--max-prefill-chunk", "64"]) == 0  # gpu_check feeds each prompt whole
    spec = importlib.util.spec_from_file_location("gpu_check", BENCH / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main([str(bundle), str(tmp_path / "out"), "--new-tokens", "4", "--repeats", "1"]) == 0
    report = json.loads((tmp_path / "out" / "trt.json").read_text(encoding="utf-8"))
    assert all(report["exact"].values()) and report["exact_no_graphs"]


def test_half_checkpoint(tiny_llama, tmp_path):
    """The half-precision checkpoint a user of a hub model brings: the weights rounded to bf16, the tokenizer kept."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "half"
    done = run_script("half_checkpoint.py", "--target", tiny_llama, "--dtype", "bfloat16", "--out", out)
    assert "bfloat16" in done.stdout
    source = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32)
    half = AutoModelForCausalLM.from_pretrained(out, torch_dtype="auto")
    assert half.dtype == torch.bfloat16
    for (name, weight), (_, rounded) in zip(source.state_dict().items(), half.state_dict().items()):
        assert torch.equal(weight.to(torch.bfloat16), rounded), name
    assert AutoTokenizer.from_pretrained(out).vocab_size == AutoTokenizer.from_pretrained(tiny_llama).vocab_size
