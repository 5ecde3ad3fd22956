"""A draft's quality against its target, teacher-forced over the benchmark prompts: top-1 agreement, and two
questions about drafts one could build (stop drafting at an unsure token; skip a layer of the target).

    python benchmarks/draft_quality.py bundles/smollm2-q41 [MORE BUNDLES] [--kv own|target] [--backend native]
    python benchmarks/draft_quality.py bundles/smollm2-q41 --confidence --per-class 4 --continue 128
    python benchmarks/draft_quality.py bundles/smollm2-q41 --layer-skip --per-class 2 --continue 96   # [export]
    python benchmarks/draft_quality.py bundles/smollm2-q41-head --head --prompts benchmarks/head_prompts \
        --head-gammas 1,2,3,4,5,6 --continue 128 --temperatures 0,0.7

Each prompt (chat template applied, as the suite sends it) is extended by the target's own greedy continuation of
--continue tokens, where acceptance is decided; then target and draft score every position.

Agreement (default): the share of positions whose draft argmax is the target's, over every position and over those
from the prompt's last token on (the only ones where a draft proposes). --kv own: the draft reads its own KV (one
prefill), a draft alone; --kv target: for each position it reads the target's KV of the positions before, as it does
when it proposes a round's first token.
--confidence: the draft's top-1 probability against whether its token is the target's, then greedy rounds replayed
along the continuations with fixed γ and with drafting stopped below a probability τ, each round costed with this
machine's c (draft step / target step) and r(T) (a T-token pass / a step), timed interleaved at --cache-len.
--layer-skip: the source model (PyTorch) without layer i against the full model, for every i: what a draft that
skips one layer would agree. Needs the [export] extra and the bundle's source model on this machine.
--head: the bundle's trained draft head, decoding for real (drafter="head", rows of --head-rows prompts a request,
--continue new tokens each) at each γ of --head-gammas and each temperature of --temperatures: acceptance at each
draft position, the acceptance rate and tokens per verify pass (the mean acceptance length); greedy runs are checked
equal to target-only decoding; the record holds the training run's summary where its work folder is beside the
bundle. Acceptance, not speed: benchmarks/modes.py --modes none,head:3 times it.

Writes quality.md and record.json. A benchmark, not a test: it asserts nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import numpy as np

from harness import opening, record, tables, timer

EXPERIMENT = "draft-quality"
HERE = Path(__file__).resolve().parent
THRESHOLDS = (0.3, 0.5, 0.7, 0.9)


def prompt_ids(generator, folder: Path, per_class: int) -> list:
    from specdec.bench.prompts import read_prompts
    from specdec.bench.run import chat_ids

    every, seen, out = read_prompts(folder), {}, []
    for prompt in every:
        seen[prompt.cls] = seen.get(prompt.cls, 0) + 1
        if not per_class or seen[prompt.cls] <= per_class:
            out.append(chat_ids(generator, prompt.text) if prompt.chat else generator.codec.encode(prompt.text))
    return out


def continued(target, ids: list, steps: int) -> list:
    """ids + the target's greedy continuation of `steps` tokens (fewer where S ends first)."""
    steps = min(steps, target.max_seq_len - len(ids))
    target.reset(1)
    logits = target.forward(np.array([ids], dtype=np.int64), np.zeros(1, np.int64), last_only=True)  # [1, 1, V]
    out = list(ids)
    for _ in range(steps):
        out.append(int(logits[0, -1].argmax()))
        if len(out) == target.max_seq_len:
            break
        logits = target.forward(np.array([[out[-1]]], dtype=np.int64), np.array([len(out) - 1]))
    return out


def sequences(generator, args) -> list:
    """[(prompt + continuation ids, prompt length)] of the prompts that leave room for a continuation."""
    target = generator.target.backend
    fitting = [ids for ids in prompt_ids(generator, args.prompts, args.per_class) if len(ids) < target.max_seq_len]
    if not fitting:
        raise SystemExit(f"no prompt fits the bundle's S = {target.max_seq_len}")
    return [(continued(target, ids, args.steps), len(ids)) for ids in fitting]


def prefill_argmax(backend, feeds: np.ndarray) -> np.ndarray:
    """The model's argmax at each position of feeds [1, n], one prefill over its own KV -> [n]."""
    backend.reset(1)
    return backend.forward(feeds, np.zeros(1, np.int64))[0].argmax(-1)


