"""What coupling="gumbel" costs in acceptance against Leviathan's rule, on one bundle (a benchmark, not a test).

    python benchmarks/coupling.py bundles/smollm2-q41 --per-class 2 --new-tokens 64 --out benchmarks/results/coupling

Sampled requests (temperature 0.8, top-p 0.95 by default) with the model drafter at the bundle's γ, the two
couplings taken in turn on the same prompts and seeds: acceptance rate, mean acceptance length and ms per token.
It also checks the point of the gumbel coupling: the same seed gives the same tokens with drafter model, auto,
prompt_lookup and none.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from specdec.bench.prompts import read_prompts
from specdec.runtime import GenerationConfig, load


def run(gen, prompts, coupling: str, drafter: str, args, seed: int):
    config = GenerationConfig(max_new_tokens=args.new_tokens, temperature=args.temperature, top_p=args.top_p,
                              seed=seed, drafter=drafter, coupling=coupling, chat=True, eos_token_ids=())
    return [gen.generate(p.text, config) for p in prompts]


def summary(results) -> dict:
    proposed = sum(r.stats.proposed for r in results)
    accepted = sum(r.stats.accepted for r in results)
    passes = sum(r.stats.verify_passes for r in results)
    tokens = sum(len(r.token_ids) for r in results)
    ms = [1e3 * (r.stats.total_s - r.stats.prefill_s) / max(1, len(r.token_ids)) for r in results]
    return {"acceptance_rate": round(accepted / max(1, proposed), 3),
            "mean_acceptance_length": round((accepted + passes) / max(1, passes), 2),
            "ms_per_token_median": round(statistics.median(ms), 1), "tokens": tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle")
    parser.add_argument("--prompts", default="benchmarks/prompts")
    parser.add_argument("--per-class", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/coupling")
    args = parser.parse_args()
    by_class = {}
    for prompt in read_prompts(args.prompts):
        by_class.setdefault(prompt.cls, []).append(prompt)
    prompts = [p for group in by_class.values() for p in group[: args.per_class]]
    results = {"leviathan": [], "gumbel": []}
    with load(args.bundle) as gen:
        gen.generate("Hello", GenerationConfig(max_new_tokens=4))  # warm-up
        for repeat in range(args.repeats):
            for coupling in results:  # interleaved
                results[coupling] += run(gen, prompts, coupling, "model", args, seed=repeat)
        same = {d: [r.token_ids for r in run(gen, prompts, "gumbel", d, args, 0)] for d in ("none", "auto", "prompt_lookup")}
    model_tokens = [r.token_ids for r in results["gumbel"][: len(prompts)]]
    report = {"bundle": args.bundle, "prompts": len(prompts), "new_tokens": args.new_tokens,
              "temperature": args.temperature, "top_p": args.top_p, "repeats": args.repeats,
              **{c: summary(r) for c, r in results.items()},
              "gumbel_same_tokens_across_drafters": all(t == model_tokens for t in same.values())}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "coupling.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
