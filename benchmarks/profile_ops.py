"""onnxruntime profiler tables: where a bundle model's decode step (T = 1) spends its time, by op type.

    python benchmarks/profile_ops.py BUNDLE [BUNDLE ...] --roles target,draft --cache-len 64 --steps 32

For each model: its graph's node count after onnxruntime's optimizations, then the op types by share of the summed
kernel time over `steps` decode steps (after a warm-up prefill), with the mean microseconds per step and call
counts. Uses the session options the runtime uses (specdec.runtime.backend.session_options), plus profiling.
Prints markdown; no assertions (not a test).
"""
from __future__ import annotations

import argparse
import collections
import json
import tempfile
from pathlib import Path

import numpy as np

from specdec.lowering import lowering_for
from specdec.manifest import read_manifest
from specdec.runtime.backend import session_options
from specdec.runtime.ort_backend import OrtBackend


def profiled_backend(bundle: Path, entry, prefix: str, threads: int | None = None):
    """The runtime's backend for `entry`, its session re-opened with the profiler on."""
    import onnxruntime as ort

    backend = OrtBackend(bundle, entry, threads).open()
    options = session_options(threads)
    options.enable_profiling = True
    options.profile_file_prefix = prefix
    backend.session = ort.InferenceSession(str(bundle / entry.onnx_path), options, providers=["CPUExecutionProvider"])
    # the lowering's driver runs the session (and binds its KV): a new driver for the profiled one
    backend.driver = lowering_for(entry.lowering).driver(backend.session, entry.dims, backend.max_seq_len,
                                                         entry.kv_dtype)
    backend.reset(1)
    return backend


def op_table(profile: Path, steps: int) -> tuple[list, float]:
    """(rows of (op type, total µs, calls), total µs) from an onnxruntime profile, the warm-up run left out."""
    events = json.loads(profile.read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    first_end = runs[0]["ts"] + runs[0]["dur"] if runs else 0
    totals, calls = collections.Counter(), collections.Counter()
    for event in events:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time") or event["ts"] < first_end:
            continue
        op = event["args"].get("op_name", "?")
        totals[op] += event["dur"]
        calls[op] += 1
    total = sum(totals.values())
    return [(op, us, calls[op]) for op, us in totals.most_common()], total


def profile_model(bundle: Path, role: str, cache_len: int, steps: int, top: int, threads: int | None = None) -> str:
    import onnx

    entry = read_manifest(bundle).models[role]
    with tempfile.TemporaryDirectory() as scratch:
        backend = profiled_backend(bundle, entry, str(Path(scratch) / "profile"), threads)
        backend.forward(np.full((1, cache_len), 5, np.int64), np.array([0]), last_only=True)
        for step in range(steps):
            backend.forward(np.array([[7]], np.int64), np.array([cache_len + step]))
        profile = Path(backend.session.end_profiling())
        rows, total = op_table(profile, steps)
    nodes = len(onnx.load(str(bundle / entry.onnx_path), load_external_data=False).graph.node)
    lines = [f"**{bundle.name}/{role}** ({entry.lowering}, {entry.precision}; {nodes} nodes in the file): "
             f"T = 1 at cache length {cache_len}, {steps} steps, {threads or 'all'} threads, "
             f"kernel time {total / steps / 1e3:.2f} ms/step",
             "", "| op | share | µs/step | calls/step |", "|---|---|---|---|"]
    for op, us, count in rows[:top]:
        lines.append(f"| {op} | {us / total:.1%} | {us / steps:.0f} | {count / steps:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundles", nargs="+", type=Path)
    parser.add_argument("--roles", default="target,draft")
    parser.add_argument("--cache-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: one per core)")
    args = parser.parse_args()
    for bundle in args.bundles:
        roles = [r for r in args.roles.split(",") if r in read_manifest(bundle).models]
        for role in roles:
            print(profile_model(bundle, role, args.cache_len, args.steps, args.top, args.threads))


if __name__ == "__main__":
    main()
