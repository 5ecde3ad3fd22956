"""Which of llama.cpp's speculative modes is fastest for a model: its n-gram kinds at their documented defaults and at
sizes for short chat answers, and draft-simple with a draft GGUF, each a llama-server of its own
(llamacpp_peer.py: threads = cores, one slot), request by request against plain decoding.

    python -m benchmarks.peers.llamacpp_sweep BUNDLE --per-class 2 --new-tokens 64 --repeats 3

`ngram-mod` is tried only at short sizes and with care: its hash pool is shared by every request of a server, so a
repeated prompt replays the earlier answer (acceptance 1.0 from the second repeat on). Read its rows as an upper
bound; the kinds compared for lockstep's `ngram` keep their state per request.

The bundle gives the prompts' token ids (its tokenizer and chat template, as lockstep.py sends them); the GGUF is
--model (default: the default model's Q4_1). Per prompt every mode takes its turn, rotated by one per prompt, after a
warm-up; greedy, EOS ignored, no prompt cache. Writes sweep.md (per mode: each prompt's least disturbed TPOT over the
repeats, averaged, and the median over prompts of its ratio to plain decoding's; the token-weighted TPOT of every
request; median TTFT; acceptance; agreement with plain decoding's output), requests.csv and record.json under
benchmarks/results/llamacpp-sweep/<date>-<commit>/ or --out. The winner is llamacpp_peer.BEST_NGRAM's to set (by
hand: a measured choice, written in docs/benchmarking.md). No assertions (not a test).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from pathlib import Path

from benchmarks.harness import opening, record, tables, timer
from benchmarks.peers import llamacpp_peer as lc

EXPERIMENT = "llamacpp-sweep"


def candidates(draft: Path, draft_max: int) -> list:
    """The modes tried: plain; each n-gram kind at its docs' defaults and at short sizes; draft-simple."""
    return [lc.Plain(),
            lc.NGram("ngram-simple"), lc.NGram("ngram-simple", 3, 4), lc.NGram("ngram-simple", 2, 4),
            lc.NGram("ngram-simple", 3, 8), lc.NGram("ngram-map-k", 3, 4), lc.NGram("ngram-map-k4v", 3, 4),
            lc.NGramMod(4, 1, 4), lc.Draft(draft, n_max=draft_max)]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", help="a specdec bundle of the same tokenizer (its chat template gives the ids)")
    parser.add_argument("--model", default=None, help="the GGUF (default: the default model's Q4_1)")
    parser.add_argument("--draft", default=None, help="draft-simple's GGUF (default: the default model's Q4_1)")
    parser.add_argument("--draft-max", type=int, default=3, help="draft-simple's --spec-draft-n-max (default 3)")
    parser.add_argument("--prompts", default=str(Path(__file__).resolve().parents[1] / "prompts"))
    parser.add_argument("--per-class", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--pause", type=float, default=0.05, help="seconds between requests")
    opening.add_out(parser)
    return parser.parse_args(argv)


def prompt_ids(bundle: str, folder: str, per_class: int) -> tuple[list, dict]:
    from specdec.bench.prompts import read_prompts, select_prompts
    from specdec.bench.run import prompt_ids as ids_of

    with opening.open_bundle(bundle, "onnxruntime") as generator:
        every = read_prompts(folder)
        ids = ids_of(generator, every)
    prompts = select_prompts(every, {k: len(v) for k, v in ids.items()}, per_class, 1 << 30)
    return prompts, ids


def summarize(rows: list, plain_name: str) -> list:
    """Per mode: TPOT (ms) of each prompt's least disturbed repeat (its min), averaged over prompts, and the median
    over prompts of plain's over the mode's (speedup); the token-weighted mean of every request beside them (it
    carries the machine's disturbances); median TTFT; drafts, acceptance; outputs identical to plain's."""
    best = {}
    for r in rows:
        key = (r["mode"], r["prompt_id"])
        best[key] = min(best.get(key, float("inf")), r["tpot_s"])
    out = []
    base = {(r["prompt_id"], r["repeat"]): r["token_ids"] for r in rows if r["mode"] == plain_name}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        prompts = list(dict.fromkeys(r["prompt_id"] for r in mine))
        proposed = sum(r["proposed"] or 0 for r in mine)
        accepted = sum(r["accepted"] or 0 for r in mine)
        out.append(dict(
            mode=mode, requests=len(mine), tpot_min_ms=1e3 * statistics.mean(best[mode, p] for p in prompts),
            speedup=statistics.median(best[plain_name, p] / best[mode, p] for p in prompts),
            tpot_weighted_ms=1e3 * sum(r["e2e_s"] - r["ttft_s"] for r in mine) / sum(r["new_tokens"] - 1 for r in mine),
            ttft_ms=1e3 * statistics.median(r["ttft_s"] for r in mine), proposed=proposed,
            acceptance=accepted / proposed if proposed else None,
            identical_to_plain=sum(r["token_ids"] == base.get((r["prompt_id"], r["repeat"])) for r in mine)))
    return out


def markdown(summary: list) -> str:
    rows = [[s["mode"], s["requests"], f"{s['tpot_min_ms']:.2f}", f"{s['speedup']:.3f}",
             f"{s['tpot_weighted_ms']:.2f}", f"{s['ttft_ms']:.0f}", s["proposed"],
             "–" if s["acceptance"] is None else f"{s['acceptance']:.2f}", s["identical_to_plain"]] for s in summary]
    return tables.markdown(["mode", "requests", "TPOT ms (per prompt min, mean)", "speedup vs plain (median)",
                            "TPOT ms (all requests, token-weighted)", "TTFT ms (median)", "drafted", "acceptance",
                            "identical to plain"], rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    model = Path(args.model) if args.model else lc.default_gguf()
    modes = candidates(Path(args.draft) if args.draft else lc.default_gguf(), args.draft_max)
    prompts, ids = prompt_ids(args.bundle, args.prompts, args.per_class)
    settings = {spec.name: lc.ServerSettings(model, spec) for spec in modes}
    run = record.run_record(EXPERIMENT, {n: s.describe() for n, s in settings.items()}, lc.cores(), __file__, argv,
                            prompts=len(prompts), new_tokens=args.new_tokens, repeats=args.repeats, ignore_eos=True,
                            load_average_start=os.getloadavg(), niceness=os.nice(0))
    module = "python -m benchmarks.peers.llamacpp_sweep"  # how it runs: it imports benchmarks.harness
    run["command"] = run["command"].replace("python benchmarks/peers/llamacpp_sweep.py", module)
    rows = []
    with contextlib.ExitStack() as stack:
        folder = lc.peers_dir() / "llama.cpp"
        servers = {n: stack.enter_context(lc.LlamaServer(s, log=folder / f"sweep-{i}.log"))
                   for i, (n, s) in enumerate(settings.items())}
        for server in servers.values():
            server.complete(ids[prompts[0].id], 8)  # warm-up
        turn = 0
        for repeat in range(args.repeats):
            for prompt in prompts:
                for name in timer.rotated(list(servers), turn):
                    time.sleep(args.pause)
                    done = servers[name].complete(ids[prompt.id], args.new_tokens)
                    rows.append(lc.record(settings[name], done, prompt.id, prompt.cls, repeat, ids[prompt.id]))
                turn += 1
            print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)
    summary = summarize(rows, lc.Plain().name)
    requests = [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]
    record.finish(run, args.out, {"sweep.md": markdown(summary), "requests.csv": requests}, shown=markdown(summary),
                  summary=summary, load_average_end=os.getloadavg())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
