"""The speculative loop as the engine runs it over a changing batch: rows with their own γ, and verify passes
grouped by length so rows without drafts share one batched T = 1 step (issue 12 §3).

`SpeculativeLoop` pads every row of a verify pass to a common T. On the gqa backend a T > 1 call runs row by row
(onnxruntime's CPU GroupQueryAttention takes B = 1 when T > 1 with a past), so padding a row that has no drafts to
T = γ + 1 costs it a whole extra pass and loses the batched T = 1 step. Here each distinct length is one call:
the rows without drafts go together at T = 1 (one read of the weights for all of them) and every row with k
drafts is verified at exactly T = k + 1, as it would be alone.
"""
from __future__ import annotations

from specdec.runtime.loop import SpeculativeLoop
from specdec.runtime.state import forward_rows


class ServingLoop(SpeculativeLoop):
    """`gammas` maps a KV slot to the γ of the row on it for the next round (the engine sets it every round: a
    seeded sampled request's own policy, a probe); other rows take the policy's γ."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gammas = {}  # slot -> γ

    def limits(self, rows: list, gamma: int) -> list:
        # each row as if alone: its own γ, its own room in S (verify passes are per length, not shared)
        return [super(ServingLoop, self).limits([row], self.gammas.get(row.slot, gamma))[0] for row in rows]

    def verify(self, rows: list, proposals: list) -> list:
        # -> per active row: logits [k + 1, V] for [last token, drafts...]; one forward per distinct k + 1
        seqs = [[row.tokens[-1]] + prop.tokens.tolist() if row.active else None for row, prop in zip(rows, proposals)]
        starts = [row.target_len for row in rows]
        out = [None] * len(rows)
        for steps in sorted({len(seq) for seq in seqs if seq is not None}):
            group = [seq if seq is not None and len(seq) == steps else None for seq in seqs]
            for b, logits in enumerate(forward_rows(self.target, rows, group, starts)):
                if logits is not None:
                    out[b] = logits
        return out