def first_proposals(target, draft, feeds: np.ndarray) -> tuple:
    """(the target's argmax per position of feeds [1, n]; the draft's, each over the target's KV before it)."""
    draft.reset(1)  # before the target's prefill: a draft sharing the target's KV resets it too
    want = prefill_argmax(target, feeds)
    got = []
    for t in range(feeds.shape[1]):
        if t:
            draft.copy_kv(target, 0, t - 1, t)
        got.append(int(draft.forward(feeds[:, t:t + 1], np.array([t]))[0, -1].argmax()))
        target.forward(feeds[:, t:t + 1], np.array([t]))  # position t's KV: the target's again
    return want, np.array(got)


def agreement(generator, seqs: list, kv: str) -> dict:
    """{"all": (agreeing, positions), "generated": (agreeing, positions)}."""
    target, draft = generator.target.backend, generator.draft.backend
    if kv == "target" and not draft.takes_kv_from(target):
        raise SystemExit(f"this draft ({draft.name}) cannot read the target's KV; use --kv own")
    counts = {"all": [0, 0], "generated": [0, 0]}
    for seq, start in seqs:
        feeds = np.array([seq], dtype=np.int64)  # [1, n]
        if kv == "target":
            want, got = first_proposals(target, draft, feeds)
        else:
            want, got = prefill_argmax(target, feeds), prefill_argmax(draft, feeds)
        for name, hits in (("all", want == got), ("generated", (want == got)[start - 1:])):
            counts[name][0] += int(hits.sum())
            counts[name][1] += len(hits)
    return {name: tuple(pair) for name, pair in counts.items()}


def agreement_row(name: str, generator, counts: dict, kv: str) -> list:
    draft = generator.manifest.draft
    method = draft.calibration.method or draft.derived or "export"
    cells = [x for agree, total in counts.values() for x in (total, f"{agree / total:.4f}")]
    return [name, f"{method} ({draft.precision}), {generator.backend}", kv, *cells]


# --- --confidence ---------------------------------------------------------------------------------------------------

def observe(target, draft, seqs: list) -> tuple:
    """([match per continuation position], [the draft's top-1 probability there]) per sequence."""
    match, confidence = [], []
    for seq, start in seqs:
        feeds = np.array([seq], dtype=np.int64)
        logits = []
        for backend in (target, draft):
            backend.reset(1)
            logits.append(backend.forward(feeds, np.zeros(1, np.int64))[0][start - 1:])  # [n − start + 1, V]
        shifted = np.exp(logits[1] - logits[1].max(-1, keepdims=True))
        confidence.append(shifted.max(-1) / shifted.sum(-1))
        match.append(logits[0].argmax(-1) == logits[1].argmax(-1))
    return match, confidence


def costs(target, draft, cache_len: int, widths: int, rounds: int) -> tuple:
    """(r[T] for T = 1..widths, c): minima over interleaved calls, each over the target's one-token step."""
    for backend in (target, draft):
        backend.reset(1)
    cases = {"draft": lambda: draft.forward(np.full((1, 1), 7, np.int64), np.array([cache_len]))}
    for t in range(1, widths + 1):
        cases[t] = lambda t=t: target.forward(np.full((1, t), 7, np.int64), np.array([cache_len]))
    best = {k: min(v) for k, v in timer.interleave(cases, rounds=rounds).items()}
    return np.array([best[t] / best[1] for t in range(1, widths + 1)]), best["draft"] / best[1]


def replay(match: list, confidence: list, gamma_max: int, threshold: float, r: np.ndarray, c: float) -> float:
    """Predicted speedup of greedy rounds along the continuations: tokens per unit of cost (a step = 1)."""
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
    return tokens / cost if cost else float("nan")


def confidence_text(generator, seqs: list, args) -> str:
    target, draft = generator.target.backend, generator.draft.backend
    gammas = [int(g) for g in args.gammas.split(",")]
    widths = min(max(gammas) + 1, target.max_seq_len - args.cache_len)
    gammas = [g for g in gammas if g + 1 <= widths]
    match, confidence = observe(target, draft, seqs)
    r, c = costs(target, draft, args.cache_len, widths, args.rounds)
    hits, sure = np.concatenate(match), np.concatenate(confidence)
    edges = (0.0, 0.3, 0.5, 0.7, 0.9, 0.97, 1.01)
    bins = [[f"{lo:.2f}–{min(hi, 1.0):.2f}", f"{((sure >= lo) & (sure < hi)).mean():.3f}",
             f"{hits[(sure >= lo) & (sure < hi)].mean():.3f}"] for lo, hi in zip(edges, edges[1:])
            if ((sure >= lo) & (sure < hi)).any()]
    rows = [[g] + [f"{replay(match, confidence, g, t, r, c):.2f}×" for t in (0.0, *THRESHOLDS)] for g in gammas]
    return (f"{len(seqs)} prompts, {hits.size} continuation positions, top-1 agreement {hits.mean():.3f}\n\n"
            + tables.markdown(["draft's top-1 probability", "share of positions", "agreement"], bins)
            + f"\nCosts at cache length {args.cache_len} (min of {args.rounds} interleaved calls): c = {c:.3f}; "
            + "r(T), T = 1..: " + " ".join(f"{x:.2f}" for x in r) + "\n\n"
            + tables.markdown(["γ (γ_max)", "fixed γ"] + [f"stop below {t}" for t in THRESHOLDS], rows))


