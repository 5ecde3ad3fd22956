"""Quality of a quantized model: top-1 agreement with fp32, perplexity, ms/step, acceptance and speedup as a draft."""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.manifest import ModelEntry
from specdec.runtime.backend import Backend

log = logging.getLogger(__name__)

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash table works.",
    "Give three tips for staying focused while studying.",
)


@dataclass(frozen=True)
class QualityRow:
    name: str
    precision: str
    method: str
    size_mb: float
    ms_per_step: float
    top1_agreement: float
    perplexity: float
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    speedup: float | None = None


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    # logits: [T, V] -> [T, V]
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def teacher_forced(reference: Backend, candidate: Backend, windows: np.ndarray, progress: bool = False) -> dict:
    """Both models over each window in one prefill. windows: [N, W]. -> agreement, ppl, reference ppl."""
    from tqdm.auto import tqdm

    agree = total = 0
    nll, ref_nll = [], []
    for window in tqdm(windows, disable=not progress, desc="agreement", unit="window"):
        ids = window[None, :]  # [1, W]
        outputs = []
        for backend in (reference, candidate):
            backend.reset(1)
            outputs.append(backend.forward(ids, np.zeros(1, np.int64))[0])  # [W, V]
        ref, cand = outputs
        agree += int((ref.argmax(-1) == cand.argmax(-1)).sum())
        total += len(window)
        targets = window[1:]
        nll.append(-_log_softmax(cand[:-1])[np.arange(len(targets)), targets])
        ref_nll.append(-_log_softmax(ref[:-1])[np.arange(len(targets)), targets])
    return {"top1_agreement": agree / total, "perplexity": float(np.exp(np.concatenate(nll).mean())),
            "reference_perplexity": float(np.exp(np.concatenate(ref_nll).mean()))}


def step_ms(backend: Backend, steps: int = 1, context: int = 64, repeats: int = 12) -> float:
    """Median ms of one forward of T=`steps` tokens at cache_len=`context` (batch 1)."""
    return interleaved_ms([(backend, steps)], context, repeats)[0]


def interleaved_ms(calls: list, context: int = 64, repeats: int = 12) -> list[float]:
    """Median ms of each (backend, T) forward at cache_len=`context` (batch 1), the calls taken in turn every
    repeat so that a slow spell of a shared machine falls on all of them alike; 2 warm-up rounds."""
    for backend in {id(b): b for b, _ in calls}.values():
        backend.reset(1)
    cache = np.full(1, context, np.int64)
    times = [[] for _ in calls]
    for _ in range(repeats + 2):
        for (backend, steps), spent in zip(calls, times):
            ids = np.ones((1, steps), np.int64)
            started = time.perf_counter()
            backend.forward(ids, cache)
            spent.append(time.perf_counter() - started)
    return [statistics.median(spent[2:]) * 1e3 for spent in times]


def acceptance(bundle: Path, prompts, gamma: int | None = None, max_new_tokens: int = 64) -> dict:
    """Greedy generation with drafter='model' and 'none' on the same prompts; the first prompt warms up."""
    from specdec.runtime import GenerationConfig, load

    with load(bundle, verify=False) as gen:
        chat = gen.codec.has_chat_template
        model = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, drafter="model", gamma=gamma,
                                 chat=chat)
        plain = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, drafter="none", chat=chat)
        gen.generate(prompts[0], GenerationConfig(max_new_tokens=8, drafter="model", chat=chat))
        totals = {"proposed": 0, "accepted": 0, "emitted": 0, "passes": 0, "spec_s": 0.0, "plain_s": 0.0}
        for prompt in prompts:
            spec = gen.generate(prompt, model)
            base = gen.generate(prompt, plain)
            if spec.token_ids != base.token_ids:
                log.warning("greedy outputs differ for %r (numerical ties?)", prompt)
            stats = spec.stats
            totals["proposed"] += stats.proposed
            totals["accepted"] += stats.accepted
            totals["emitted"] += stats.emitted
            totals["passes"] += stats.verify_passes
            totals["spec_s"] += stats.total_s / max(stats.emitted, 1)
            totals["plain_s"] += base.stats.total_s / max(base.stats.emitted, 1)
    return {"acceptance_rate": totals["accepted"] / max(totals["proposed"], 1),
            "mean_acceptance_length": totals["emitted"] / max(totals["passes"], 1),
            "speedup": totals["plain_s"] / totals["spec_s"]}


def model_size_mb(root: Path, entry: ModelEntry) -> float:
    return sum((Path(root) / rel).stat().st_size for rel in entry.files) / 2**20


def markdown_table(rows: list[QualityRow]) -> str:
    head = ["model", "precision", "method", "size MB", "ms/step", "top-1 agr.", "ppl", "accept", "MAL", "speedup"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        cells = [r.name, r.precision, r.method, fmt(r.size_mb, ".1f"), fmt(r.ms_per_step, ".1f"),
                 fmt(r.top1_agreement, ".3f"), fmt(r.perplexity, ".2f" if r.perplexity < 1e5 else ".2e"),
                 fmt(r.acceptance_rate, ".3f"),
                 fmt(r.mean_acceptance_length, ".2f"), fmt(r.speedup, ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def csv_table(rows: list[QualityRow]) -> str:
    import csv
    import io
    from dataclasses import asdict, fields

    out = io.StringIO()
    writer = csv.DictWriter(out, [f.name for f in fields(QualityRow)])
    writer.writeheader()
    for row in rows:
        writer.writerow(asdict(row))
    return out.getvalue()
