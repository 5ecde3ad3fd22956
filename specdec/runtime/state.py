"""Per-row sequence state, the per-round record, timed backends, slot-addressed forwards and request statistics."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from specdec.lowering import PAD_ID
from specdec.runtime.config import DrafterName, GenerationConfig
from specdec.runtime.forward import ForwardRequest
from specdec.runtime.sampling import gumbel_noise


class Finish(StrEnum):
    """Why a row stopped (its `finish`, the result's finish_reason)."""

    EOS = "eos"
    MAX_NEW_TOKENS = "max_new_tokens"
    STOP = "stop"  # a stop string
    LENGTH = "length"  # the bundle's max_seq_len


MODEL_SOURCES = (DrafterName.MODEL, DrafterName.HEAD)  # drafts of a model, whose acceptance γ policies learn


def row_rng(seed: int | None, row: int) -> np.random.Generator:
    """The random stream of row `row` of a request seeded `seed`: from (seed, row), so rows and requests never
    share a stream (seed 1 row 1 and seed 2 row 0 differ). None: fresh entropy."""
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(row,)))


@dataclass
class Row:
    """One sequence with its own request options. Invariant while active: target_len == len(tokens) - 1 (the
    last token is pending)."""

    tokens: list
    prompt_len: int
    rng: np.random.Generator
    config: GenerationConfig = field(default_factory=GenerationConfig)
    slot: int = 0  # KV slot in both backends
    target_len: int = 0  # valid KV slots in the target
    draft_len: int = 0  # valid KV slots in the draft model (a prefix of tokens)
    kv_copied: int = 0  # draft KV slots [0, kv_copied) hold the target's KV (a draft that copies it)
    reused: int = 0  # prompt tokens its prefill did not feed: their target KV was already in the slot
    finish: Finish | None = None
    gate: object = None  # the ModelGate deciding `auto` for this row (specdec.runtime.drafters)
    head_gate: object = None  # ... its gate of the draft head, where `auto` weighs one (a greedy request), or None
    stop_at: int | None = None  # for Finish.STOP: the text length at which the stop string begins
    noise_key: tuple | None = None  # (seed, row) of the Gumbel noise under Coupling.GUMBEL
    noise_cache: dict = field(default_factory=dict, repr=False)  # position -> noise, drafted but not yet verified
    drafter: object = None  # the DrafterKind of config.drafter (specdec.runtime.config.DRAFTER_KINDS)
    head: object = None  # the head drafter's state of this row (specdec.runtime.head_drafter.HeadState), or None

    def __post_init__(self):
        if self.drafter is None:
            self.drafter = self.config.drafter_kind

    def noise(self, position: int, vocab: int) -> np.ndarray:
        """The Gumbel noise [vocab] of generated position `position` (0 = the first generated token); the draft and
        the verify pass of a round ask for the same positions, so it is made once."""
        for old in [p for p in self.noise_cache if p < self.generated]:
            del self.noise_cache[old]
        noise = self.noise_cache.get(position)
        if noise is None or len(noise) < vocab:
            noise = self.noise_cache[position] = gumbel_noise(*self.noise_key, position, vocab)
        return noise[:vocab]

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def active(self) -> bool:
        return self.finish is None


@dataclass(frozen=True)
class RowRound:
    """What one round did to one row."""

    proposed: int  # drafts verified
    accepted: int
    committed: list  # tokens appended (after stops)
    source: DrafterName  # the drafter that proposed the drafts (NONE: none were)
    finish: Finish | None
    strong: bool = False  # a lookup that matched the longest n-gram and filled the whole limit (Proposal.strong)

    @property
    def from_model(self) -> bool:
        """Whether a model (the draft model or a draft head) proposed this row's drafts: what γ policies learn
        acceptance from (the `auto` gate learns from the draft model's alone)."""
        return self.source in MODEL_SOURCES


@dataclass(frozen=True)
class Round:
    """The record `SpeculativeLoop.step` returns; Stats, the γ policy and the gates observe it."""

    gamma: int
    rows: list  # RowRound per row of the batch, or None for rows that were not active
    draft_s: float
    verify_s: float

    def model_counts(self) -> tuple[int, int]:
        """(proposed, accepted) over the rows whose drafts came from the model."""
        model = [r for r in self.rows if r is not None and r.from_model]
        return sum(r.proposed for r in model), sum(r.accepted for r in model)


def common_prefix(first: list, second: list) -> int:
    """How many leading items two sequences share."""
    n = 0
    for a, b in zip(first, second):
        if a != b:
            break
        n += 1
    return n