# --- --layer-skip ---------------------------------------------------------------------------------------------------

def layer_skip_text(generator, seqs: list) -> str:
    import os

    import torch

    from specdec.export.sources import ModelSource, load_model

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    source = generator.manifest.target.source
    model = load_model(ModelSource(source.kind, Path(source.path), source.gguf_file, source.name), torch.float32)
    model.eval()

    def argmaxes() -> list:
        with torch.no_grad():
            return [model(torch.tensor([seq]), use_cache=False).logits[0].argmax(-1).numpy() for seq, _ in seqs]

    full, layers = argmaxes(), list(model.model.layers)
    positions = sum(len(seq) - start + 1 for seq, start in seqs)
    rows = []
    for skipped in range(len(layers)):
        model.model.layers = torch.nn.ModuleList(layers[:skipped] + layers[skipped + 1:])
        model.config.num_hidden_layers = len(layers) - 1
        agree = sum(int((a[start - 1:] == b[start - 1:]).sum()) for a, b, (_, start) in zip(argmaxes(), full, seqs))
        rows.append([skipped, f"{agree / positions:.3f}"])
    model.model.layers = torch.nn.ModuleList(layers)
    model.config.num_hidden_layers = len(layers)
    return (f"{len(seqs)} prompts, {positions} continuation positions, fp32 source model ({len(layers)} layers); "
            "agreement of the model without layer i with the full model\n\n"
            + tables.markdown(["layer left out", "top-1 agreement"], rows))


# --- --head ---------------------------------------------------------------------------------------------------------

def add_stats(total, stats) -> None:
    """Add one request's Stats into `total` (counts and per-position counts)."""
    total.proposed, total.accepted = total.proposed + stats.proposed, total.accepted + stats.accepted
    total.emitted, total.verify_passes = total.emitted + stats.emitted, total.verify_passes + stats.verify_passes
    grow = len(stats.position_proposed) - len(total.position_proposed)
    total.position_proposed += [0] * max(grow, 0)
    total.position_accepted += [0] * max(grow, 0)
    for i, (proposed, accepted) in enumerate(zip(stats.position_proposed, stats.position_accepted)):
        total.position_proposed[i] += proposed
        total.position_accepted[i] += accepted


def head_stats(generator, prompts: list, config, rows: int) -> tuple:
    """(Stats summed over every request, the generated token ids of each prompt): prompts (text, chat) run in
    requests of `rows` prompts of one chat flag."""
    from dataclasses import replace

    from specdec.runtime.state import Stats

    total, outputs = Stats(), {}
    for chat in (False, True):
        chosen = [text for text, flag in prompts if flag is chat]
        for lo in range(0, len(chosen), rows):
            results = generator.run(chosen[lo : lo + rows], replace(config, chat=chat))
            outputs.update({text: result.token_ids for text, result in zip(chosen[lo : lo + rows], results)})
            add_stats(total, results[0].stats)
    return total, outputs


def training_summary(bundle: Path) -> dict | None:
    """The summary of the run that trained the bundle's head (specdec calibrate head --out BUNDLE: its work folder's
    run.json, BUNDLE.head-train/ by default), where it is there."""
    import json

    path = bundle.with_name(bundle.name + ".head-train") / "run.json"
    return json.loads(path.read_text(encoding="utf-8")).get("summary") if path.is_file() else None


