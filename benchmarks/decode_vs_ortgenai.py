"""Decoding ms/token at cache lengths 64 / 512 / 1000, prefill time for 64 / 512 tokens, and peak RSS: specdec's
models against onnxruntime-genai's builds of the same weights, each side in its own process, the sides interleaved
round by round so machine drift shows.

    python benchmarks/decode_vs_ortgenai.py bundles/smollm2-q41        # after benchmarks/peers/setup.sh
    python benchmarks/decode_vs_ortgenai.py bundles/smollm2-q41 --sides specdec:draft,ortgenai:int4 --rounds 3
    python benchmarks/decode_vs_ortgenai.py B --sides specdec:draft,specdec:draft@B2,ortgenai:int4   # two drafts

Sides: specdec:target and specdec:draft (one forward per token, the runtime's backend and session options),
native:target and native:draft (the same on specdec's native backend),
ortgenai:fp32 and ortgenai:int4 (its model builder's graphs, `generate_next_token`, the settings setup.sh writes
into genai_config.json); `specdec:ROLE@BUNDLE` takes that model of another bundle. Each side: a fixed random
prompt of L tokens is prefilled (timed), then 16 tokens are decoded one at a time (median ms per token). A table
row per side: min / median over the rounds. Prints markdown; asserts nothing (not a test).
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


def run_specdec(bundle: str, role: str = "target", engine: str = "onnxruntime") -> dict:
    from specdec.manifest import read_manifest
    from specdec.runtime.native_backend import NativeBackend
    from specdec.runtime.ort_backend import OrtBackend
    from specdec.runtime.registry import open_pair

    manifest = read_manifest(bundle)
    if engine == "native":  # the draft on the target's blocks needs its target open (and reset) too
        target, draft = open_pair(NativeBackend, Path(bundle), manifest, "cpu", None)
        target.reset(1)
        backend = target if role == "target" else draft
    else:
        backend = OrtBackend(Path(bundle), manifest.models[role]).open()
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


def child(side: str, bundle: str) -> None:
    system, which = side.split(":", 1)
    which, _, other = which.partition("@")
    bundle = other or bundle
    if system in ("specdec", "native"):
        def run():
            return run_specdec(bundle, which, "native" if system == "native" else "onnxruntime")
    else:
        def run():
            return run_ortgenai(str(PEERS / "models" / f"ortgenai-{which}"))
    run()  # warm-up pass: first-call costs are not what we compare
    result = run()
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result))


def spawn(side: str, bundle: str) -> dict:
    python = sys.executable if side.startswith(("specdec", "native")) else str(PEERS / "ortgenai" / "bin" / "python")
    proc = subprocess.run([python, __file__, "--child", side, bundle], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cell(values: list, pattern: str) -> str:
    return f"{pattern.format(min(values))} / {pattern.format(statistics.median(values))}"


def table(runs: dict) -> str:
    lines = ["| side | " + " | ".join(f"decode @{n} ms" for n in LENGTHS)
             + " | prefill 64 ms | prefill 512 ms | peak RSS MB |", "|---" * 7 + "|"]
    for side, results in runs.items():
        cells = [cell([r[str(n)]["decode_ms"] for r in results], "{:.1f}") for n in LENGTHS]
        cells += [cell([r[str(n)]["prefill_ms"] for r in results], "{:.0f}") for n in (64, 512)]
        cells.append(f"{max(r['peak_rss_mb'] for r in results):.0f}")
        lines.append(f"| {side} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n(min / median over the rounds)"


def main() -> None:
    if sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle")
    parser.add_argument("--sides", default="specdec:target,ortgenai:fp32")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    sides = args.sides.split(",")
    runs = {side: [] for side in sides}
    for _ in range(args.rounds):
        for side in sides:
            runs[side].append(spawn(side, args.bundle))
    print(table(runs))
    print("\n".join(peer_settings(sides)))


def peer_settings(sides: list) -> list:
    """A line per onnxruntime-genai side: the session options its genai_config.json gives it (setup.sh writes
    intra_op_num_threads = cores)."""
    lines = []
    for side in sides:
        if side.startswith("ortgenai:"):
            config = PEERS / "models" / f"ortgenai-{side.split(':', 1)[1]}" / "genai_config.json"
            options = json.loads(config.read_text(encoding="utf-8"))["model"]["decoder"].get("session_options", {})
            settings = {key: options[key] for key in ("intra_op_num_threads", "inter_op_num_threads") if key in options}
            lines.append(f"- {side}: {settings or 'onnxruntime defaults'} ({config.relative_to(ROOT.parent)})")
    return lines


if __name__ == "__main__":
    main()
