"""γ per round from measured goodput (issue 12 §4): speculation only where it beats plain decoding at this load.

A round over n rows, m of them drafting with the model at γ, costs on the onnxruntime gqa backend
    γ = 0:  T1(n)                                   one batched T=1 target step (one read of the weights)
    γ > 0:  γ·D1(m) + m·V(γ+1) + T1(n − m)          γ batched draft steps (catch-up included), the verify passes
                                                      of the drafting rows one row at a time (GroupQueryAttention
                                                      on the CPU takes B = 1 when T > 1), the others batched
plus n·h of host time (sampling, acceptance, bookkeeping), and emits n − m + m·(1 + A_1 + … + A_γ) tokens, with
A_j the running per-position acceptance. The controller picks the γ in 0..γ_max with the most tokens per second.
T1, D1 and V are measured at start (`measure_costs`) and follow every round (exponential moving averages), so
the choice tracks the machine's load; ties go to the smaller γ.

Greedy rows' output never depends on γ. Seeded sampled rows keep their own deterministic γ policy (the engine
pins them), so the choice here never reaches their tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from specdec.lowering import PAD_ID
from specdec.runtime.adaptive_gamma import AdaptiveGamma, GammaPolicy, cumulative_from_conditional

EMA = 0.2  # weight of the newest round in a moving average


@dataclass
class Costs:
    """Seconds per forward call on this machine."""

    target_step: np.ndarray  # [B + 1]: batched T = 1 target forward over n rows at index n (index 0: 0)
    draft_step: np.ndarray  # [B + 1]: the same for the draft (zeros without a draft)
    verify: np.ndarray  # [γ_max + 2]: one-row target forward of T tokens at index T
    host_row: float = 0.0  # host seconds per row and round

    def update(self, table: np.ndarray, index: int, seconds: float) -> None:
        if 0 < index < len(table) and seconds > 0:
            table[index] += EMA * (seconds - table[index])


def _median_time(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def measure_costs(target, draft, batch: int, gamma_max: int, length: int = 64, repeats: int = 3) -> Costs:
    """Time the calls a round is made of, on empty slots (before any request holds one): batched T = 1 steps of
    both models for n = 1..batch and one-row target passes of T = 2..γ_max + 1, at cache length `length`."""
    length = min(length, target.max_seq_len - gamma_max - 2)

    def step(backend, rows: int):
        ids = np.full((rows, 1), PAD_ID, dtype=np.int64)  # [n, 1]
        lens = np.full(rows, length, dtype=np.int64)
        return lambda: backend.forward(ids, lens, True, np.arange(rows, dtype=np.int64))

    def verify(steps: int):
        ids = np.full((1, steps), PAD_ID, dtype=np.int64)  # [1, T]
        return lambda: target.forward(ids, np.asarray([length], dtype=np.int64), False, np.zeros(1, dtype=np.int64))

    sizes = range(1, batch + 1)
    target_step = np.zeros(batch + 1)
    draft_step = np.zeros(batch + 1)
    verify_s = np.zeros(gamma_max + 2)
    for rows in sizes:
        target_step[rows] = _median_time(step(target, rows), repeats)
        if draft is not None:
            draft_step[rows] = _median_time(step(draft, rows), repeats)
    verify_s[1] = target_step[1]
    for steps in range(2, gamma_max + 2):
        verify_s[steps] = _median_time(verify(steps), repeats)
    return Costs(target_step, draft_step, verify_s)


class GoodputGamma(GammaPolicy):
    """The engine's γ policy: `plan(rows, drafting)` before a round sets `gamma`; the loop's `observe(record)`
    after it updates costs and acceptance. mode: "adaptive" (goodput), "fixed" (always `fixed`), "off" (0)."""

    def __init__(self, costs: Costs, gamma_max: int, mode: str = "adaptive", fixed: int = 4,
                 prior_alpha=0.7, has_model: bool = True):
        self.costs = costs
        self.gamma_max = gamma_max
        self.mode = mode
        self.fixed = min(fixed, gamma_max)
        self.has_model = has_model
        self.acceptance = AdaptiveGamma(gamma_max, 1.0, prior_alpha)  # its running per-position α only
        self.gamma = 0 if mode == "off" else self.fixed

    def expected(self, rows: int, drafting: int, gamma: int) -> tuple[float, float]:
        """(tokens, seconds) of a round over `rows` rows, `drafting` of them drafting at `gamma`."""
        c = self.costs
        host = rows * c.host_row
        if gamma == 0 or drafting == 0:
            return float(rows), c.target_step[rows] + host
        gains = cumulative_from_conditional(self.acceptance.alphas)[:gamma]  # [γ] A_1..A_γ
        tokens = rows - drafting + drafting * (1.0 + float(gains.sum()))
        draft = gamma * c.draft_step[drafting] if self.has_model else 0.0
        seconds = draft + drafting * c.verify[gamma + 1] + c.target_step[rows - drafting] + host
        return tokens, seconds

    def best(self, rows: int, drafting: int) -> int:
        """The γ in 0..γ_max with the highest expected tokens per second (ties: the smaller)."""
        rates = [tokens / seconds for tokens, seconds in
                 (self.expected(rows, drafting, g) for g in range(self.gamma_max + 1))]
        return int(np.argmax(rates))

    def plan(self, rows: int, drafting: int) -> int:
        """Set and return γ for the next round of `rows` active rows, `drafting` of which may draft."""
        if self.mode == "adaptive" and rows:
            self.gamma = self.best(min(rows, len(self.costs.target_step) - 1), drafting)
        return self.gamma

    def observe(self, record) -> None:
        """Learn from a Round record: per-position acceptance of model rows, and the cost of the calls it made
        where the record pins them down (every row with the same number of drafts)."""
        rows = [row for row in record.rows if row is not None]
        if not rows:
            return
        for row in rows:
            if row.source == "model":
                self.acceptance.observe_row(row.proposed, row.accepted)
        proposed = {row.proposed for row in rows}
        if len(proposed) != 1:
            return
        k = proposed.pop()
        if k == 0:
            self.costs.update(self.costs.target_step, len(rows), record.verify_s)
            return
        self.costs.update(self.costs.verify, k + 1, record.verify_s / len(rows))
        if all(row.source == "model" for row in rows):
            self.costs.update(self.costs.draft_step, len(rows), record.draft_s / k)

    def observe_host(self, seconds: float, rows: int) -> None:
        """Round wall time outside the draft and verify calls, over `rows` rows."""
        if rows:
            self.costs.host_row += EMA * (max(seconds, 0.0) / rows - self.costs.host_row)
