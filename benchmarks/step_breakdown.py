"""Where a decode step and a verify pass spend their time, by op type: what a verify pass of γ+1 tokens costs
beyond a one-token step, and what the draft's step is made of.

    python benchmarks/step_breakdown.py bundles/smollm2-q41 --cache-len 200 --steps 30

For the target: T = 1 and T = γ+1 (--verify, default 5) calls at the same cache length, interleaved; for the
draft: T = 1. onnxruntime's profiler times every node of every call; a node's time is its minimum over the calls
(the machine is shared: the minimum is the least disturbed), summed by op type. The sum of node minima is below a
call's wall time (it leaves out the time between kernels). The profiler makes small kernels look dearer than they
are. Prints markdown; no assertions (not a test).
"""
from __future__ import annotations

import argparse
import bisect
import collections
import json
import tempfile
from pathlib import Path

import numpy as np

from profile_ops import profiled_backend
from specdec.manifest import read_manifest


def node_minima(bundle: Path, role: str, cache_len: int, widths: tuple, steps: int) -> dict:
    """{T: {op type: summed per-node minimum µs}} over `steps` interleaved calls of each width T."""
    entry = read_manifest(bundle).models[role]
    with tempfile.TemporaryDirectory() as scratch:
        backend = profiled_backend(bundle, entry, str(Path(scratch) / "profile"))
        backend.forward(np.full((1, cache_len), 5, np.int64), np.array([0]), last_only=True)
        for _ in range(steps):
            for width in widths:
                backend.forward(np.full((1, width), 7, np.int64), np.array([cache_len]))
        events = json.loads(Path(backend.session.end_profiling()).read_text())
    runs = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    times, ops = collections.defaultdict(list), {}
    for event in events:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        run = bisect.bisect_right(runs, event["ts"]) - 1
        if run < 1:  # the prefill
            continue
        node = event["name"][: -len("_kernel_time")]
        times[(widths[(run - 1) % len(widths)], node)].append(event["dur"])
        ops[node] = event["args"].get("op_name", "?")
    out = {width: collections.Counter() for width in widths}
    for (width, node), durations in times.items():
        out[width][ops[node]] += min(durations)
    return out


def table(title: str, minima: dict) -> str:
    widths = list(minima)
    order = sorted({op for counter in minima.values() for op in counter}, key=lambda op: -minima[widths[-1]][op])
    head = "| op | " + " | ".join(f"T = {w} ms" for w in widths) + (" | difference ms |" if len(widths) > 1 else " |")
    lines = [title, "", head, "|---" * (len(widths) + 1 + (len(widths) > 1)) + "|"]
    for op in order + ["all nodes"]:
        values = [sum(minima[w].values()) if op == "all nodes" else minima[w][op] for w in widths]
        cells = [f"{v / 1e3:.2f}" for v in values]
        if len(widths) > 1:
            cells.append(f"{(values[-1] - values[0]) / 1e3:+.2f}")
        name = f"**{op}**" if op == "all nodes" else op
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--cache-len", type=int, default=200)
    parser.add_argument("--verify", type=int, default=5, help="the verify pass's width γ+1")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    target = node_minima(args.bundle, "target", args.cache_len, (1, args.verify), args.steps)
    print(table(f"**{args.bundle.name}/target** at cache length {args.cache_len}: per-node minimum over "
                f"{args.steps} interleaved calls of each width, summed by op type", target))
    if read_manifest(args.bundle).draft is not None:
        draft = node_minima(args.bundle, "draft", args.cache_len, (1,), args.steps)
        print(table(f"**{args.bundle.name}/draft** at cache length {args.cache_len}, T = 1", draft))


if __name__ == "__main__":
    main()
