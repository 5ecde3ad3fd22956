"""Soak benchmark (not a test): many generations on one Generator, resident memory sampled as it goes.

    python benchmarks/soak.py bundles/smollm2-q41 --requests 300

Requests cycle through the committed prompt sets and through every drafter, greedy and seeded sampling, batch 1
and 2, streamed and not. RSS (from /proc/self/statm) is read at the start, after the warm-up and every 25 requests
to the end; growth after warm-up is the figure to watch (goal: under 2%). The warm-up gives both models every
shape a request can bring: a prompt of a full prefill chunk (and more) with each drafter at γ_max, and a full batch,
so that memory sized by the largest shapes is already counted in the warm-up figure; after it RSS must stay flat.
Writes soak.md (RSS as it went) and record.json (the figures under "result").
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from harness import opening, record, tables
from specdec.bench.prompts import read_prompts
from specdec.runtime import GenerationConfig

EXPERIMENT = "soak"
HERE = Path(__file__).resolve().parent

DRAFTERS = ("auto", "model", "prompt_lookup", "none")


def rss_mib() -> float:
    with open("/proc/self/statm", encoding="ascii") as handle:
        pages = int(handle.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def request(gen, prompts: list, index: int, tokens: int) -> int:
    """One request, its kind chosen by `index`; -> tokens generated."""
    drafter = DRAFTERS[index % len(DRAFTERS)]
    sampled = index % 3 == 0
    config = GenerationConfig(max_new_tokens=tokens, drafter=drafter, chat=True, temperature=0.8 if sampled else 0.0,
                              seed=index if sampled else None, stop=("\n\n\n",))
    prompt = prompts[index % len(prompts)].text
    if index % 5 == 0:
        return len("".join(gen.stream(prompt, config)))
    if index % 7 == 0:
        return sum(len(r.token_ids) for r in gen.generate([prompt, prompts[(index + 1) % len(prompts)].text], config))
    return len(gen.generate(prompt, config).token_ids)


def warm_up(gen, prompts: list) -> None:
    """Every shape at its largest: full prefill chunks, verify passes of γ_max + 1, the largest batch."""
    defaults, target = gen.manifest.defaults, gen.manifest.target
    long_ids = gen.codec.encode(" ".join(p.text for p in prompts))[: min(target.max_seq_len // 2,
                                                                          2 * defaults.max_prefill_chunk + 7)]
    for drafter in DRAFTERS:
        gen.generate(long_ids, GenerationConfig(max_new_tokens=16, drafter=drafter, gamma=defaults.gamma_max))
    batch = [prompts[i % len(prompts)].text for i in range(target.max_batch)]
    gen.generate(batch, GenerationConfig(max_new_tokens=16, drafter="auto", chat=True, gamma=defaults.gamma_max))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--every", type=int, default=25, help="requests between two RSS samples")
    parser.add_argument("--prompts", default=str(HERE / "prompts"))
    opening.add_common(parser)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    prompts = read_prompts(args.prompts)
    samples, started, produced = [("start", 0, rss_mib())], time.perf_counter(), 0
    with opening.open_bundle(args.bundle, args.backend, args.threads) as gen:
        run = record.run_record(EXPERIMENT, {"specdec": opening.describe(gen) | {"threads": args.threads}},
                                args.threads, __file__, argv, requests=args.requests, new_tokens=args.new_tokens)
        warm_up(gen, prompts)
        samples.append(("warm", 0, rss_mib()))
        for index in range(args.requests):
            produced += request(gen, prompts, index, args.new_tokens)
            if (index + 1) % args.every == 0 or index + 1 == args.requests:
                samples.append(("run", index + 1, rss_mib()))
    warm, end = samples[1][2], samples[-1][2]
    result = {"seconds": round(time.perf_counter() - started, 1), "produced_tokens": produced,
              "rss_start_mib": round(samples[0][2], 1), "rss_after_warmup_mib": round(warm, 1),
              "rss_end_mib": round(end, 1), "growth_after_warmup_pct": round(100 * (end - warm) / warm, 2),
              "samples": [{"kind": k, "after": n, "rss_mib": round(r, 1)} for k, n, r in samples]}
    text = tables.markdown(["after", "requests", "RSS MiB"], [[k, n, f"{r:.1f}"] for k, n, r in samples])
    growth = f"Growth after warm-up: {result['growth_after_warmup_pct']:+.2f} %\n\n"
    record.finish(run, args.out, {"soak.md": growth + text},
                  shown=json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2), result=result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
