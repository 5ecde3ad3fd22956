"""The training loop: AdamW on the head's weights, a linear warm-up then a cosine decay to a tenth over the planned
steps, batches of whole sequences (padded to the batch's longest) drawn from the shards in an order fixed by the
seed, a checkpoint every `checkpoint_every` steps (and at the end) that a later run resumes from exactly: the step,
the weights, the optimizer's moments and the planned length; the batch order is recomputed from the seed.

A few sequences (`held_out`, by index) never train: their top-1 agreement per draft step is what the run reports.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from specdec.calibration.head_train.loss import StepCounts, chain_loss
from specdec.calibration.head_train.torch_head import NORMS
from specdec.errors import ConfigError

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainPlan:
    batch_tokens: int = 2048  # rows x longest row of a batch at most (one sequence alone may pass it)
    lr: float = 6e-4
    warmup: int = 40
    min_lr: float = 0.1  # of lr, where the cosine ends
    weight_decay: float = 0.01
    clip: float = 1.0
    chain_steps: int = 3  # simulated draft steps (the training-time test)
    decay: float = 0.8  # weight of step k: decay ** k
    held_out: int = 16  # every held_out-th sequence is held out (0: none)
    checkpoint_every: int = 50
    seed: int = 0
    bf16: bool = False  # the products in bf16 (torch.autocast; weights, optimizer and the loss's softmax stay fp32)


def precision(plan: TrainPlan):
    """The context a forward of `plan` runs in: bf16 autocast on the CPU, or nothing."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=plan.bf16)