def head_text(generator, args) -> tuple[str, dict]:
    """The table of --head and its figures for the record."""
    from specdec.bench.prompts import read_prompts
    from specdec.runtime import GenerationConfig

    if generator.manifest.head is None:
        raise SystemExit("the bundle has no draft head: train one (specdec calibrate head BUNDLE --out OUT)")
    every, seen, prompts = read_prompts(args.prompts), {}, []
    for prompt in every:
        seen[prompt.cls] = seen.get(prompt.cls, 0) + 1
        if not args.per_class or seen[prompt.cls] <= args.per_class:
            prompts.append((prompt.text, prompt.chat))
    gammas = [int(g) for g in args.head_gammas.split(",")]
    rows, figures, plain = [], {}, None
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        if temperature == 0:
            none = GenerationConfig(max_new_tokens=args.steps, temperature=0.0, drafter="none")
            _, plain = head_stats(generator, prompts, none, args.head_rows)
        for gamma in gammas:
            config = GenerationConfig(max_new_tokens=args.steps, temperature=temperature, drafter="head", gamma=gamma,
                                      seed=0)
            stats, outputs = head_stats(generator, prompts, config, args.head_rows)
            same = "–" if temperature else ("yes" if outputs == plain else "NO")
            positions = stats.per_position_acceptance
            rows.append([temperature, gamma, stats.proposed, f"{stats.acceptance_rate:.3f}",
                         f"{stats.mean_acceptance_length:.2f}", " ".join(f"{a:.3f}" for a in positions), same])
            figures[f"t={temperature} γ={gamma}"] = {"acceptance": stats.acceptance_rate,
                                                     "tokens_per_pass": stats.mean_acceptance_length,
                                                     "per_position": positions, "proposed": stats.proposed,
                                                     "greedy_equal": same}
    head = generator.manifest.head
    header = ["temperature", "γ", "drafts", "acceptance", "tokens / verify pass", "acceptance at draft position 1..γ",
              "greedy = target-only"]
    text = (f"{len(prompts)} prompts of {args.prompts.name}/, {args.steps} new tokens each, rows of "
            f"{args.head_rows}; head: {head.draft_vocab_size} draft tokens, layers {head.feature_layers} "
            f"({head.source})\n\n" + tables.markdown(header, rows))
    return text, figures


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundles", nargs="+")
    parser.add_argument("--prompts", type=Path, default=HERE / "prompts")
    parser.add_argument("--per-class", type=int, default=0, help="prompts per class (0: all)")
    parser.add_argument("--continue", dest="steps", type=int, default=64, help="the target's greedy tokens per prompt")
    parser.add_argument("--kv", choices=("own", "target"), default="own", help="the KV the draft reads (agreement)")
    parser.add_argument("--confidence", action="store_true", help="replay rounds stopped at unsure drafts")
    parser.add_argument("--gammas", default="2,3,4,6,8,10", help="γ_max values of --confidence")
    parser.add_argument("--cache-len", type=int, default=200, help="where --confidence times c and r")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved timing rounds of --confidence")
    parser.add_argument("--layer-skip", action="store_true", help="agreement without each layer (PyTorch)")
    parser.add_argument("--head", action="store_true", help="the bundle's draft head's acceptance, decoding for real")
    parser.add_argument("--head-gammas", default="1,2,3,4,5,6", help="γ values of --head")
    parser.add_argument("--head-rows", type=int, default=4, help="prompts a request of --head")
    parser.add_argument("--temperatures", default="0", help="temperatures of --head (0: greedy)")
    opening.add_common(parser)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    header = ["bundle", "draft, backend", "KV read", "positions", "top-1 agreement", "generated positions",
              "top-1 agreement"]
    rows, texts, settings = [], [], {}
    with contextlib.ExitStack() as stack:
        for bundle in args.bundles:
            generator = stack.enter_context(opening.open_bundle(bundle, args.backend, args.threads))
            name = Path(bundle).name
            settings[name] = opening.describe(generator) | {"threads": args.threads}
            if args.head:
                text, figures = head_text(generator, args)
                texts.append(f"**{name}**: the draft head, decoding\n\n" + text)
                settings[name]["head"] = figures
                settings[name]["head_training"] = training_summary(Path(bundle))
                continue
            if generator.draft is None and not args.layer_skip:
                raise SystemExit(f"{bundle} has no draft model; export one (specdec-export) or pass --layer-skip")
            seqs = sequences(generator, args)
            if generator.draft is not None:
                rows.append(agreement_row(name, generator, agreement(generator, seqs, args.kv), args.kv))
            if args.confidence and generator.draft is not None:
                texts.append(f"**{name}**: stopping the draft at an unsure token\n\n"
                             + confidence_text(generator, seqs, args))
            if args.layer_skip:
                texts.append(f"**{name}**: a layer-skipping self-draft\n\n" + layer_skip_text(generator, seqs))
        run = record.run_record(EXPERIMENT, settings, args.threads, __file__, argv, kv=args.kv,
                                continue_tokens=args.steps)
    text = "\n".join(([tables.markdown(header, rows)] if rows else []) + texts)
    record.finish(run, args.out, {"quality.md": text}, shown=text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
