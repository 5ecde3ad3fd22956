"""The speculative loop of Leviathan et al.: the prefill, whose last logits give each request's first token, then
rounds of draft -> verify -> accept -> commit.

Rows of a batch are verified together: proposals are padded to a common T, each row has its own cache_len, KV
slot and request options (sampling, seed, stops, max_new_tokens, drafter), and acceptance is ragged. Rollback is
moving a length. A row ends on EOS, a stop string, max_new_tokens, or `length` when the static buffers are
full; nothing is ever written past S. `step` returns a Round record that Stats, the γ policy and the gates
observe.
"""
from __future__ import annotations

import time

import numpy as np

from specdec.runtime.config import DrafterName
from specdec.runtime.drafters import EMPTY, Proposal
from specdec.runtime.sampling import accept_greedy, accept_sampled, gumbel_choice, warp
from specdec.runtime.state import Finish, Round, Row, RowRound, feed_chunks, forward_rows
from specdec.runtime.text import StopStrings


class SpeculativeLoop:
    def __init__(self, target, drafters: dict, policy, chunk: int, eos_ids, stops: StopStrings | None = None):
        self.target = target  # an Observed backend (specdec.runtime.forward)
        self.drafters = drafters  # DrafterKind -> drafter (kinds that draft nothing have none)
        self.policy = policy  # γ for the next round (specdec.runtime.adaptive_gamma)
        self.chunk = chunk
        self.eos_ids = frozenset(eos_ids)
        self.stops = stops

    def prefill(self, rows: list) -> tuple[float, Round | None]:
        """Target KV of every row's committed tokens; -> (seconds, the Round of the first tokens or None).

        A row with no generated token yet is fed whole, and the logits of its last prompt position give its first
        token, as a verify pass of no drafts would: the first token costs the prefill and nothing more, in every
        mode, and the first drafted round starts from it. A row that has generated tokens (its request resumed
        after another used the models) is fed all but its pending last token, which its next round verifies."""
        started = time.perf_counter()
        fresh = [row.active and row.generated == 0 for row in rows]
        seqs = [None if not row.active else row.tokens if new else row.tokens[:-1] for row, new in zip(rows, fresh)]
        starts = [self.reusable(row, seq) if seq else 0 for row, seq in zip(rows, seqs)]
        starts = [self.tapped_start(row, start) if self.feature_tap(row) else start for row, start in zip(rows, starts)]
        for row, start in zip(rows, starts):
            row.reused = start
        logits = feed_chunks(self.target, rows, [seq[start:] if seq else seq for seq, start in zip(seqs, starts)],
                             starts, self.chunk, self.tap(rows, seqs))  # [V] of each row's last
        records = []
        for row, new, last in zip(rows, fresh, logits):
            row.target_len, row.draft_len, row.kv_copied = len(row.tokens) - 1, 0, 0
            if not new:
                records.append(None)
                continue
            _, token = self.accept(row, EMPTY, last[None])
            committed = self.commit(row, EMPTY, 0, token)
            records.append(RowRound(0, 0, committed, EMPTY.source, row.finish))
        seconds = time.perf_counter() - started
        return seconds, Round(0, records, 0.0, 0.0) if any(fresh) else None

    def reusable(self, row, seq: list) -> int:
        """Leading tokens of `seq` whose target KV the row's slot already holds, so the prefill starts after them
        (here none; the serving loop keeps what earlier requests left in their slots)."""
        return 0

    def tapped_start(self, row, start: int) -> int:
        """Where the prefill of a row whose drafter reads the target's hidden states starts, `start` of its prefix
        reusable: here 0 (the head needs the hidden states of every position it has not fed)."""
        return 0

    def limits(self, rows: list, gamma: int) -> list:
        """Drafts each row may get: γ (capped by the row's own gamma), what max_new_tokens leaves, what S leaves
        for this row and for the verify pass every active row shares."""
        size = self.target.max_seq_len
        active = [row for row in rows if row.active]
        shared_room = min((size - len(row.tokens) for row in active), default=0)
        return [
            0 if not row.active or not row.drafter.drafts
            else max(0, min(gamma if row.config.gamma is None else min(gamma, row.config.gamma),
                            row.config.max_new_tokens - row.generated - 1, size - len(row.tokens) - 1, shared_room))
            for row in rows
        ]

    def draft(self, rows: list, limits: list) -> list:
        proposals = [EMPTY] * len(rows)
        for kind, drafter in self.drafters.items():
            mine = [lim if row.drafter is kind else 0 for row, lim in zip(rows, limits)]
            if any(mine):
                for b, prop in enumerate(drafter.propose(rows, mine)):
                    if mine[b]:
                        proposals[b] = prop
        return proposals

    def verify(self, rows: list, proposals: list) -> list:
        # -> per active row: logits [k + 1, V] for [last token, drafts...]
        seqs = [[row.tokens[-1]] + prop.tokens.tolist() if row.active else None for row, prop in zip(rows, proposals)]
        return forward_rows(self.target, rows, seqs, [row.target_len for row in rows], tap=self.tap(rows, seqs))

    def feature_tap(self, row):
        """The drafter that reads the target's hidden states of `row` (the head drafter, of drafter head or of auto
        where the bundle has a head), or None."""
        tap = getattr(self.drafters.get(row.drafter), "feature_tap", None)
        return None if tap is None else tap(row)

    def tap(self, rows: list, seqs: list):
        """The drafter that reads the target's hidden states (the head drafter), where a row this pass feeds drafts
        with it; else None, and the pass asks for logits alone."""
        for row, seq in zip(rows, seqs):
            tap = self.feature_tap(row) if seq else None
            if tap is not None:
                return tap
        return None

    @staticmethod
    def accept(row: Row, prop: Proposal, logits: np.ndarray) -> tuple[int, int]:
        # logits: [k + 1, V] of this row -> (accepted count, next token)
        config, drafts = row.config, prop.tokens
        if config.greedy:  # a device backend's logits answer argmax from the ids that came back with them
            return accept_greedy(drafts, logits.argmax(axis=-1))
        if config.gumbel:  # the target's own coupled samples; drafts are accepted while they match
            probs, vocab = warp(logits, config), logits.shape[-1]
            chosen = [gumbel_choice(probs[j], row.noise(row.generated + j, vocab)) for j in range(len(drafts) + 1)]
            return accept_greedy(drafts, np.asarray(chosen))
        return accept_sampled(drafts, prop.q, warp(logits, config), row.rng.random(len(drafts)), row.rng)

    def commit(self, row: Row, prop: Proposal, accepted: int, token: int) -> list:
        """Append the accepted drafts and the new token, apply the stops; -> the newly committed tokens."""
        old_len = len(row.tokens)
        row.tokens.extend(prop.tokens[:accepted].tolist() + [token])
        row.target_len = len(row.tokens) - 1
        row.draft_len = min(row.draft_len, old_len + accepted)  # the draft's KV is valid for the kept prefix only
        self._apply_stops(row, old_len)
        return row.tokens[old_len:]

    def _apply_stops(self, row: Row, old_len: int) -> None:
        for index in range(old_len, len(row.tokens)):
            if row.tokens[index] in self.eos_ids:
                del row.tokens[index + 1 :]
                row.finish = Finish.EOS
                break
        if row.generated >= row.config.max_new_tokens:
            del row.tokens[row.prompt_len + row.config.max_new_tokens :]
            row.finish = row.finish or Finish.MAX_NEW_TOKENS
        if self.stops is not None and row.config.stop:
            self.stops.apply(row, since=old_len - row.prompt_len)
        if row.active and len(row.tokens) >= self.target.max_seq_len:
            row.finish = Finish.LENGTH

    def step(self, rows: list) -> Round:
        """One round for every active row."""
        gamma = self.policy.gamma
        started = time.perf_counter()
        proposals = self.draft(rows, self.limits(rows, gamma))
        verified = time.perf_counter()
        logits = self.verify(rows, proposals)
        draft_s, verify_s = verified - started, time.perf_counter() - verified
        records = []
        for row, prop, row_logits in zip(rows, proposals, logits):
            if not row.active:
                records.append(None)
                continue
            accepted, token = self.accept(row, prop, row_logits)
            committed = self.commit(row, prop, accepted, token)
            records.append(RowRound(len(prop.tokens), accepted, committed, prop.source, row.finish, prop.strong))
        record = Round(gamma, records, draft_s, verify_s)
        self.policy.observe(record)
        self._teach_gates(rows, record)
        return record

    @staticmethod
    def _teach_gates(rows: list, record: Round) -> None:
        """Each gate learns once per round from the model rounds of the rows it decides for, and from rounds in
        which no row verified drafts (a one-token pass)."""
        runs = {}  # per gate: (gate, [(proposed, accepted) of each of its rows])
        for row, row_record in zip(rows, record.rows):
            gate = None if row_record is None else \
                {DrafterName.MODEL: row.gate, DrafterName.HEAD: row.head_gate}.get(row_record.source)
            if gate is not None:
                runs.setdefault(id(gate), (gate, []))[1].append((row_record.proposed, row_record.accepted))
        for gate, pairs in runs.values():
            gate.observe(sum(p for p, _ in pairs), sum(a for _, a in pairs), record.verify_s, pairs)
        if not runs:  # lookups alone: each gate learns what its rows' lookups emitted for the pass
            looked = {}  # per gate: (gate, {strong: [tokens emitted by each of its rows that looked up]})
            for row, row_record in zip(rows, record.rows):
                if row_record is not None and row.gate is not None and row_record.proposed:
                    kinds = looked.setdefault(id(row.gate), (row.gate, {}))[1]
                    kinds.setdefault(row_record.strong, []).append(row_record.accepted + 1)
            for gate, kinds in looked.values():
                for strong, emitted in kinds.items():
                    gate.observe_lookup(strong, sum(emitted) / len(emitted), record.verify_s)
        if not any(row_record is not None and row_record.proposed for row_record in record.rows):
            gates = [gate for row in rows for gate in (row.gate, row.head_gate) if gate is not None]
            for gate in {id(gate): gate for gate in gates}.values():
                gate.observe_plain(record.verify_s)  # every row verified one token: a plain step