def split(count: int, every: int) -> tuple[list, list]:
    """(training sequences, held-out sequences) of 0..count-1: every `every`-th held out (none where every is 0 or
    there would be nothing left to train)."""
    held = list(range(every // 2, count, every)) if every and count >= 2 else []
    held = held if len(held) < count else []
    chosen = set(held)
    return [s for s in range(count) if s not in chosen], held


def epoch_batches(lengths: dict, batch_tokens: int, seed: int, epoch: int) -> list:
    """Batches (lists of sequence ids) of one epoch: a seeded shuffle, sorted by length within windows of 64 so
    rows of a batch have similar lengths, packed while rows x longest <= batch_tokens, in a shuffled order."""
    rng = np.random.default_rng([seed, epoch])
    ids = [int(s) for s in rng.permutation(sorted(lengths))]
    batches = []
    for lo in range(0, len(ids), 64):
        batch, longest = [], 0
        for s in sorted(ids[lo : lo + 64], key=lambda s: (lengths[s], s)):
            if batch and (len(batch) + 1) * max(longest, lengths[s]) > batch_tokens:
                batches.append(batch)
                batch, longest = [], 0
            batch.append(s)
            longest = max(longest, lengths[s])
        if batch:
            batches.append(batch)
    return [batches[i] for i in rng.permutation(len(batches))]


class BatchStream:
    """Step s's batch, epoch after epoch (every epoch over the training sequences, reshuffled). Epochs differ in their
    count of batches (each packs its own shuffle), so a step is placed by the counts of the epochs before it."""

    def __init__(self, lengths: dict, plan: TrainPlan):
        self.lengths = lengths
        self.plan = plan
        self.epochs = {}  # the one epoch held: {epoch: its batches}
        self.counts = []  # batches of epochs 0, 1, ... as far as placed

    def steps_per_epoch(self) -> int:
        return len(self._epoch(0))

    def _epoch(self, epoch: int) -> list:
        if epoch not in self.epochs:
            self.epochs = {epoch: epoch_batches(self.lengths, self.plan.batch_tokens, self.plan.seed, epoch)}
        return self.epochs[epoch]

    def __getitem__(self, step: int) -> list:
        epoch = 0
        while True:
            if epoch == len(self.counts):
                self.counts.append(len(self._epoch(epoch)))
            if step < self.counts[epoch]:
                return self._epoch(epoch)[step]
            step -= self.counts[epoch]
            epoch += 1


def schedule(plan: TrainPlan, total: int):
    """The learning-rate factor of step s: a linear warm-up, then a cosine from 1 to plan.min_lr at `total`."""
    warmup = min(plan.warmup, max(total // 10, 1))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(total - warmup, 1))
        return plan.min_lr + (1 - plan.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def optimizer_of(head, plan: TrainPlan) -> torch.optim.Optimizer:
    """AdamW; no weight decay on the norms."""
    norms = {id(getattr(head, name)) for name in NORMS}
    decayed = [p for p in head.parameters() if id(p) not in norms]
    kept = [p for p in head.parameters() if id(p) in norms]
    return torch.optim.AdamW([{"params": decayed, "weight_decay": plan.weight_decay},
                              {"params": kept, "weight_decay": 0.0}], lr=plan.lr, betas=(0.9, 0.95))


def save_checkpoint(work: Path, head, optimizer, step: int, total: int, plan: TrainPlan) -> None:
    """Write the run's state to work/CHECKPOINT (a temporary file renamed: a stopped run leaves the previous one)."""
    path = Path(work) / CHECKPOINT
    staged = path.with_name(f".{path.name}.{os.getpid()}.partial")
    torch.save({"steps_done": step, "steps_planned": total, "plan": asdict(plan), "weights": head.state_dict(),
                "optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()}, staged)
    os.replace(staged, path)


def load_checkpoint(work: Path, head, optimizer, plan: TrainPlan) -> tuple[int, int]:
    """Restore a run from work/CHECKPOINT; -> (its step, its planned total). ConfigError where the checkpoint was
    made with another plan."""
    path = Path(work) / CHECKPOINT
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state["plan"] != asdict(plan):
        changed = sorted(k for k in asdict(plan) if state["plan"].get(k) != asdict(plan)[k])
        raise ConfigError(f"the checkpoint in {work} was made with other training options ({', '.join(changed)})",
                          "resume with the options of the run that made it, or start again without --resume")
    head.load_state_dict(state["weights"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    return int(state["steps_done"]), int(state["steps_planned"])


def evaluate(head, shards, sequences: list, to_draft: torch.Tensor, plan: TrainPlan) -> StepCounts:
    """Top-1 agreement per draft step over `sequences` (no gradients)."""
    counts = StepCounts()
    with torch.no_grad(), precision(plan):
        for lo in range(0, len(sequences), 8):
            _, found = chain_loss(head, shards.batch(sequences[lo : lo + 8]), to_draft,
                                  plan.chain_steps, plan.decay)
            counts.add(found)
    return counts


@dataclass
class TrainResult:
    steps: int  # steps done, those of earlier runs included
    total: int  # steps planned
    epochs: float  # passes over the training sequences
    held_out: StepCounts  # top-1 agreement per draft step on the held-out sequences
    trained: StepCounts  # ... on the last steps' training batches


class Trainer:
    """One training run of `head` over `shards` (its state in `work`); to_draft [V]: each target token's draft row
    or -1. clock: time.monotonic or a stand-in."""

    PROBE = 3  # steps timed before a run fitted to a deadline plans its length

    def __init__(self, head, shards, to_draft: torch.Tensor, plan: TrainPlan, work: Path, clock):
        self.head, self.shards, self.to_draft, self.plan = head, shards, to_draft, plan
        self.work, self.clock = work, clock
        self.sequences, self.held = split(len(shards), plan.held_out)
        self.stream = BatchStream({s: shards.length(s) for s in self.sequences}, plan)
        self.optimizer = optimizer_of(head, plan)

    def run(self, steps: int, fit_to: float | None, deadline: float | None, resume: bool, progress=None) -> TrainResult:
        """At most `steps` steps; fit_to: a deadline the steps are planned by (from the pace measured after PROBE
        steps, again at every checkpoint: the plan shrinks whenever the pace says so, and grows, up to `steps`, while
        less than half of it is done, so that slow first steps do not leave the budget unused and the learning rate's
        decay is not stretched late); deadline: stop there whatever the plan (a checkpoint is written either way)."""
        step, total = load_checkpoint(self.work, self.head, self.optimizer, self.plan) if resume and \
            (Path(self.work) / CHECKPOINT).is_file() else (0, steps)
        factor, mark, trained = schedule(self.plan, total), None, StepCounts()
        if progress is not None:
            progress.reset(total=total)
            progress.update(step)
        while step < total and not (deadline is not None and self.clock() >= deadline):
            if fit_to is not None and mark is not None and self._refit(step - mark[0]):
                fitted = self._fitted(step, mark, fit_to)
                if fitted < total or 2 * step < total:
                    total = min(fitted, steps)
                factor = schedule(self.plan, total)
                if progress is not None:
                    progress.total = total
            trained = self._step(step, factor, trained)
            step += 1
            mark = mark or (step, self.clock())  # timed from the end of the first step, which also warms up
            if progress is not None:
                progress.update(1)
                progress.set_postfix(agreement=" ".join(f"{a:.2f}" for a in trained.agreement()), refresh=False)
            if step % self.plan.checkpoint_every == 0:
                save_checkpoint(self.work, self.head, self.optimizer, step, total, self.plan)
        save_checkpoint(self.work, self.head, self.optimizer, step, total, self.plan)
        held = evaluate(self.head, self.shards, self.held, self.to_draft, self.plan)
        return TrainResult(step, total, step / max(self.stream.steps_per_epoch(), 1), held, trained)

    def _refit(self, timed: int) -> bool:
        """Whether to plan again after `timed` timed steps: after PROBE of them, then at every checkpoint."""
        return timed == self.PROBE or (timed > self.PROBE and timed % self.plan.checkpoint_every == 0)

    def _fitted(self, step: int, mark: tuple, deadline: float) -> int:
        """Steps that end by `deadline` at the pace since mark = (step, time), a held-out evaluation's time kept
        back."""
        pace = (self.clock() - mark[1]) / max(step - mark[0], 1)
        left = deadline - self.clock() - pace * max(len(self.held) // 8, 1) - pace
        return step + max(int(left / max(pace, 1e-9)), 0)

    def _step(self, step: int, factor, trained: StepCounts) -> StepCounts:
        self.head.train()
        for group in self.optimizer.param_groups:
            group["lr"] = self.plan.lr * factor(step)
        batch = self.shards.batch(self.stream[step])
        with precision(self.plan):
            loss, counts = chain_loss(self.head, batch, self.to_draft, self.plan.chain_steps, self.plan.decay)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.plan.clip)
        self.optimizer.step()
        recent = StepCounts() if step % self.plan.checkpoint_every == 0 else trained
        recent.add(counts)
        return recent
