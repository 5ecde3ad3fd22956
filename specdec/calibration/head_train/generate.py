"""The training data: the target answers the training prompts on specdec's native engine, rows batched (a row that
ends hands its slot to the next prompt), and every forward it runs asks for the head's layers too
(ForwardRequest.feature_layers). So the pass that feeds token p returns the target's hidden states at p and its
distribution of token p + 1: the teacher-forced features and soft labels of the text it writes, with no second
pass over it (a row's numbers do not depend on the rows beside it: the engine's batch invariance, tested in
tests/calibration/test_head_train_data.py against a teacher-forced pass over the finished sequence).

Even prompts are answered greedily, odd ones sampled (temperature `temperature`, top-k 50: the distribution
specdec.runtime.sampling gives, computed over those 50 tokens alone) from a stream seeded by (seed, prompt index),
so the data does not depend on how rows were batched. Prompts are taken in shards of `per_shard`; a shard is
written when all its prompts are answered.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.calibration.head_train.asked import ASK_TOP_K
from specdec.calibration.head_train.shards import Sequence, shard_meta, shard_numbers, write_shard
from specdec.runtime.forward import ForwardRequest


@dataclass(frozen=True)
class DataPlan:
    rows: int = 16  # prompts answered at once (KV slots)
    max_new_tokens: int = 192
    top_k: int = 32  # soft label: the target's likeliest tokens kept per position
    temperature: float = 0.8  # of the sampled (odd) prompts
    per_shard: int = 32  # prompts per shard
    seed: int = 0


@dataclass
class Budget:
    """When to stop taking prompts: answer tokens written, or a deadline (time.monotonic()); None: no limit."""

    tokens: int | None = None
    deadline: float | None = None


def top_labels_rows(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """logits [R, V] -> (each row's k likeliest token ids, likeliest first, ties by id [R, k] int32, their
    probabilities [R, k] float16), in float32: the probabilities are kept as float16, and every row's numbers are those
    it gets alone (each row's reductions run along that row only). The k are found by torch.topk (training needs
    torch): over a batch of rows and a 49k vocabulary, a fifth of numpy's argpartition's time."""
    import torch

    logits = np.ascontiguousarray(logits, np.float32)
    ids = torch.topk(torch.from_numpy(logits), k, dim=-1, sorted=False).indices.numpy()
    peak = logits.max(axis=-1, keepdims=True)
    total = np.exp(logits - peak).sum(axis=-1, keepdims=True)
    probs = np.exp(np.take_along_axis(logits, ids, axis=-1) - peak) / total
    order = np.lexsort((ids, -probs), axis=-1)  # likeliest first, then the smaller id
    return (np.take_along_axis(ids, order, axis=-1).astype(np.int32),
            np.take_along_axis(probs, order, axis=-1).astype(np.float16))


def top_labels(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """logits [V] -> (the k likeliest token ids, likeliest first [k] int32, their probabilities [k] float16)."""
    ids, probs = top_labels_rows(np.asarray(logits)[None], k)
    return ids[0], probs[0]


def sample_top_k(logits: np.ndarray, temperature: float, k: int, stream: np.random.Generator) -> int:
    """A token from logits [V] at `temperature` among the k likeliest (and any tied with the k-th), as
    specdec.runtime.sampling's warp and sample draw it with top-k k and top-p 1, but over those tokens alone rather
    than the whole vocabulary (one partition instead of several passes over V in float64)."""
    vocab = logits.shape[-1]
    kept = np.flatnonzero(logits >= np.partition(logits, vocab - k)[vocab - k]) if 0 < k < vocab \
        else np.arange(vocab)
    weights = np.exp((logits[kept].astype(np.float64) - float(logits.max())) / temperature)
    cdf = np.cumsum(weights)
    return int(kept[min(np.searchsorted(cdf, stream.random() * cdf[-1], side="right"), len(kept) - 1)])


@dataclass(frozen=True)
class Ask:
    """What a prompt of the target's own (head_train.asked) starts from: the chat template up to a user message's
    first token (`prefix`), after which the target writes the request, at most `tokens` long."""

    prefix: tuple
    tokens: int


@dataclass
class Asking:
    """A row writing its prompt's request: the prefix and the request's tokens so far."""

    index: int
    tokens: list
    prefix_len: int
    limit: int  # the request's most tokens


class Answering:
    """Rows in flight on `backend` (a target opened with at least plan.rows slots, reset to them): rows answering a
    prompt (their features and labels are the data), and rows writing the request of a prompt of the target's own
    (`ask`), in the same batched passes."""

    def __init__(self, backend, layers: tuple, eos: tuple, plan: DataPlan):
        self.backend = backend
        self.layers = tuple(layers)
        self.eos = set(eos)
        self.plan = plan
        self.sample_top_k = 50  # of the sampled answers (temperature plan.temperature, top-p 1)
        self.rows = {}  # slot -> (Sequence or Asking, its sampling stream)

    def free_slots(self) -> list:
        return [slot for slot in range(self.plan.rows) if slot not in self.rows]

    def answering(self) -> int:
        """Rows in flight that answer (each step writes one answer token of each)."""
        return sum(not isinstance(row, Asking) for row, _ in self.rows.values())

    def ask(self, slot: int, index: int, ask: Ask) -> None:
        """Prefill the user-turn prefix on `slot`: the target writes prompt `index`'s request there, from a stream
        seeded by (seed, index, 1), temperature 1, top-k ASK_TOP_K; `step` hands it back once it ends."""
        prefix = list(ask.prefix)
        result = self.backend.run(ForwardRequest(np.array([prefix], np.int64), np.zeros(1, np.int64),
                                                 slots=np.array([slot]), last_only=True))
        stream = np.random.default_rng([self.plan.seed, index, 1])
        token = sample_top_k(result.logits[0, -1], 1.0, ASK_TOP_K, stream)
        self.rows[slot] = (Asking(index, prefix + [token], len(prefix), ask.tokens), stream)

    def start(self, slot: int, index: int, ids: list) -> Sequence | None:
        """Prefill prompt `index` (its token ids) on `slot` and choose its first answer token; -> the sequence where
        that token ends it, else None."""
        request = ForwardRequest(np.array([ids], np.int64), np.zeros(1, np.int64), slots=np.array([slot]),
                                 feature_layers=self.layers)
        result = self.backend.run(request)
        sequence = Sequence(index, list(ids), len(ids), [], [], [])
        K = self.plan.top_k
        for position in range(len(ids) - 1):  # prompt positions: features only (no label before P - 1)
            sequence.features.append(result.features[0, position].astype(np.float16))
            sequence.top_ids.append(np.zeros(K, np.int32))
            sequence.top_probs.append(np.zeros(K, np.float16))
        self.rows[slot] = (sequence, np.random.default_rng([self.plan.seed, index]))
        return self.rows.pop(slot)[0] if self._take(slot, result.logits[0, -1], result.features[0, -1]) else None

    def step(self) -> tuple[list, list]:
        """One token for every row in flight; -> (the sequences that ended, (slot, prompt index, request token ids)
        of each request written: its slot is free again)."""
        slots = sorted(self.rows)
        tokens = np.array([[self.rows[s][0].tokens[-1]] for s in slots], np.int64)
        cache_len = np.array([len(self.rows[s][0].tokens) - 1 for s in slots], np.int64)
        result = self.backend.run(ForwardRequest(tokens, cache_len, slots=np.array(slots),
                                                 feature_layers=self.layers))
        ended, asked = [], []
        logits = result.logits[:, -1]  # [rows, V]
        answering = [row for row, slot in enumerate(slots) if not isinstance(self.rows[slot][0], Asking)]
        labels = top_labels_rows(logits[answering], self.plan.top_k) if answering else None  # at once
        label_of = {row: at for at, row in enumerate(answering)}  # a row's line in labels
        for row, slot in enumerate(slots):
            held, stream = self.rows[slot]
            if isinstance(held, Asking):
                request = held.tokens[held.prefix_len :]
                if request[-1] not in self.eos and len(request) < held.limit:
                    held.tokens.append(sample_top_k(logits[row], 1.0, ASK_TOP_K, stream))
                    continue
                del self.rows[slot]
                asked.append((slot, held.index, request[:-1] if request[-1] in self.eos else request))
                continue
            at = label_of[row]
            if self._take(slot, logits[row], result.features[row, -1], (labels[0][at], labels[1][at])):
                ended.append(self.rows.pop(slot)[0])
        return ended, asked

    def _take(self, slot: int, logits: np.ndarray, features: np.ndarray, labels=None) -> bool:
        """Record the fed token's features and label (labels: its top_labels, where the caller has them), choose the
        next token; -> whether the row ended."""
        sequence, stream = self.rows[slot]
        sequence.features.append(features.astype(np.float16))
        ids, probs = labels if labels is not None else top_labels(logits, self.plan.top_k)
        sequence.top_ids.append(ids)
        sequence.top_probs.append(probs)
        if sequence.index % 2 == 0:
            token = int(np.argmax(logits))
        else:
            token = sample_top_k(logits, self.plan.temperature, self.sample_top_k, stream)
        sequence.tokens.append(token)
        answered = len(sequence.tokens) - sequence.prompt_len
        if token in self.eos or answered >= self.plan.max_new_tokens or \
                len(sequence.tokens) >= self.backend.max_seq_len:
            K = self.plan.top_k  # the last token is not fed: no features, no label
            sequence.features.append(np.zeros_like(sequence.features[-1]))
            sequence.top_ids.append(np.zeros(K, np.int32))
            sequence.top_probs.append(np.zeros(K, np.float16))
            return True
        return False


def written(root: Path) -> tuple[set, int]:
    """(the shard numbers under root, the answer tokens they hold)."""
    numbers = shard_numbers(root)
    return set(numbers), sum(shard_meta(root, n)["generated"] for n in numbers)


class ShardRun:
    """Answer prompts 0..count-1 (prompt_ids(index) -> token ids, an Ask where the target writes the request first,
    or None to skip it; asked_ids(index, request token ids) -> the token ids of the prompt it makes, or None to skip
    it) shard by shard into `root`, skipping shards already written, until `budget` says stop (the shard begun is
    finished; a run begins one shard at least)."""

    def __init__(self, answering: Answering, prompt_ids, count: int, root: Path, budget: Budget, clock,
                 asked_ids=None):
        self.answering = answering
        self.prompt_ids = prompt_ids
        self.asked_ids = asked_ids
        self.root = Path(root)
        self.budget = budget
        self.clock = clock
        done, self.total = written(root)  # total: answer tokens written
        self.answered = self.total  # ... and chosen since, whether written yet or not (what the budget counts)
        per = answering.plan.per_shard
        self.pending = [n for n in range((count + per - 1) // per) if n not in done]
        self.count = count
        self.waiting = {}  # shard -> ({index: Sequence}, the indices it expects)
        self.queue = []  # (index, ids) of begun shards' prompts not yet started

    def run(self, progress=None) -> int:
        """-> answer tokens written in all (those of earlier runs included)."""
        if progress is not None:
            progress.update(self.total)
        while True:
            if not self.queue and self.pending and not (self._over() and (self.total or self.waiting)):
                self._begin(self.pending.pop(0))  # one shard at least, whatever the budget: data to train on
            for slot in self.answering.free_slots()[: len(self.queue)]:
                index, ids = self.queue.pop(0)
                if isinstance(ids, Ask):
                    self.answering.ask(slot, index, ids)
                else:
                    self._start(progress, slot, index, ids)
            if self.answering.rows:
                self._count(progress, self.answering.answering())
                ended, asked = self.answering.step()
                for sequence in ended:
                    self._finish(sequence)
                for slot, index, request in asked:  # the slot answers the prompt its request makes
                    ids = self.asked_ids(index, request)
                    if ids is None:
                        self._skip(index)
                    else:
                        self._start(progress, slot, index, ids)
            elif not self.queue and (not self.pending or (self._over() and (self.total or self.waiting))):
                return self.total

    def _start(self, progress, slot: int, index: int, ids: list) -> None:
        ended = self.answering.start(slot, index, ids)
        self._count(progress, 1)
        if ended is not None:
            self._finish(ended)

    def _over(self) -> bool:
        budget = self.budget
        return (budget.tokens is not None and self.answered >= budget.tokens) or \
            (budget.deadline is not None and self.clock() >= budget.deadline)

    def _count(self, progress, tokens: int) -> None:
        self.answered += tokens
        if progress is not None:
            progress.update(tokens)

    def _begin(self, shard: int) -> None:
        per = self.answering.plan.per_shard
        ids = {i: self.prompt_ids(i) for i in range(shard * per, min(self.count, (shard + 1) * per))}
        ids = {i: v for i, v in ids.items() if v is not None}
        if ids:
            self.waiting[shard] = ({}, set(ids))
            self.queue = list(ids.items())

    def _finish(self, sequence: Sequence) -> None:
        shard = sequence.index // self.answering.plan.per_shard
        self.waiting[shard][0][sequence.index] = sequence
        self._written(shard)

    def _skip(self, index: int) -> None:
        """Prompt `index` makes no prompt (its request was empty, or too long): its shard expects it no more."""
        shard = index // self.answering.plan.per_shard
        self.waiting[shard][1].discard(index)
        self._written(shard)

    def _written(self, shard: int) -> None:
        """Write the shard where every prompt it expects is answered (a shard every prompt of which was skipped is
        not written)."""
        done, expected = self.waiting[shard]
        if set(done) == expected:
            del self.waiting[shard]
            if done:
                write_shard(self.root, shard, [done[i] for i in sorted(done)])
                self.total += sum(len(s.tokens) - s.prompt_len for s in done.values())
