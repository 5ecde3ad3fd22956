"""onnxruntime thread schemes for a draft and a target session sharing few cores (DESIGN §5).

    python benchmarks/thread_schemes.py BUNDLE --rounds 3 [--out benchmarks/results/threads.md]

Each scheme runs in its own process (a global thread pool is per process), the processes interleaved round by round.
In each: plain decoding (16 target steps, T = 1) and speculative-shaped rounds (4 draft steps, then a T = 5 target
verify), ms per target step / per round / per draft step. Schemes:
  nospin    per-session pools, session.intra_op.allow_spinning = 0
  spin      per-session pools, spinning on (onnxruntime's default)
  spinstop  per-session pools, spinning on, session.force_spinning_stop = 1 (spin only while a Run lasts)
  global    one global pool (set_global_thread_pool_sizes(cores, 1), use_per_session_threads = False)
Prints (and writes) a markdown table of min / median; no assertions (not a test).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SCHEMES = ("nospin", "spin", "spinstop", "global")


def options_for(scheme: str):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = len(os.sched_getaffinity(0))
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0" if scheme == "nospin" else "1")
    if scheme == "spinstop":
        options.add_session_config_entry("session.force_spinning_stop", "1")
    if scheme == "global":
        options.use_per_session_threads = False
    return options


def child(scheme: str, bundle: Path, cache_len: int = 64) -> dict:
    """Time one scheme in this process. -> {"plain": ms per step, "round": ms per round, "draft": ms per step}"""
    import numpy as np
    import onnxruntime as ort

    from specdec.manifest import read_manifest
    from specdec.runtime import backend as runtime_backend
    from specdec.runtime.ort_backend import OrtBackend

    if scheme == "global":
        ort.capi._pybind_state.set_global_thread_pool_sizes(len(os.sched_getaffinity(0)), 1)
    runtime_backend.session_options = lambda threads=None: options_for(scheme)  # this child process only
    manifest = read_manifest(bundle)
    models = []
    for entry in (manifest.target, manifest.draft):
        backend = OrtBackend(bundle, entry).open()
        backend.reset(1)
        backend.forward(np.full((1, cache_len), 5, np.int64), np.array([0]), last_only=True)
        models.append(backend)
    target, draft = models
    one, five = np.array([[7]], np.int64), np.full((1, 5), 7, np.int64)
    started = time.perf_counter()
    for step in range(16):
        target.forward(one, np.array([cache_len + step]))
    plain = (time.perf_counter() - started) / 16
    draft_s, started = 0.0, time.perf_counter()
    for _ in range(8):
        drafting = time.perf_counter()
        for step in range(4):
            draft.forward(one, np.array([cache_len + step]))
        draft_s += time.perf_counter() - drafting
        target.forward(five, np.array([cache_len]))
    rounds = (time.perf_counter() - started) / 8
    return {"plain": plain * 1e3, "round": rounds * 1e3, "draft": draft_s / 32 * 1e3}


def table(samples: dict, bundle: Path, rounds: int) -> str:
    lines = [f"Thread schemes on {bundle.name} ({os.cpu_count()} CPUs; {rounds} interleaved processes per scheme; "
             "ms, min / median)", "",
             "| scheme | plain decode ms/step | draft 4 + verify T=5 ms/round | draft ms/step |", "|---|---|---|---|"]
    for scheme, runs in samples.items():
        cells = [f"{min(r[k] for r in runs):.1f} / {statistics.median(r[k] for r in runs):.1f}"
                 for k in ("plain", "round", "draft")]
        lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.bundle)))
        return
    schemes = args.schemes.split(",")
    samples = {scheme: [] for scheme in schemes}
    for _ in range(args.rounds):
        for scheme in schemes:
            done = subprocess.run([sys.executable, __file__, str(args.bundle), "--child", scheme],
                                  capture_output=True, text=True, check=True)
            samples[scheme].append(json.loads(done.stdout.strip().splitlines()[-1]))
    text = table(samples, args.bundle, args.rounds)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