def forward_rows(backend, rows: list, seqs: list, starts: list, last_only: bool = False, tap=None) -> list:
    """One forward of the rows whose seqs[b] is a token list, padded to a common T, on their slots.
    -> per row: logits [T_b, V] (or [1, V] of its last position when last_only), None for rows not fed.
    Pads land beyond each row's own tokens, where they are masked and later overwritten. tap: a drafter that reads the
    target's hidden states (HeadDrafter), or None: the call asks for its `feature_layers` and hands each fed row's
    [T_b, F, H] to its observe(row, start, features)."""
    fed = [b for b, seq in enumerate(seqs) if seq]
    out = [None] * len(rows)
    if not fed:
        return out
    steps = max(len(seqs[b]) for b in fed)
    ids = np.full((len(fed), steps), PAD_ID, dtype=np.int64)
    for i, b in enumerate(fed):
        ids[i, : len(seqs[b])] = seqs[b]
    cache_len = np.asarray([starts[b] for b in fed], dtype=np.int64)
    slots = np.asarray([rows[b].slot for b in fed], dtype=np.int64)
    if tap is None:
        logits = backend.forward(ids, cache_len, last_only, slots)  # [n, T or 1, V]
    else:
        result = backend.run(ForwardRequest(ids, cache_len, last_only, slots, tap.feature_layers))
        logits = result.logits
        for i, b in enumerate(fed):
            tap.observe(rows[b], starts[b], result.features[i, : len(seqs[b])])  # [T_b, F, H]
    for i, b in enumerate(fed):
        out[b] = logits[i] if last_only else logits[i, : len(seqs[b])]
    return out


def feed_chunks(backend, rows: list, seqs: list, starts: list, chunk: int, tap=None) -> list:
    """Feed token lists (any lengths, None for rows not fed) in chunks; -> per row the logits [V] of its last fed
    token (None if not fed). Rows whose pieces have the same length share a call, and only the last position's
    logits are computed (a ragged batch padded to one T would need every position's: [B, T, V], 100 MB for two rows
    of a 256-token chunk of a 49k vocabulary). Every row's writes stay within S. tap: as forward_rows'."""
    starts, pos = list(starts), [0] * len(seqs)
    last = [None] * len(seqs)
    while any(s and p < len(s) for s, p in zip(seqs, pos)):
        pieces = {}  # piece length -> rows
        for b, seq in enumerate(seqs):
            if seq and pos[b] < len(seq):
                steps = min(chunk, len(seq) - pos[b], backend.max_seq_len - starts[b])
                pieces.setdefault(steps, []).append(b)
        for steps, group in sorted(pieces.items()):
            part = [seqs[b][pos[b] : pos[b] + steps] if b in group else None for b in range(len(seqs))]
            logits = forward_rows(backend, rows, part, starts, last_only=True, tap=tap)
            for b in group:
                last[b] = logits[b][-1]
                starts[b] += steps
                pos[b] += steps
    return last


@dataclass
class Stats:
    """Per request (all rows together); metric names follow vLLM."""

    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    verify_passes: int = 0
    position_proposed: list = field(default_factory=list)
    position_accepted: list = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    forward_s: float = 0.0  # inside backend forward calls, both models
    total_s: float = 0.0
    first_token_s: float = 0.0

    def observe(self, record: Round) -> None:
        self.draft_s += record.draft_s
        self.verify_s += record.verify_s
        for row in record.rows:
            if row is not None:
                self.record(row.proposed, row.accepted)

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.emitted += accepted + 1
        self.verify_passes += 1
        grow = proposed - len(self.position_proposed)
        if grow > 0:
            self.position_proposed += [0] * grow
            self.position_accepted += [0] * grow
        for i in range(proposed):
            self.position_proposed[i] += 1
            self.position_accepted[i] += int(i < accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return self.emitted / self.verify_passes if self.verify_passes else 0.0

    @property
    def per_position_acceptance(self) -> list:
        return [a / p if p else 0.0 for a, p in zip(self.position_accepted, self.position_proposed)]

    @property
    def host_s(self) -> float:
        """Wall time outside backend forward calls: sampling, acceptance, bookkeeping, detokenizing."""
        return max(0.0, self.total_s - self.forward_s)

    @property
    def tokens_per_s(self) -> float:
        return self.emitted / self.total_s if self.total_s else 0.0

    def summary(self) -> str:
        return (
            f"{self.emitted} tokens in {self.total_s:.2f} s ({self.tokens_per_s:.1f} tok/s), "
            f"acceptance {self.acceptance_rate:.2f}, mean acceptance length {self.mean_acceptance_length:.2f}, "
            f"prefill {self.prefill_s * 1e3:.0f} ms, draft {self.draft_s * 1e3:.0f} ms, "
            f"verify {self.verify_s * 1e3:.0f} ms, host {self.host_s * 1e3:.0f} ms"
        )
