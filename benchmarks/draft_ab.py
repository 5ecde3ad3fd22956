"""Drafts of one target, end to end, interleaved in one process: target-only decoding, then each bundle's model
drafter, repeat after repeat, over the same prompts (greedy, EOS ignored, so every request makes the same tokens).

    python benchmarks/draft_ab.py BUNDLE [BUNDLE ...] [--gammas 4,8] [--repeats 3] [--per-class 2]
        [--new-tokens 128] [--out FILE.md]

The bundles must share their target (e.g. `specdec calibrate quantize` copies of one bundle with different drafts);
target-only decoding runs on the first. Every speculative output is checked to be identical to target-only's.
Prints (and writes with --out) a markdown table: milliseconds per generated token with TTFT included (each repeat,
min, median), the speedup of the median over target-only's median, and the acceptance rate. Not a test: the machine
is shared, so read the ratios within one run.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from specdec.bench.prompts import read_prompts
from specdec.runtime import load
from specdec.runtime.config import GenerationConfig


def prompts(folder: Path, per_class: int) -> list:
    """Prompts 6, 7, ... of each class (the ones the issue's measurements used), as (text, chat)."""
    every = read_prompts(folder)
    chosen = []
    for cls in dict.fromkeys(p.cls for p in every):
        chosen += [(p.text, p.chat) for p in every if p.cls == cls][5:5 + per_class]
    return chosen


def run(generator, chosen: list, drafter: str, gamma: int, new_tokens: int) -> tuple:
    """-> (ms per token, proposed, accepted, outputs) over the prompts."""
    started, made, proposed, accepted, outputs = time.perf_counter(), 0, 0, 0, []
    for text, chat in chosen:
        config = GenerationConfig(max_new_tokens=new_tokens, drafter=drafter, gamma=gamma, chat=chat,
                                  eos_token_ids=())
        result = generator.generate(text, config)
        made += len(result.token_ids)
        proposed += result.stats.proposed
        accepted += result.stats.accepted
        outputs.append(result.token_ids)
    return 1000 * (time.perf_counter() - started) / made, proposed, accepted, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundles", nargs="+")
    parser.add_argument("--gammas", default="4,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--per-class", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompts", default=str(Path(__file__).parent / "prompts"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gammas = [int(g) for g in args.gammas.split(",")]
    chosen = prompts(Path(args.prompts), args.per_class)
    generators = [load(bundle) for bundle in args.bundles]
    names = [Path(bundle).name for bundle in args.bundles]
    for generator in generators:  # warm-up: first-call costs out of the measurement
        run(generator, chosen[:1], "model", gammas[0], 8)
    rows = {}  # (name, γ) -> [(ms, proposed, accepted)]
    for repeat in range(args.repeats):
        ms, _, _, reference = run(generators[0], chosen, "none", 1, args.new_tokens)
        rows.setdefault(("target-only", "–"), []).append((ms, 0, 0))
        for gamma in gammas:
            order = list(zip(names, generators))
            order = order[repeat % len(order):] + order[:repeat % len(order)]  # no bundle always first
            for name, generator in order:
                ms, proposed, accepted, outputs = run(generator, chosen, "model", gamma, args.new_tokens)
                if outputs != reference:
                    raise SystemExit(f"{name} at γ = {gamma}: output differs from target-only decoding")
                rows.setdefault((name, gamma), []).append((ms, proposed, accepted))
        print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)
    plain = float(np.median([r[0] for r in rows[("target-only", "–")]]))
    lines = [f"{len(chosen)} prompts × {args.new_tokens} tokens, greedy, EOS ignored, {args.repeats} interleaved "
             "repeats; outputs identical to target-only in every request.", "",
             "| bundle | γ | ms/token per repeat (TTFT included) | min | median | speedup (medians) | acceptance |",
             "|---|---|---|---|---|---|---|"]
    for (name, gamma), values in rows.items():
        ms = [v[0] for v in values]
        proposed, accepted = sum(v[1] for v in values), sum(v[2] for v in values)
        acceptance = f"{accepted / proposed:.3f}" if proposed else "–"
        lines.append(f"| {name} | {gamma} | {' / '.join(f'{m:.1f}' for m in ms)} | {min(ms):.1f} | "
                     f"{np.median(ms):.1f} | {plain / np.median(ms):.2f}× | {acceptance} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
