"""The training objective: over `steps` simulated draft steps (TorchHead.chain), the cross-entropy of the head's
distribution over its draft vocabulary against the target's top-k distribution restricted to that vocabulary and
renormalised, step k weighted decay**k; and each step's top-1 agreement with the target's likeliest token (what a
greedy draft at that depth would have proposed, given the steps before were right)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepCounts:
    """Top-1 agreement and loss of each draft step, summed over labelled positions."""

    hits: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    loss: list = field(default_factory=list)

    def add(self, other: "StepCounts") -> None:
        if not self.hits:
            self.hits, self.positions, self.loss = [0] * len(other.hits), [0] * len(other.hits), [0.0] * len(other.hits)
        for k in range(len(other.hits)):
            self.hits[k] += other.hits[k]
            self.positions[k] += other.positions[k]
            self.loss[k] += other.loss[k]

    def agreement(self) -> list:
        return [h / max(n, 1) for h, n in zip(self.hits, self.positions)]


def chain_loss(head, batch, to_draft: torch.Tensor, steps: int, decay: float) -> tuple:
    """batch: a shards.Batch; to_draft [V] int64: each target token's draft row, -1 outside the draft vocabulary ->
    (the weighted loss, StepCounts)."""
    tokens, top_ids, top_probs = (torch.from_numpy(a) for a in (batch.tokens, batch.top_ids, batch.top_probs))
    chain = head.chain(tokens, head.fuse(torch.from_numpy(batch.features)), steps)
    n = tokens.shape[1] - 1
    counts, total = StepCounts([], [], []), 0.0
    for k, logits in enumerate(chain):  # logits [B, n, V']: origin j scores the token after position j + k + 1
        at = (torch.arange(n) + k + 1).clamp(max=n)  # the label's position
        rows = to_draft[top_ids[:, at]]  # [B, n, K]
        weights = top_probs[:, at] * (rows >= 0)
        mass = weights.sum(-1)
        labelled = (mass > 0) & (torch.arange(n) + k + 1 <= n)
        weights = weights / mass.clamp_min(1e-12)[..., None]
        log_probs = torch.log_softmax(logits.float(), dim=-1)  # fp32 even where the products ran in bf16
        log_q = log_probs.gather(-1, rows.clamp_min(0))
        cross = -(weights * log_q).sum(-1)  # [B, n]
        count = int(labelled.sum())
        step_loss = (cross * labelled).sum() / max(count, 1)
        total = total + decay ** k * step_loss
        best = rows[..., 0]  # the target's likeliest token's draft row (-1: the draft cannot propose it)
        with torch.no_grad():
            hits = int(((log_probs.argmax(-1) == best) & labelled & (top_probs[:, at, 0] > 0)).sum())
            positions = int((labelled | ((top_probs[:, at, 0] > 0) & (torch.arange(n) + k + 1 <= n))).sum())
        counts.hits.append(hits)
        counts.positions.append(positions)
        counts.loss.append(step_loss.item() * count)
    return total, counts
