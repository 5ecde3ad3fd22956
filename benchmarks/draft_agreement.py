"""Top-1 agreement of bundle drafts with their target, teacher-forced over the benchmark prompts.

    python benchmarks/draft_agreement.py BUNDLE [BUNDLE ...] [--prompts benchmarks/prompts] [--per-class 0]
    python benchmarks/draft_agreement.py bundles/smollm2-q41 --per-class 2 --backend native [--kv target]

Each prompt (chat template applied, as the benchmark sends it) is extended by the target's own greedy continuation
of --continue tokens (where acceptance is decided), then fed to the target and the draft; at every position the
draft's argmax is compared with the target's. Prints a markdown table. No assertions (not a test).

Two figures: over every position (the prompt's too), and over the positions whose next token is generated (from
the prompt's last token on), the only ones where a draft proposes.

--kv own (default): the draft reads back its own KV (one prefill each): a draft alone.
--kv target: the draft reads the target's KV for every earlier position, as it does when it proposes a round's first
  token (the loop gives it the committed KV: copied, or shared on the native backend). The target prefills; then per
  position the draft takes one step and the target runs that position again (its KV back where a draft shares it).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from specdec.manifest import read_manifest
from specdec.runtime.native_backend import NativeBackend
from specdec.runtime.ort_backend import OrtBackend
from specdec.runtime.text import TextCodec

HERE = Path(__file__).resolve().parent


def prompt_ids(bundle: Path, folder: Path, per_class: int) -> list:
    codec = TextCodec(bundle).open()
    ids = []
    for file in sorted(folder.glob("*.jsonl")):
        records = [json.loads(line) for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
        ids += [codec.chat(record["prompt"]) for record in records[: per_class or None]]
    return ids


def continued(target, ids: list, steps: int) -> list:
    """ids + the target's greedy continuation of `steps` tokens."""
    target.reset(1)
    logits = target.forward(np.array([ids], dtype=np.int64), np.zeros(1, np.int64), last_only=True)
    out = list(ids)
    for _ in range(steps):
        out.append(int(logits[0, -1].argmax()))
        logits = target.forward(np.array([[out[-1]]], dtype=np.int64), np.array([len(out) - 1]))
    return out


def add_prompt_args(parser: argparse.ArgumentParser, per_class: int, steps: int) -> None:
    """--prompts, --per-class and --continue, shared by the scripts that replay the target's continuations."""
    parser.add_argument("--prompts", type=Path, default=HERE / "prompts")
    parser.add_argument("--per-class", type=int, default=per_class, help="prompts per class (0: all)")
    parser.add_argument("--continue", dest="steps", type=int, default=steps, help="target's greedy tokens per prompt")


def continuations(target, bundle: Path, args: argparse.Namespace) -> list:
    """[(a prompt's ids + the target's greedy continuation of args.steps tokens, the prompt's length)]."""
    return [(continued(target, ids, args.steps), len(ids)) for ids in prompt_ids(bundle, args.prompts, args.per_class)]


def agreement(bundle: Path, prompts: list, steps: int, engine: str = "onnxruntime", kv: str = "own") -> dict:
    """{"all": (agreeing, positions), "generated": (agreeing, positions)}: every position, and those from each
    prompt's last token on (where the next token is generated)."""
    manifest = read_manifest(bundle)
    if engine == "native":  # the native target, and the draft it runs (on its blocks, or on onnxruntime)
        target, draft = NativeBackend.open_models(bundle, manifest, "cpu", None)
    else:
        target, draft = OrtBackend(bundle, manifest.target).open(), OrtBackend(bundle, manifest.draft).open()
    counts = {"all": [0, 0], "generated": [0, 0]}
    for ids in prompts:
        feeds = np.array([continued(target, ids, steps)], dtype=np.int64)
        if kv == "target":
            want, got = first_proposals(target, draft, feeds)
        else:
            want, got = (prefill_argmax(backend, feeds) for backend in (target, draft))
        for name, hits in (("all", want == got), ("generated", (want == got)[len(ids) - 1:])):
            counts[name][0] += int(hits.sum())
            counts[name][1] += len(hits)
    return {name: tuple(pair) for name, pair in counts.items()}


def prefill_argmax(backend, feeds: np.ndarray) -> np.ndarray:
    """The model's argmax at each position of feeds [1, n], in one prefill over its own KV."""
    backend.reset(1)
    return backend.forward(feeds, np.zeros(1, np.int64))[0].argmax(-1)


def first_proposals(target, draft, feeds: np.ndarray) -> tuple:
    """(the target's argmax at each position of feeds [1, n], from one prefill; the draft's, each over the target's
    KV for the positions before it)."""
    draft.reset(1)  # before the target's prefill: a draft sharing the target's KV resets it too
    want = prefill_argmax(target, feeds)
    out = []
    for t in range(feeds.shape[1]):
        if t:
            draft.copy_kv(target, 0, t - 1, t)  # nothing to copy where the draft shares the target's KV
        out.append(int(draft.forward(feeds[:, t:t + 1], np.array([t]))[0, -1].argmax()))
        target.forward(feeds[:, t:t + 1], np.array([t]))  # position t's KV: the target's again
    return want, np.array(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundles", nargs="+", type=Path)
    add_prompt_args(parser, per_class=0, steps=64)
    parser.add_argument("--backend", choices=("onnxruntime", "native"), default="onnxruntime",
                        help="native: the native target and its draft (an int4-q41 draft on the target's blocks, "
                             "int8 activations)")
    parser.add_argument("--kv", choices=("own", "target"), default="own",
                        help="the KV the draft reads for earlier positions: its own, or the target's")
    args = parser.parse_args()
    lines = ["| bundle | draft | KV read | positions | top-1 agreement | generated positions | top-1 agreement |",
             "|---|---|---|---|---|---|---|"]
    for bundle in args.bundles:
        prompts = prompt_ids(bundle, args.prompts, args.per_class)
        counts = agreement(bundle, prompts, args.steps, args.backend, args.kv)
        draft = read_manifest(bundle).draft
        method = draft.calibration.method or draft.derived
        cells = " | ".join(f"{total} | {agree / total:.4f}" for agree, total in counts.values())
        lines.append(f"| {bundle.name} | {method} ({draft.precision}), {args.backend} | {args.kv} | {cells} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
