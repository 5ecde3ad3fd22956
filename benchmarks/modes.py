"""Decoding modes end to end, interleaved in one process: target-only decoding and any drafter at any γ, on one bundle
or on several bundles that share a target (drafts of one model), greedy or sampled.

    python benchmarks/modes.py bundles/smollm2-q41 --modes none,model:4,auto:4,prompt_lookup:4
    python benchmarks/modes.py bundles/smollm2-q41-exact bundles/smollm2-q41 --modes none,model:4,model:8 --ignore-eos
    python benchmarks/modes.py bundles/smollm2-q41-head --modes none,head:3 --activations int8   # a trained head
    python benchmarks/modes.py bundles/smollm2-q41 --modes model:4 --temperature 0.8 --top-p 0.95 \
        --couplings leviathan,gumbel                     # what coupling="gumbel" costs in acceptance

A mode is DRAFTER[:γ] (none = target-only; γ defaults to the bundle's). Target-only runs on the first bundle only:
the bundles must share their target (e.g. `specdec calibrate quantize` copies with different drafts). Per prompt,
every (bundle, mode, coupling) takes its turn, the order rotated by one per prompt and repeat.

Each request's ms per token counts its first token (E2E / new tokens); TPOT leaves it out. A mode's figure per
repeat is token-weighted over the prompts; the table gives each repeat, min, median, the speedup of the median over
target-only's median, the acceptance rate and the mean acceptance length.
Checks, greedy: every output equals target-only's. Sampled with coupling gumbel: with one seed, every drafter of a
bundle gives the same tokens. A failed check is written in the table and exits 1. A mode a bundle cannot run (drafter
head on a bundle without a head, a γ past its γ_max) is left out for that bundle, with a line under the table.

Writes modes.md, requests.csv and record.json. A benchmark, not a test: it asserts no timings.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

from harness import opening, record, tables, timer

from specdec.native_record import ACTIVATIONS

EXPERIMENT = "modes"
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Turn:
    bundle: str  # the bundle's label
    drafter: str
    gamma: int | None
    coupling: str

    @property
    def name(self) -> str:
        if self.drafter == "none":
            return "target-only"
        gamma = "" if self.gamma is None else f" γ={self.gamma}"
        coupling = "" if self.coupling == "leviathan" else f" ({self.coupling})"
        return f"{self.bundle} {self.drafter}{gamma}{coupling}"


def plan(labels: list, modes: list, couplings: list) -> list:
    turns = []
    for drafter, gamma in modes:
        if drafter == "none":
            turns.append(Turn(labels[0], "none", None, couplings[0]))
            continue
        turns += [Turn(label, drafter, gamma, coupling) for label in labels for coupling in couplings]
    return list(dict.fromkeys(turns))


def choose_prompts(generator, folder: str, per_class: int, new_tokens: int) -> list:
    """[(prompt id, class, token ids)]: the first `per_class` prompts of each class that fit the bundle."""
    from specdec.bench.prompts import read_prompts, select_prompts
    from specdec.bench.run import prompt_ids

    every = read_prompts(folder)
    ids = prompt_ids(generator, every)
    room = generator.manifest.target.max_seq_len - new_tokens - 1
    chosen = select_prompts(every, {k: len(v) for k, v in ids.items()}, per_class, room)
    return [(p.id, p.cls, ids[p.id]) for p in chosen]


def turn_config(turn: Turn, args, seed: int = 0):
    from specdec.runtime.config import GenerationConfig

    return GenerationConfig(max_new_tokens=args.new_tokens, drafter=turn.drafter, gamma=turn.gamma,
                            temperature=args.temperature, top_p=args.top_p, seed=seed, coupling=turn.coupling,
                            eos_token_ids=() if args.ignore_eos else None)


def runnable(generators: dict, turns: list, args) -> tuple[list, list]:
    """(the turns each bundle can run, a sentence for each it cannot: a drafter it lacks, a γ past its γ_max), so
    that one bundle without a head does not stop a run of several."""
    from specdec.runtime.config import OptionError

    kept, skipped = [], []
    for turn in turns:
        try:
            generators[turn.bundle].requests.check(turn_config(turn, args))
        except OptionError as exc:
            skipped.append(f"{turn.name}: not run ({exc.message})")
            continue
        kept.append(turn)
    return kept, skipped


def request(generator, turn: Turn, ids: list, args, seed: int) -> dict:
    config = turn_config(turn, args, seed)
    result, elapsed = timer.timed(lambda: generator.generate(ids, config))
    stats, new = result.stats, len(result.token_ids)
    return {"turn": turn.name, "new_tokens": new, "e2e_s": elapsed, "ttft_s": stats.first_token_s,
            "proposed": stats.proposed, "accepted": stats.accepted, "verify_passes": stats.verify_passes,
            "finish_reason": result.finish_reason, "token_ids": " ".join(map(str, result.token_ids))}


def run(generators: dict, turns: list, prompts: list, args) -> list:
    rows = []
    for turn in turns:  # warm-up, not recorded
        request(generators[turn.bundle], turn, prompts[0][2], argparse.Namespace(**{**vars(args), "new_tokens": 8}), 0)
    for repeat in range(args.repeats):
        for index, (pid, cls, ids) in enumerate(prompts):
            for turn in timer.rotated(turns, repeat * len(prompts) + index):
                row = request(generators[turn.bundle], turn, ids, args, args.seed + index)
                rows.append({"repeat": repeat, "prompt_id": pid, "cls": cls, **row})
    return rows


def checks(rows: list, turns: list, greedy: bool) -> list:
    """Failed checks, as sentences (empty: all held)."""
    failed = []
    if greedy:
        plain = {(r["repeat"], r["prompt_id"]): r["token_ids"] for r in rows if r["turn"] == "target-only"}
        if plain:
            bad = {r["turn"] for r in rows
                   if plain.get((r["repeat"], r["prompt_id"]), r["token_ids"]) != r["token_ids"]}
            failed += [f"{name}: greedy output differs from target-only" for name in sorted(bad)]
    else:
        gumbel = [t for t in turns if t.coupling == "gumbel"]
        for bundle in dict.fromkeys(t.bundle for t in gumbel):
            names = {t.name for t in gumbel if t.bundle == bundle}
            seen = {}
            for r in rows:
                if r["turn"] in names:
                    seen.setdefault((r["repeat"], r["prompt_id"]), set()).add(r["token_ids"])
            if any(len(tokens) > 1 for tokens in seen.values()):
                failed.append(f"{bundle}: coupling gumbel gave different tokens across drafters for one seed")
    return failed


def summary(rows: list, turns: list, repeats: int) -> list:
    def per_repeat(name: str, repeat: int) -> float:
        mine = [r for r in rows if r["turn"] == name and r["repeat"] == repeat]
        return 1e3 * sum(r["e2e_s"] for r in mine) / max(1, sum(r["new_tokens"] for r in mine))

    plain = [t for t in turns if t.drafter == "none"]
    base = timer.summarize([per_repeat(plain[0].name, k) for k in range(repeats)]).median if plain else None
    out = []
    for turn in turns:
        ms = [per_repeat(turn.name, k) for k in range(repeats)]
        mine = [r for r in rows if r["turn"] == turn.name]
        proposed, accepted = sum(r["proposed"] for r in mine), sum(r["accepted"] for r in mine)
        passes = sum(r["verify_passes"] for r in mine)
        spread = timer.summarize(ms)
        out.append({"mode": turn.name, "ms_per_token": " / ".join(f"{m:.2f}" for m in ms), "min": spread.min,
                    "median": spread.median, "tpot_ms": 1e3 * timer.token_weighted_tpot(mine),
                    "speedup": base / spread.median if base else None,
                    "acceptance": accepted / proposed if proposed else None,
                    "mean_acceptance_length": sum(r["new_tokens"] for r in mine) / passes if passes else None})
    return out


def table(lines: list, prompts: int, args, failed: list, skipped: list = ()) -> str:
    fmt = lambda value, pattern: "–" if value is None else pattern.format(value)  # noqa: E731
    rows = [[s["mode"], s["ms_per_token"], f"{s['min']:.2f}", f"{s['median']:.2f}", f"{s['tpot_ms']:.2f}",
             fmt(s["speedup"], "{:.2f}×"), fmt(s["acceptance"], "{:.3f}"), fmt(s["mean_acceptance_length"], "{:.2f}")]
            for s in lines]
    head = (f"{prompts} prompts × at most {args.new_tokens} tokens, temperature {args.temperature}, "
            f"{'EOS ignored' if args.ignore_eos else 'EOS ends a request'}, {args.repeats} interleaved repeats.\n\n")
    body = tables.markdown(["mode", "ms/token per repeat (first token included)", "min", "median", "TPOT ms",
                            "speedup (medians)", "acceptance", "mean acc. len"], rows)
    verdict = "\n".join(f"- check failed: {f}" for f in failed) if failed else "- every check held"
    return head + body + "\n" + verdict + "\n" + "".join(f"- {s}\n" for s in skipped)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundles", nargs="+")
    parser.add_argument("--modes", default="none,model,auto,prompt_lookup", help="DRAFTER[:γ] items")
    parser.add_argument("--couplings", default="leviathan", help="leviathan and/or gumbel (sampled requests)")
    parser.add_argument("--prompts", default=str(HERE / "prompts"))
    parser.add_argument("--per-class", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="prompt i of a sampled run uses seed + i")
    parser.add_argument("--ignore-eos", action="store_true", help="every request makes --new-tokens tokens")
    opening.add_common(parser)
    parser.add_argument("--activations", choices=ACTIVATIONS, default=None,
                        help="the native target's activations (default: the bundle's)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    modes = opening.parse_modes(args.modes)
    couplings = [c.strip() for c in args.couplings.split(",") if c.strip()]
    if not modes or not couplings or any(c not in ("leviathan", "gumbel") for c in couplings):
        raise SystemExit(f"need modes and couplings from leviathan, gumbel; got {args.modes!r}, {args.couplings!r}")
    labels = [Path(b).name if [Path(x).name for x in args.bundles].count(Path(b).name) == 1 else b
              for b in args.bundles]
    with contextlib.ExitStack() as stack:
        generators = {label: stack.enter_context(opening.open_bundle(bundle, args.backend, args.threads,
                                                                     activations=args.activations))
                      for label, bundle in zip(labels, args.bundles)}
        settings = {label: opening.describe(g) | {"threads": args.threads, "activations": str(g.activations)}
                    for label, g in generators.items()}
        run_record = record.run_record(EXPERIMENT, settings, args.threads, __file__, argv, modes=args.modes,
                                       temperature=args.temperature, repeats=args.repeats)
        prompts = choose_prompts(generators[labels[0]], args.prompts, args.per_class, args.new_tokens)
        turns, skipped = runnable(generators, plan(labels, modes, couplings), args)
        if not turns:
            raise SystemExit("no mode can run on these bundles:\n" + "\n".join(skipped))
        rows = run(generators, turns, prompts, args)
    failed = checks(rows, turns, args.temperature == 0)
    text = table(summary(rows, turns, args.repeats), len(prompts), args, failed, skipped)
    record.finish(run_record, args.out, {"modes.md": text, "requests.csv": rows}, shown=text, checks_failed=failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
