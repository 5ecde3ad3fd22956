"""Prompt stall (not a test): how long one client's stream stops while other clients send huge prompts.

    python benchmarks/prompt_stall.py bundles/smollm2-q41 --rounds 3

Serves the bundle in this process (specdec.serving on 127.0.0.1, a free port), streams one completion of --tokens
tokens, and --after seconds into the stream sends --flood concurrent requests of one kind:
- `none`: no other request (the stream's own gaps, the baseline);
- `huge-text`: /v1/completions with a --size-kb prompt (refused by its byte count, never tokenized);
- `bound-text`: /v1/completions with a prompt just under the byte bound S tokens can hold (tokenized by a prompt
  worker, then refused by its token count);
- `huge-chat`: /v1/chat/completions with a --size-kb message (rendered by a prompt worker, stopped at the bound).
Kinds interleave over --rounds (their order rotates). Per kind: the stream's longest gap between two chunks while
the flood is under way (min / median over rounds), and how the flood was answered. Issue 40's goal: the longest gap
<= 0.2 s while four 900 KB prompts arrive. Writes prompt_stall.md and record.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from harness import opening, record, tables, timer

EXPERIMENT = "prompt-stall"
KINDS = ("none", "huge-text", "bound-text", "huge-chat")
STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def _flood_request(url: str, model: str, kind: str, text: str) -> int:
    if kind.endswith("chat"):
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
        path = "/v1/chat/completions"
    else:
        body, path = {"model": model, "prompt": text, "max_tokens": 4}, "/v1/completions"
    return httpx.post(url + path, json=body, timeout=120).status_code


def one_round(url: str, model: str, kind: str, texts: dict, args) -> dict:
    """Stream one completion; `args.after` s in, the flood of `kind`. -> the stream's gaps and the flood's answers."""
    body = {"model": model, "prompt": STORY, "max_tokens": args.tokens, "temperature": 0, "stream": True}
    arrivals, statuses, flood = [], [], {}

    def send_flood():
        started = time.perf_counter()
        with ThreadPoolExecutor(args.flood) as pool:
            statuses.extend(pool.map(lambda _: _flood_request(url, model, kind, texts[kind]), range(args.flood)))
        flood.update(start=started, end=time.perf_counter())

    sender = threading.Timer(args.after, send_flood) if kind != "none" else None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        if sender is not None:
            sender.start()
        for line in response.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())
    if sender is not None:
        sender.join()
    start, end = flood.get("start", arrivals[0] + args.after), flood.get("end", arrivals[-1])
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= start and a <= end]
    return {"chunks": len(arrivals), "longest_gap_s": max(gaps, default=0.0),
            "flood_s": round(end - start, 3) if kind != "none" else None, "statuses": sorted(statuses),
            "gaps_during": len(gaps)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256, help="the stream's max_tokens (default 256)")
    parser.add_argument("--flood", type=int, default=4, help="concurrent huge prompts (default 4)")
    parser.add_argument("--size-kb", type=int, default=900, help="size of a huge prompt (default 900 KB)")
    parser.add_argument("--after", type=float, default=0.3, help="seconds into the stream the flood starts")
    opening.add_common(parser)
    args = parser.parse_args(argv)

    from specdec.serving.options import ServeOptions
    from specdec.serving.server import BackgroundServer

    options = ServeOptions(bundle=str(args.bundle), port=0, backend=args.backend, threads=args.threads,
                           max_body_bytes=(args.size_kb + 64) << 10, verify_files=False)
    with BackgroundServer(options) as server:
        engine = server.app.state.engine
        model = server.app.state.model_name
        bound = getattr(engine.gen.requests, "max_text_bytes", None)  # None: a specdec before the byte bound (an A/B)
        words = ("lorem ipsum dolor sit amet " * (args.size_kb * 40))[: args.size_kb << 10]
        texts = {"huge-text": words, "huge-chat": words,
                 "bound-text": words[: (bound or 82944) - 16]}
        run = record.run_record(EXPERIMENT, {"specdec": {"backend": engine.gen.backend, "threads": args.threads,
                                                         "prompt_workers": getattr(options, "prompt_workers", None),
                                                         "byte_bound": bound}},
                                args.threads, __file__, argv, rounds=args.rounds, tokens=args.tokens,
                                flood=args.flood, size_kb=args.size_kb)
        one_round(server.url, model, "none", texts, args)  # warm-up: the shapes of a stream
        results = {kind: [] for kind in KINDS}
        for index in range(args.rounds):
            for kind in timer.rotated(list(KINDS), index):
                results[kind].append(one_round(server.url, model, kind, texts, args))
                print(kind, json.dumps(results[kind][-1]), flush=True)
    rows, summary = [], {}
    for kind, rounds in results.items():
        gaps = [r["longest_gap_s"] for r in rounds]
        summary[kind] = {"longest_gap_min_s": round(min(gaps), 4), "longest_gap_median_s": round(statistics.median(gaps), 4),
                         "longest_gap_max_s": round(max(gaps), 4), "statuses": rounds[-1]["statuses"],
                         "chunks": [r["chunks"] for r in rounds], "flood_s": [r["flood_s"] for r in rounds]}
        rows.append([kind, f"{1e3 * min(gaps):.0f}", f"{1e3 * statistics.median(gaps):.0f}", f"{1e3 * max(gaps):.0f}",
                     ", ".join(map(str, rounds[-1]["statuses"])) or "-",
                     "-" if kind == "none" else f"{1e3 * statistics.median(r['flood_s'] for r in rounds):.0f}"])
    head = (f"A stream of {args.tokens} tokens on {args.bundle.name}; {args.flood} concurrent prompts of "
            f"{args.size_kb} KB (bound-text: {len(texts['bound-text']) // 1024} KB, under the byte bound of {bound} B) "
            f"sent {args.after} s in; {args.rounds} rounds.\n\n")
    text = head + tables.markdown(["flood", "longest gap min ms", "median ms", "max ms", "flood answered",
                                   "flood took ms"], rows)
    record.finish(run, args.out, {"prompt_stall.md": text}, shown=text, result=summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
