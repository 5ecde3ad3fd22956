"""What batching rows buys: one forward of B rows (each at its own cache length and slot) against B one-row
forwards, on each backend, interleaved.

    python benchmarks/rows.py bundles/smollm2-q41 --rows 4 --backends native,onnxruntime
    python benchmarks/rows.py bundles/smollm2-q41 --rows 4 --tokens 5 --role draft

Rows are prefilled to cache lengths spread over --lengths; a case is --tokens tokens per row (every row scored,
as a decode step or verify pass). Writes rows.md and record.json; asserts nothing.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from harness import opening, record, tables, timer

EXPERIMENT = "rows"


def cases(backend, rows: int, tokens: int, lengths: list) -> dict:
    """{"one call": ..., "one row at a time": ...} over the backend's slots 0..rows-1, prefilled to `lengths`."""
    rng = np.random.default_rng(0)
    backend.reset(rows)
    starts = np.array([lengths[row % len(lengths)] for row in range(rows)])
    for slot, length in enumerate(starts):
        backend.forward(rng.integers(3, backend.vocab_size, (1, int(length))), np.zeros(1, np.int64),
                        last_only=True, slots=np.array([slot]))
    ids, slots = rng.integers(3, backend.vocab_size, (rows, tokens)), np.arange(rows)

    def together():
        backend.forward(ids, starts, slots=slots)

    def apart():
        for row in range(rows):
            backend.forward(ids[row : row + 1], starts[row : row + 1], slots=slots[row : row + 1])

    return {"one call": together, "one row at a time": apart}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--backends", default="native,onnxruntime")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--lengths", default="64,200,400,600", help="cache lengths the rows are spread over")
    parser.add_argument("--role", choices=("target", "draft"), default="target")
    parser.add_argument("--rounds", type=int, default=20)
    opening.add_common(parser, backend=False)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    lines, settings = [], {}
    for name in (n.strip() for n in args.backends.split(",") if n.strip()):
        generator = opening.open_bundle(args.bundle, backend=name, threads=args.threads)
        backend = opening.models(generator)[args.role]
        if args.role == "draft" and generator.draft is not None:
            generator.target.reset(args.rows)  # a draft on its target's KV needs the target's slots
        fits = [n for n in lengths if n + args.tokens <= backend.max_seq_len] or [0]
        samples = timer.interleave(cases(backend, args.rows, args.tokens, fits), args.rounds)
        one, apart = timer.summarize(samples["one call"]), timer.summarize(samples["one row at a time"])
        lines.append([f"{name} ({generator.backend}) {args.role}", *timer.compared(one, apart)])
        settings[f"specdec {name}"] = opening.describe(generator)
        generator.close()
    run = record.run_record(EXPERIMENT, settings, args.threads, __file__, rows=args.rows, tokens=args.tokens)
    text = (f"{args.rows} rows x {args.tokens} tokens at cache lengths {lengths}: ms (min / median of "
            f"{args.rounds} interleaved rounds)\n\n"
            + tables.markdown(["backend", "one call", "one row at a time", "ratio (min)", "ratio (median)"], lines))
    record.finish(run, args.out, {"rows.md": text}, shown=text)


if __name__ == "__main__":
    main()
