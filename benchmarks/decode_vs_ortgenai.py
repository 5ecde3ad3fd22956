"""Plain decoding ms/token at cache lengths 64 / 512 / 1000, prefill time for 64 / 512 tokens, and peak RSS:
specdec's target against onnxruntime-genai's build of the same weights, each in its own process, run A-B-A so
machine drift shows.

    python benchmarks/decode_vs_ortgenai.py bundles/smollm2-q41        # after benchmarks/peers/setup.sh

Each side: a fixed random prompt of L tokens is prefilled (timed), then 16 tokens are decoded one at a time
(median ms per token reported). Prints a markdown table; asserts nothing (not a test).
"""
from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

LENGTHS = (64, 512, 1000)
DECODE_STEPS = 16
ROOT = Path(__file__).resolve().parent
PEERS = ROOT / ".peers"


def prompt(length: int) -> list:
    return np.random.default_rng(length).integers(100, 40000, size=length).tolist()


def run_specdec(bundle: str) -> dict:
    from specdec.manifest import read_manifest
    from specdec.runtime.ort_backend import OrtBackend

    backend = OrtBackend(Path(bundle), read_manifest(bundle).target).open()
    backend.reset(1)
    out = {}
    for length in LENGTHS:
        ids = np.array([prompt(length)], dtype=np.int64)
        started = time.perf_counter()
        logits = backend.forward(ids, np.zeros(1, dtype=np.int64), last_only=True)
        prefill = time.perf_counter() - started
        token, steps = int(logits[0, -1].argmax()), []
        for step in range(DECODE_STEPS):
            started = time.perf_counter()
            logits = backend.forward(np.array([[token]]), np.array([length + step]), last_only=True)
            steps.append(time.perf_counter() - started)
            token = int(logits[0, -1].argmax())
        out[length] = {"prefill_ms": prefill * 1e3, "decode_ms": statistics.median(steps) * 1e3}
    return out


def run_ortgenai(model_dir: str) -> dict:
    import onnxruntime_genai as og

    model = og.Model(model_dir)
    out = {}
    for length in LENGTHS:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=length + DECODE_STEPS + 1, do_sample=False)
        generator = og.Generator(model, params)
        started = time.perf_counter()
        generator.append_tokens(prompt(length))
        prefill = time.perf_counter() - started
        steps = []
        for _ in range(DECODE_STEPS):
            started = time.perf_counter()
            generator.generate_next_token()
            steps.append(time.perf_counter() - started)
        out[length] = {"prefill_ms": prefill * 1e3, "decode_ms": statistics.median(steps) * 1e3}
    return out


def child(kind: str, target: str) -> None:
    run = run_specdec if kind == "specdec" else run_ortgenai
    run(target)  # warm-up pass: first-call costs are not what we compare
    result = run(target)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result))


def spawn(kind: str, target: str) -> dict:
    python = sys.executable if kind == "specdec" else str(PEERS / "ortgenai" / "bin" / "python")
    proc = subprocess.run([python, __file__, "--child", kind, target], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(runs: list) -> str:
    lines = ["| run | " + " | ".join(f"decode @{n} ms" for n in LENGTHS) + " | prefill 64 ms | prefill 512 ms | peak RSS MB |",
             "|---" * 7 + "|"]
    for name, result in runs:
        cells = [f"{result[str(n)]['decode_ms']:.1f}" for n in LENGTHS]
        cells += [f"{result['64']['prefill_ms']:.0f}", f"{result['512']['prefill_ms']:.0f}", f"{result['peak_rss_mb']:.0f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return
    bundle, model_dir = sys.argv[1], str(PEERS / "models" / "ortgenai-fp32")
    runs = [("specdec (A)", spawn("specdec", bundle)), ("onnxruntime-genai (B)", spawn("ortgenai", model_dir)),
            ("specdec (A again)", spawn("specdec", bundle))]
    print(table(runs))


if __name__ == "__main__":
    main()
