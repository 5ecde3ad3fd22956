"""The speculative loop as the engine runs it over a changing batch: rows with their own γ, and verify passes
grouped by length so rows without drafts share one batched T = 1 step.

`SpeculativeLoop` pads every row of a verify pass to a common T. On the gqa backend a T > 1 call runs row by row
(onnxruntime's CPU GroupQueryAttention takes B = 1 when T > 1 with a past), so padding a row that has no drafts to
T = γ + 1 costs it a whole extra pass and loses the batched T = 1 step. Here each distinct length is one call:
the rows without drafts go together at T = 1 (one read of the weights for all of them) and every row with k
drafts is verified at exactly T = k + 1, as it would be alone.

Rows whose tokens must not depend on their batch-mates (seeded sampled requests: slots in `alone`) draft and are
verified in calls of their own, the calls they would get offline: one row at its own T, never padded to another
row's length nor batched with other rows. Batched T = 1 steps were bitwise equal to one-row steps on onnxruntime's
CPU kernels where measured, but a padded T = 2 pass of an INT4 draft was not equal to its T = 1 pass, and other
kernels (the native engine's rows, other drafts) promise no such equality: a sampled token depends on those bits.
"""
from __future__ import annotations

from enum import Enum, auto

from specdec.runtime.drafters import EMPTY
from specdec.runtime.head_drafter import HeadState
from specdec.runtime.loop import SpeculativeLoop
from specdec.runtime.state import common_prefix, forward_rows


class Calls(Enum):
    """How a row is drafted for and verified: in calls shared with the rows of its length, or in calls of its own."""

    SHARED = auto()
    ALONE = auto()


class ServingLoop(SpeculativeLoop):
    """`gammas` maps a KV slot to the γ of the row on it for the next round (the engine sets it every round: a
    seeded sampled request's own policy, a first round's 0); other rows take the policy's γ."""

    def __init__(self, *args, reuse_prefix: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.gammas = {}  # slot -> γ
        self.alone = set()  # slots whose rows draft and are verified in calls of their own
        # Prefix reuse: a slot keeps the K/V of the last request it served, its committed tokens at positions below
        # its target_len (later calls write only at or past a row's target_len). A request admitted to it skips
        # the prefill of the tokens it shares with them (a chat template's system prompt, an earlier turn of the
        # conversation) where the backend's K/V of a position depends only on the tokens up to it.
        self.reuse_prefix = reuse_prefix and getattr(self.target, "exact_prefix_kv", False)
        self.holders = {}  # slot -> the row whose K/V it holds
        # The draft head's K/V of position j depends only on the tokens up to j + 1 (the target's hidden states at j
        # and the token after), never on its K/V before, and its catch-up feeds verified positions alone; the
        # target's hidden states of a position, like its K/V, depend only on the tokens up to it. So a head row
        # admitted to a slot keeps what the slot's last row's head holds of their shared prefix (head_kept).
        self.head_kept = {}  # slot -> (its last row's HeadState, tokens shared, reusable start) or None, until a prefill

    def held(self, slot: int) -> list:
        """The tokens whose target K/V `slot` holds at positions 0.. (none where reuse is off)."""
        row = self.holders.get(slot)
        return row.tokens[: row.target_len] if self.reuse_prefix and row is not None else []

    def best_slot(self, free: list, tokens: list) -> int:
        """The free slot holding the longest prefix of `tokens`; the lowest of equals (fewer holes in a batched
        T = 1 run over slots 0..max)."""
        return min(free, key=lambda slot: (-common_prefix(self.held(slot), tokens), slot))

    def reusable(self, row, seq: list) -> int:
        previous = self.holders.get(row.slot)
        held = self.held(row.slot) if previous is not row else []
        self.holders[row.slot] = row  # from now on the slot holds this row's K/V (none, until its prefill ends)
        shared = common_prefix(held, seq)
        start = min(shared, len(seq) - 1)  # the last token is fed: its logits give the first token
        state = previous.head if held else None  # (copied only where a head row's prefill takes it)
        self.head_kept[row.slot] = None if state is None else (state, shared, start)
        return start

    def tapped_start(self, row, start: int) -> int:
        """A head row starts from what its slot's last row's head held of their shared prefix (head_kept): its
        prefill skips the positions whose head K/V or target hidden states that holds, at most `start`."""
        found = self.head_kept.pop(row.slot, None)
        kept = None if found is None else head_prefix(*found)
        if kept is None:
            return 0
        reach = min(start, kept.length + kept.count)  # (start >= kept.length: both stop short of the shared prefix)
        kept.keep(reach - kept.length)
        row.head = kept
        return reach

    def limits(self, rows: list, gamma: int) -> list:
        # each row as if alone: its own γ, its own room in S (verify passes are per length, not shared)
        return [super(ServingLoop, self).limits([row], self.gammas.get(row.slot, gamma))[0] for row in rows]

    def draft(self, rows: list, limits: list) -> list:
        groups = self._groups(rows, [(Calls.SHARED,)] * len(rows))
        if list(groups) == [(Calls.SHARED,)]:
            return super().draft(rows, limits)
        proposals = [EMPTY] * len(rows)
        for members in groups.values():
            mine = [limits[b] if b in members else 0 for b in range(len(rows))]
            for b, proposal in enumerate(super().draft(rows, mine)):
                if b in members:
                    proposals[b] = proposal
        return proposals

    def verify(self, rows: list, proposals: list) -> list:
        # -> per active row: logits [k + 1, V] for [last token, drafts...]; one forward per distinct k + 1 (and one per
        # row in `alone`)
        seqs = [[row.tokens[-1]] + prop.tokens.tolist() if row.active else None for row, prop in zip(rows, proposals)]
        starts = [row.target_len for row in rows]
        out = [None] * len(rows)
        groups = self._groups(rows, [(Calls.SHARED, len(seq)) if seq is not None else None for seq in seqs])
        for members in groups.values():
            group = [seqs[b] if b in members else None for b in range(len(rows))]
            for b, logits in enumerate(forward_rows(self.target, rows, group, starts, tap=self.tap(rows, group))):
                if logits is not None:
                    out[b] = logits
        return out

    def _groups(self, rows: list, shared_keys: list) -> dict:
        """key -> rows (indices) that share calls: a row in `alone` has a group of its own; the others go by
        `shared_keys[b]` (None: the row takes no part)."""
        groups = {}
        for b, (row, key) in enumerate(zip(rows, shared_keys)):
            if key is not None:
                groups.setdefault((Calls.ALONE, row.slot) if row.slot in self.alone else key, []).append(b)
        return groups


def head_prefix(state, shared: int, start: int):
    """What a head row that shares its first `shared` tokens with the row before it on its slot keeps of that row's
    head (`state`, a HeadState, or None) for a prefill from `start`: the head K/V of the positions that head fed, as
    far as the shared tokens reach (position j read token j + 1), and where it fed all of those, the target's hidden
    states it held of the positions after, below `start` -> a HeadState of its own (the features copied), or None."""
    if state is None or shared == 0:
        return None
    kept = HeadState(length=min(state.length, shared - 1))
    wanted = min(start - kept.length, state.count) if kept.length == state.length else 0
    if wanted > 0:
        kept.put(0, state.pending[:wanted])
    return kept if kept.length + kept.count else None

