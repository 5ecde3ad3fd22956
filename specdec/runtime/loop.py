"""The speculative loop of DESIGN §1: prefill both models, then rounds of draft -> verify -> accept -> commit.

Rows of a batch are verified together: proposals are padded to a common T, each row has its own cache_len, and
acceptance is ragged. Rollback is moving a length. A row ends on EOS, a stop string, max_new_tokens, or `length`
when the static buffers are full; nothing is ever written past S.
"""
from __future__ import annotations

import time

import numpy as np

from specdec.runtime.config import GenerationConfig
from specdec.runtime.sampling import accept_greedy, accept_sampled, warp
from specdec.runtime.state import Row, Stats, feed_chunks, forward_padded


class SpeculativeLoop:
    def __init__(self, target, drafter, config: GenerationConfig, policy, chunk: int, eos_ids, gate=None):
        self.target = target  # a Timed backend
        self.drafter = drafter  # None: plain decoding
        self.config = config
        self.policy = policy  # γ for the next round (specdec.runtime.adaptive_gamma)
        self.chunk = chunk
        self.eos_ids = set(eos_ids)
        self.gate = gate
        self.stats = Stats()

    def prefill(self, rows: list) -> None:
        """Target KV for every token but the last, which the first verify pass feeds."""
        started = time.perf_counter()
        seqs = [row.tokens[:-1] or None for row in rows]
        if any(seqs):
            feed_chunks(self.target, seqs, [0] * len(rows), self.chunk)
        for row in rows:
            row.target_len = len(row.tokens) - 1
        self.stats.prefill_s += time.perf_counter() - started

    def limits(self, rows: list) -> list:
        """Drafts each row may get: γ, what max_new_tokens leaves, and what S leaves for this and every row."""
        size = self.target.max_seq_len
        active = [row for row in rows if not row.finish]
        shared_room = min(size - len(row.tokens) for row in active)
        gamma = self.policy.gamma
        return [
            0 if row.finish or self.drafter is None
            else max(0, min(gamma, self.config.max_new_tokens - row.generated - 1,
                            size - len(row.tokens) - 1, shared_room))
            for row in rows
        ]

    def draft(self, rows: list, limits: list) -> list:
        started = time.perf_counter()
        if self.drafter is None or not any(limits):
            proposals = [None] * len(rows)
        else:
            proposals = self.drafter.propose(rows, limits)
        self.stats.draft_s += time.perf_counter() - started
        return proposals

    def verify(self, rows: list, proposals: list) -> np.ndarray:
        started = time.perf_counter()
        seqs, starts = [], []
        for row, prop in zip(rows, proposals):
            if row.finish:
                seqs.append(None)
                starts.append(0)
            else:
                drafts = [] if prop is None else prop.tokens.tolist()
                seqs.append([row.tokens[-1]] + drafts)
                starts.append(row.target_len)
        logits = forward_padded(self.target, seqs, starts)  # [B, T, V]
        self.stats.verify_s += time.perf_counter() - started
        return logits

    def accept(self, row: Row, prop, logits: np.ndarray) -> tuple[int, int]:
        # logits: [T, V] of this row; returns (accepted count, next token)
        drafts = np.zeros(0, dtype=np.int64) if prop is None else prop.tokens
        k = len(drafts)
        if self.config.greedy:
            return accept_greedy(drafts, logits[: k + 1].argmax(axis=-1))
        p = warp(logits[: k + 1], self.config)
        q = None if prop is None else prop.q
        return accept_sampled(drafts, q, p, row.rng.random(k), row.rng)

    def commit(self, row: Row, prop, accepted: int, token: int) -> list:
        """Append the accepted drafts and the new token; apply stops; return the newly committed tokens."""
        old_len = len(row.tokens)
        new = ([] if prop is None else prop.tokens[:accepted].tolist()) + [token]
        row.tokens.extend(new)
        row.target_len = len(row.tokens) - 1
        if self.drafter is not None:
            self.drafter.commit(row, old_len + accepted)
        self._apply_stops(row, old_len)
        return row.tokens[old_len:]

    def _apply_stops(self, row: Row, old_len: int) -> None:
        for index in range(old_len, len(row.tokens)):
            if row.tokens[index] in self.eos_ids:
                del row.tokens[index + 1 :]
                row.finish = "eos"
                return
        if row.generated >= self.config.max_new_tokens:
            del row.tokens[row.prompt_len + self.config.max_new_tokens :]
            row.finish = "max_new_tokens"
        elif len(row.tokens) >= self.target.max_seq_len:
            row.finish = "length"

    def step(self, rows: list) -> list:
        """One round for every active row; returns the tokens each row committed (lists)."""
        verify_s = self.stats.verify_s
        proposals = self.draft(rows, self.limits(rows))
        logits = self.verify(rows, proposals)
        verify_s = self.stats.verify_s - verify_s
        model_counts = [0, 0]
        committed = []
        for b, (row, prop) in enumerate(zip(rows, proposals)):
            if row.finish:
                committed.append([])
                continue
            accepted, token = self.accept(row, prop, logits[b])
            proposed = 0 if prop is None else len(prop.tokens)
            self.stats.record(proposed, accepted)
            if prop is not None and prop.source == "model":
                model_counts[0] += proposed
                model_counts[1] += accepted
                self.policy.observe(proposed, accepted)
            committed.append(self.commit(row, prop, accepted, token))
        if self.gate is not None and model_counts[0]:
            self.gate.observe(*model_counts, verify_s)
        return committed
