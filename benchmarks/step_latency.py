"""Per-call latency of bundle models, interleaved: decode (T=1) and verify (T=γ+1) at several cache lengths,
and prefill chunks. Compares lowerings (plain vs gqa) and drafts on this machine in one run.

    python benchmarks/step_latency.py BUNDLE [BUNDLE ...] --repeats 5

Prints a markdown table of min and median milliseconds per call; no assertions (not a test).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from specdec.manifest import read_manifest
from specdec.runtime.ort_backend import OrtBackend

CASES = [("decode", 1, 64), ("decode", 1, 512), ("decode", 1, 1000), ("verify", 5, 512),
         ("prefill", 64, 0), ("prefill", 512, 0)]


def open_models(bundles: list, threads: int | None = None, roles=("target", "draft")) -> dict:
    models = {}
    for bundle in bundles:
        manifest = read_manifest(bundle)
        label = Path(bundle).name if sum(Path(b).name == Path(bundle).name for b in bundles) == 1 else bundle
        for role, entry in manifest.models.items():
            if role not in roles:
                continue
            name = f"{label}/{role} ({entry.lowering}, {entry.precision})"
            backend = OrtBackend(Path(bundle), entry, threads).open()
            backend.reset(1)
            models[name] = backend
    return models


def time_call(backend, steps: int, cache_len: int) -> float:
    ids = np.full((1, steps), 5, dtype=np.int64)
    started = time.perf_counter()
    backend.forward(ids, np.array([cache_len], dtype=np.int64), last_only=steps > 8)
    return time.perf_counter() - started


def measure(models: dict, repeats: int) -> dict:
    samples = {(name, case): [] for name in models for case in CASES}
    for name, backend in models.items():  # warm-up every shape once
        for case in CASES:
            time_call(backend, case[1], case[2])
    for _ in range(repeats):
        for case in CASES:
            for name, backend in models.items():
                samples[(name, case)].append(time_call(backend, case[1], case[2]) * 1e3)
    return samples


def table(models: dict, samples: dict) -> str:
    header = "| model | " + " | ".join(f"{k} T={t} @{c}" for k, t, c in CASES) + " |"
    lines = [header, "|" + " --- |" * (len(CASES) + 1)]
    for name in models:
        cells = [f"{min(samples[(name, case)]):.1f} / {statistics.median(samples[(name, case)]):.1f}"
                 for case in CASES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n(ms per call, min / median)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundles", nargs="+")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: one per core)")
    parser.add_argument("--roles", default="target,draft")
    args = parser.parse_args()
    models = open_models(args.bundles, args.threads, args.roles.split(","))
    print(table(models, measure(models, args.repeats)))


if __name__ == "__main__":
    main()
