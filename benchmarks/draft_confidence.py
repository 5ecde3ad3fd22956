"""Would stopping a draft at its first unsure token pay? The draft's top-1 probability against whether its token
is the target's, and greedy rounds replayed with fixed γ and with confidence-stopped drafting.

    python benchmarks/draft_confidence.py bundles/smollm2-q41 --per-class 4 --continue 128

1. Teacher-forced over the benchmark prompts extended by the target's greedy continuation (as
   draft_agreement.py): at each continuation position, the draft's top-1 probability and whether its argmax is
   the target's. (The draft here runs over its own KV; in decoding it takes the target's committed KV.)
2. Timed on this machine (min over interleaved calls at --cache-len): the target's pass of T = 1..γ_max+1 tokens,
   r(T) = its time over T = 1's, and the draft's one-token step, c = its time over the target's T = 1.
3. Greedy rounds replayed along each continuation: fixed γ drafts γ tokens; confidence-stopped drafting drafts
   until a token's top-1 probability falls below τ (that token still goes to the verify pass) or γ_max is reached.
   A round yields its accepted tokens + 1 and costs k·c + r(k+1) for k drafts; the table gives tokens / cost, the
   predicted speedup over plain decoding.

Prints markdown; no assertions (not a test).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from draft_agreement import add_prompt_args, continuations
from specdec.manifest import read_manifest
from specdec.runtime.ort_backend import OrtBackend

THRESHOLDS = (0.3, 0.5, 0.7, 0.9)


def observe(target, draft, sequences: list) -> tuple:
    """-> (match [N] bool, confidence [N]) over every continuation position."""
    match, confidence = [], []
    for seq, start in sequences:
        feeds = np.array([seq], dtype=np.int64)
        logits = []
        for backend in (target, draft):
            backend.reset(1)
            logits.append(backend.forward(feeds, np.zeros(1, np.int64))[0][start - 1:])
        shifted = logits[1] - logits[1].max(-1, keepdims=True)
        probs = np.exp(shifted)
        confidence.append(probs.max(-1) / probs.sum(-1))
        match.append(logits[0].argmax(-1) == logits[1].argmax(-1))
    return match, confidence


def costs(target, draft, cache_len: int, widths: int, calls: int) -> tuple:
    """-> (r [widths] for T = 1..widths, c), from minima over interleaved calls."""
    for backend in (target, draft):
        backend.reset(1)
        backend.forward(np.full((1, cache_len), 5, np.int64), np.zeros(1, np.int64), last_only=True)
    best = {}
    for _ in range(calls):
        for key, backend, width in [("draft", draft, 1)] + [(t, target, t) for t in range(1, widths + 1)]:
            started = time.perf_counter()
            backend.forward(np.full((1, width), 7, np.int64), np.array([cache_len]))
            best[key] = min(best.get(key, np.inf), time.perf_counter() - started)
    one = best[1]
    return np.array([best[t] / one for t in range(1, widths + 1)]), best["draft"] / one


def replay(match: list, confidence: list, gamma_max: int, threshold: float, r: np.ndarray, c: float) -> float:
    """Predicted speedup of greedy rounds along the continuations (tokens per target-pass unit of cost)."""
    tokens = cost = 0.0
    for hit, sure in zip(match, confidence):
        i, n = 0, len(hit) - 1
        while i < n:
            k = 0
            while k < gamma_max and i + k < n:
                k += 1
                if sure[i + k - 1] < threshold:
                    break
            accepted = 0
            while accepted < k and hit[i + accepted]:
                accepted += 1
            tokens += accepted + 1
            cost += k * c + r[k]
            i += accepted + 1
    return tokens / cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    add_prompt_args(parser, per_class=4, steps=128)
    parser.add_argument("--gammas", default="2,3,4,6,8,10")
    parser.add_argument("--cache-len", type=int, default=200)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    gammas = [int(g) for g in args.gammas.split(",")]
    manifest = read_manifest(args.bundle)
    target = OrtBackend(args.bundle, manifest.target).open()
    draft = OrtBackend(args.bundle, manifest.draft).open()
    sequences = continuations(target, args.bundle, args)
    match, confidence = observe(target, draft, sequences)
    r, c = costs(target, draft, args.cache_len, max(gammas) + 1, args.calls)
    hits, sure = np.concatenate(match), np.concatenate(confidence)
    print(f"**{args.bundle.name}**: {len(sequences)} prompts, {hits.size} continuation positions, top-1 agreement "
          f"{hits.mean():.3f}\n")
    print("| draft's top-1 probability | share of positions | agreement |\n|---|---|---|")
    edges = (0.0, 0.3, 0.5, 0.7, 0.9, 0.97, 1.01)
    for low, high in zip(edges, edges[1:]):
        inside = (sure >= low) & (sure < high)
        if inside.any():
            print(f"| {low:.2f}–{min(high, 1.0):.2f} | {inside.mean():.3f} | {hits[inside].mean():.3f} |")
    print(f"\nCosts at cache length {args.cache_len} (min of {args.calls} interleaved calls): c = {c:.3f}; r(T) for "
          f"T = 1..{len(r)}: " + " ".join(f"{x:.2f}" for x in r) + "\n")
    print("| γ (γ_max) | fixed γ | " + " | ".join(f"stop below {t}" for t in THRESHOLDS) + " |")
    print("|---" * (len(THRESHOLDS) + 2) + "|")
    for gamma in gammas:
        cells = [replay(match, confidence, gamma, 0.0, r, c)] + [replay(match, confidence, gamma, t, r, c)
                                                                  for t in THRESHOLDS]
        print(f"| {gamma} | " + " | ".join(f"{x:.2f}×" for x in cells) + " |")


if __name__ == "__main__":
    main()
