"""Per-row sequence state, timed backends, padded forwards and request statistics."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

PAD_ID = 0


@dataclass
class Row:
    """One sequence. Invariant while active: target_len == len(tokens) - 1 (the last token is pending)."""

    tokens: list
    prompt_len: int
    rng: np.random.Generator
    target_len: int = 0  # valid KV slots in the target
    draft_len: int = 0  # valid KV slots in the draft model (a prefix of tokens)
    finish: str | None = None

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


class Timed:
    """Wraps a backend and adds up the wall time and count of its forward calls."""

    def __init__(self, backend):
        self.backend = backend
        self.seconds = 0.0
        self.calls = 0

    def forward(self, input_ids: np.ndarray, cache_len: np.ndarray, last_only: bool = False) -> np.ndarray:
        started = time.perf_counter()
        logits = self.backend.forward(input_ids, cache_len, last_only)
        self.seconds += time.perf_counter() - started
        self.calls += 1
        return logits

    def __getattr__(self, name):
        return getattr(self.backend, name)


def forward_padded(backend, seqs: list, starts: list, last_only: bool = False) -> np.ndarray:
    """One forward of ragged rows padded to a common T. seqs[b] is a token list or None (row idle: pads are
    written beyond starts[b], where they are masked and later overwritten). -> logits [B, T, V]
    ([B, 1, V], the position T-1, if last_only)."""
    steps = max(len(s) for s in seqs if s is not None)
    ids = np.full((len(seqs), steps), PAD_ID, dtype=np.int64)
    for row, seq in enumerate(seqs):
        if seq:
            ids[row, : len(seq)] = seq
    return backend.forward(ids, np.asarray(starts, dtype=np.int64), last_only)


def feed_chunks(backend, seqs: list, starts: list, chunk: int) -> np.ndarray:
    """Feed token lists (any lengths) in chunks; -> logits of each row's last fed token [B, V] (zeros if none).
    Every row's writes stay within S: T <= S - starts[b] for all rows."""
    starts = list(starts)
    pos = [0] * len(seqs)
    last = None
    while any(s is not None and p < len(s) for s, p in zip(seqs, pos)):
        room = min(backend.max_seq_len - st for st in starts)
        steps = min(chunk, room, max(len(s) - p for s, p in zip(seqs, pos) if s is not None))
        part = [s[p : p + steps] if s is not None and p < len(s) else None for s, p in zip(seqs, pos)]
        even = all(piece is None or len(piece) == steps for piece in part)
        logits = forward_padded(backend, part, starts, last_only=even)  # [B, T or 1, V]
        if last is None:
            last = np.zeros((len(seqs), logits.shape[-1]), dtype=logits.dtype)
        for row, piece in enumerate(part):
            if piece:
                last[row] = logits[row, -1 if even else len(piece) - 1]
                starts[row] += len(piece)
                pos[row] += len(piece)
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
