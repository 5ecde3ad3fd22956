"""Shared by the peer scripts (stdlib only: each peer runs in its own virtual environment without specdec).

A peer defines modes as (name, drafter, gamma, note, run) with run(prompt_ids, max_new_tokens) ->
(new token ids, ttft_s, e2e_s, extra dict); this module reads the prompt sets, warms up, runs interleaved repeats
with the mode order rotated per repeat, and writes one JSONL record per request in the table's columns.
A mode that cannot be built is written as one record with status "unsupported" or "failed" and the reason.
"""
from __future__ import annotations

import argparse
import json
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class PeerMode:
    name: str
    drafter: str
    gamma: int
    note: str
    run: Callable | None  # None: not available, `note` says why
    status: str = "ok"


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--bundle", required=True, help="specdec bundle (its tokenizer and chat template are used)")
    parser.add_argument("--models", required=True, help="benchmarks/.peers/models")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--per-class", type=int, default=0)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4, help="layers of the truncated draft copy")
    parser.add_argument("--out", required=True, help="JSONL file to write")
    return parser.parse_args()


def read_prompts(folder: str, per_class: int) -> list:
    """Prompt records of every *.jsonl file (sorted), the first `per_class` of each class (0: all)."""
    prompts = []
    for file in sorted(Path(folder).glob("*.jsonl")):
        lines = [json.loads(line) for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
        prompts += lines
    chosen, seen = [], {}
    for p in prompts:
        seen[p["class"]] = seen.get(p["class"], 0) + 1
        if not per_class or seen[p["class"]] <= per_class:
            chosen.append(p)
    return chosen


def tokenize(bundle: str, prompts: list) -> dict:
    """prompt id -> token ids, with the bundle's tokenizer and chat template (transformers' tokenizer)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bundle)
    ids = {}
    for p in prompts:
        if p.get("chat", True):
            messages = [{"role": "user", "content": p["prompt"]}]
            out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids[p["id"]] = list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
        else:
            ids[p["id"]] = tokenizer.encode(p["prompt"], add_special_tokens=True)
    return ids


def record(system: str, mode: PeerMode, prompt: dict, repeat: int, ids: list, result: tuple) -> dict:
    tokens, ttft, e2e, extra = result
    new = len(tokens)
    row = dict(system=system, mode=mode.name, drafter=mode.drafter, gamma=mode.gamma, note=mode.note, status="ok",
               prompt_id=prompt["id"], cls=prompt["class"], repeat=repeat, seed=0, prompt_tokens=len(ids),
               new_tokens=new, ttft_s=ttft, e2e_s=e2e, tpot_s=(e2e - ttft) / (new - 1) if new > 1 else 0.0,
               tokens_per_s=new / e2e if e2e else 0.0, token_ids=[int(t) for t in tokens])
    row.update(extra)
    return row


def rotated(modes: list, repeat: int) -> list:
    shift = repeat % len(modes)
    return modes[shift:] + modes[:shift]


def run_modes(system: str, modes: list, args: argparse.Namespace) -> int:
    """Warm-up, interleaved repeats, JSONL out. Returns the number of records written."""
    prompts = read_prompts(args.prompts, args.per_class)
    ids = tokenize(args.bundle, prompts)
    records = [dict(system=system, mode=m.name, drafter=m.drafter, gamma=m.gamma, note=m.note, status=m.status)
               for m in modes if m.run is None]
    usable = [m for m in modes if m.run is not None]
    for mode in list(usable):
        try:
            for _ in range(args.warmup):
                mode.run(ids[prompts[0]["id"]], min(8, args.new_tokens))
        except Exception as exc:  # a peer mode that fails is reported, not fatal
            traceback.print_exc()
            records.append(dict(system=system, mode=mode.name, drafter=mode.drafter, gamma=mode.gamma,
                                note=f"{mode.note}; failed: {type(exc).__name__}: {exc}"[:400], status="failed"))
            usable.remove(mode)
    for repeat in range(args.repeats):
        for prompt in prompts:
            for mode in rotated(usable, repeat) if usable else []:
                result = mode.run(ids[prompt["id"]], args.new_tokens)
                records.append(record(system, mode, prompt, repeat, ids[prompt["id"]], result))
        print(f"[{system}] repeat {repeat + 1}/{args.repeats} done", flush=True)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return len(records)


def peer_main(system: str, description: str, modes) -> int:
    """The entry point of a peer script: parse the shared options, run `modes(args)`, write the JSONL."""
    args = parse_args(description)
    count = run_modes(system, modes(args), args)
    print(f"[{system}] wrote {count} records to {args.out}")
    return 0
