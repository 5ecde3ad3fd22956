"""How far the native target's int8 (or bf16) activations move its output from fp32 activations, teacher-forced.

    python benchmarks/fidelity.py bundles/smollm2-q41                        # 20 prompts x 128 positions
    python benchmarks/fidelity.py bundles/smollm2-q41 --prompts 4 --positions 32
    python benchmarks/fidelity.py bundles/smollm2-bf16-q41 --mode bf16       # bf16 activations, bf16 rows

For each prompt of benchmarks/prompts (the first --prompts, taken in turn from each class), the fp32 mode writes
--positions tokens greedily (EOS ignored); then both modes score that same text in one teacher-forced pass each, and
at every written position the record compares them: top-1 agreement, KL(fp32 || mode) in nats, and, where the top
tokens differ, fp32's margin between its top two logits there (a disagreement is expected only where that margin is
small). Both modes are the same bundle opened twice with load(activations=...); the text comes from fp32, so every
position is one the fp32 model would reach.

Writes fidelity.md and record.json. A benchmark, not a test: it asserts nothing.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from harness import opening, record

from specdec import GenerationConfig
from specdec.bench.prompts import read_prompts
from specdec.native_record import Activations
from specdec.runtime.config import DrafterName
from specdec.runtime.forward import ForwardRequest

EXPERIMENT = "fidelity"
PROMPTS = Path(__file__).with_name("prompts")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def teacher_forced(generator, ids: list) -> np.ndarray:
    """[len(ids), V] logits of one pass over `ids` from position 0 (slot 0)."""
    backend = generator.target.backend
    backend.reset(1)
    tokens = np.asarray(ids, np.int64)[None]
    return np.asarray(backend.run(ForwardRequest(tokens, np.zeros(1, np.int64))).logits)[0]


def compare(reference: np.ndarray, other: np.ndarray) -> dict:
    """Per-position figures of `other` against `reference` ([P, V] logits each)."""
    p, q = log_softmax(reference), log_softmax(other)
    kl = (np.exp(p) * (p - q)).sum(-1)
    order = np.argsort(reference, -1)
    top, second = order[:, -1], order[:, -2]
    rows = np.arange(len(reference))
    differ = top != other.argmax(-1)
    margin = reference[rows, top] - reference[rows, second]
    return {"positions": len(reference), "agree": int((~differ).sum()), "kl": kl.tolist(),
            "disagreement_margins": margin[differ].tolist()}


def interleaved(prompts: list, count: int) -> list:
    """The first prompt of each class, then the second of each, ... : `count` in all."""
    by_class: dict = {}
    for prompt in prompts:
        by_class.setdefault(prompt.cls, []).append(prompt)
    ordered = [p for group in zip(*by_class.values()) for p in group]
    return ordered[:count]


def measure(bundle: str, args) -> tuple[dict, list]:
    fp32 = opening.open_bundle(bundle, backend="native", threads=args.threads, activations=Activations.FP32)
    other = opening.open_bundle(bundle, backend="native", threads=args.threads, activations=Activations(args.mode))
    config = GenerationConfig(max_new_tokens=args.positions, temperature=0.0, drafter=DrafterName.NONE,
                              eos_token_ids=(), chat=True)  # EOS ignored: every prompt writes --positions
    per_prompt = []
    for prompt in interleaved(read_prompts(args.prompt_dir), args.prompts):
        result = fp32.generate(prompt.text, config)
        ids = list(result.prompt_ids) + list(result.token_ids)
        start = len(result.prompt_ids) - 1  # the logits at this position predict the first written token
        a, b = (teacher_forced(g, ids)[start:len(ids) - 1] for g in (fp32, other))
        per_prompt.append({"id": prompt.id, "class": prompt.cls, **compare(a, b)})
    fp32.close()
    other.close()
    return opening.describe(other), per_prompt


def summary(per_prompt: list) -> dict:
    positions = sum(p["positions"] for p in per_prompt)
    kl = np.array([k for p in per_prompt for k in p["kl"]])
    margins = [m for p in per_prompt for m in p["disagreement_margins"]]
    return {"prompts": len(per_prompt), "positions": positions,
            "top1_agreement": sum(p["agree"] for p in per_prompt) / positions,
            "kl_mean": float(kl.mean()), "kl_p99": float(np.quantile(kl, 0.99)), "kl_max": float(kl.max()),
            "disagreements": len(margins), "disagreement_margin_max": max(margins, default=None)}


def table(figures: dict, per_prompt: list) -> str:
    lines = ["| prompts | positions | top-1 agreement | mean KL (nats) | p99 KL | max KL | disagreements | "
             "largest fp32 top-2 margin at one |", "|---|---|---|---|---|---|---|---|",
             f"| {figures['prompts']} | {figures['positions']} | {figures['top1_agreement']:.2%} | "
             f"{figures['kl_mean']:.2e} | {figures['kl_p99']:.2e} | {figures['kl_max']:.2e} | "
             f"{figures['disagreements']} | {figures['disagreement_margin_max'] or 0:.3f} |", "",
             "| prompt | class | positions | agree | mean KL |", "|---|---|---|---|---|"]
    lines += [f"| {p['id']} | {p['class']} | {p['positions']} | {p['agree']} | {np.mean(p['kl']):.2e} |"
              for p in per_prompt]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("bundle")
    parser.add_argument("--prompts", type=int, default=20, help="prompts to score (default 20)")
    parser.add_argument("--positions", type=int, default=128, help="written positions a prompt (default 128)")
    parser.add_argument("--prompt-dir", default=str(PROMPTS), help="a folder of *.jsonl prompts")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--mode", choices=[Activations.INT8, Activations.BF16], default=Activations.INT8,
                        help="the activations compared with fp32 (default int8; bf16 needs bf16 rows and AMX-BF16)")
    opening.add_out(parser)
    args = parser.parse_args(argv)
    described, per_prompt = measure(args.bundle, args)
    figures = summary(per_prompt)
    run = record.run_record(EXPERIMENT, {"specdec native": {**described, "compared": f"{args.mode} against fp32"}},
                            args.threads, __file__, argv)
    text = f"# {args.mode} against fp32 activations: {Path(args.bundle).name}\n\n" + table(figures, per_prompt)
    record.finish(run, args.out, {"fidelity.md": text}, shown=text, summary=figures, prompts=per_prompt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
