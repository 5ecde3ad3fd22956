"""Draft-length (γ) policies, numpy only.

The formula of docs/design.md with per-position acceptance: let α_i be the probability that draft i is accepted given
drafts 1..i−1 were, and A_j = α_1···α_j. A round with γ drafts emits E(γ) = 1 + A_1 + ... + A_γ tokens on average and
costs γ·c + r(γ) target-pass units (c: draft step / target step; r(γ): verify pass of γ+1 tokens / one-token pass, 1
in the paper's model). With a constant α this is the paper's (1 − α^(γ+1)) / ((1 − α)(γc + 1)).

Policies share one interface: `gamma` (drafts to ask for next round) and `observe(round)`, which learns from the
rows of a round record (specdec.runtime.state.Round) whose drafts came from the model.
- `FixedGamma`: always the same γ.
- `AdaptiveGamma` (ours): running per-position acceptance (a prior from calibration, decayed counts from this
  request), γ = the argmax of the formula over 1..γ_max after every round.
- `HeuristicGamma` (Hugging Face assisted generation): +2 when every draft was accepted, −1 otherwise.
`GAMMA_POLICY_KINDS` maps the `gamma_policy=` names to them.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Callable

import numpy as np


def expected_tokens(cumulative: np.ndarray, gamma: int) -> float:
    """1 + A_1 + ... + A_γ. cumulative: [G] with A_j at index j−1."""
    return 1.0 + float(np.sum(cumulative[:gamma]))


def speedup_table(cumulative, cost_ratio: float, verify_cost=None) -> np.ndarray:
    """Expected speedup over plain decoding for γ = 1..G. cumulative: [G]; verify_cost: [G] r(γ) or None (1).
    -> [G]"""
    cumulative = np.asarray(cumulative, dtype=np.float64)
    gammas = np.arange(1, len(cumulative) + 1)
    tokens = 1.0 + np.cumsum(cumulative)  # [G]
    verify = np.ones(len(gammas)) if verify_cost is None else np.asarray(verify_cost, dtype=np.float64)
    return tokens / (gammas * cost_ratio + verify)


def expected_speedup(alpha: float, gamma: int, cost_ratio: float) -> float:
    """The formula with a constant α: (1 - α^(γ+1)) / ((1 - α)(γc + 1)), the speedup over plain decoding."""
    cumulative = float(alpha) ** np.arange(1, gamma + 1)  # A_j = α^j
    return float(speedup_table(cumulative, cost_ratio)[-1]) if gamma > 0 else 1.0


def best_gamma(cumulative, cost_ratio: float, verify_cost=None) -> int:
    """The γ in 1..len(cumulative) with the highest expected speedup (ties go to the smaller γ)."""
    return int(np.argmax(speedup_table(cumulative, cost_ratio, verify_cost))) + 1


def cumulative_from_conditional(alphas) -> np.ndarray:
    """[α_1..α_G] -> [A_1..A_G]"""
    return np.cumprod(np.clip(np.asarray(alphas, dtype=np.float64), 0.0, 1.0))


def conditional_from_cumulative(cumulative) -> np.ndarray:
    """[A_1..A_G] -> [α_1..α_G]; a position after A_j = 0 repeats the last defined α."""
    cumulative = np.clip(np.asarray(cumulative, dtype=np.float64), 0.0, 1.0)
    previous = np.concatenate([[1.0], cumulative[:-1]])
    alphas = np.divide(cumulative, previous, out=np.zeros_like(cumulative), where=previous > 0)
    for i in range(1, len(alphas)):
        if previous[i] == 0:
            alphas[i] = alphas[i - 1]
    return alphas


class GammaPolicy:
    gamma: int

    def observe(self, record) -> None:
        """Learn from the model-drafted rows of a round record."""
        for row in record.rows:
            if row is not None and row.from_model:
                self.observe_row(row.proposed, row.accepted)

    def observe_row(self, proposed: int, accepted: int) -> None:
        """Nothing to learn."""


class FixedGamma(GammaPolicy):
    def __init__(self, gamma: int):
        self.gamma = gamma


class HeuristicGamma(GammaPolicy):
    """Hugging Face's schedule: γ += 2 after a round whose drafts were all accepted, γ −= 1 otherwise."""

    def __init__(self, gamma: int, gamma_max: int):
        self.gamma = gamma
        self.gamma_max = gamma_max

    def observe_row(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        step = 2 if accepted == proposed else -1
        self.gamma = int(min(self.gamma_max, max(1, self.gamma + step)))


class AdaptiveGamma(GammaPolicy):
    """γ from running per-position acceptance. prior_alphas: [γ_max] conditional α_i from calibration (or one
    value for every position); prior_weight: pseudo-rounds the prior counts for; decay: weight of older rounds.
    A position this request has not reached yet takes the estimate of the deepest one it has (so γ can grow
    past the positions seen so far)."""

    def __init__(self, gamma_max: int, cost_ratio: float, prior_alphas, prior_weight: float = 8.0,
                 decay: float = 0.95, verify_cost=None):
        prior = np.broadcast_to(np.asarray(prior_alphas, dtype=np.float64), (gamma_max,))
        self.gamma_max = gamma_max
        self.cost_ratio = cost_ratio
        self.verify_cost = verify_cost
        self.decay = decay
        self.reached = np.full(gamma_max, prior_weight)  # [G] rounds that reached position i
        self.accepted = prior * prior_weight  # [G] of those, rounds that accepted it
        self.seen = np.zeros(gamma_max)  # [G] decayed rounds of this request that reached position i
        self.gamma = self._choose()

    @property
    def alphas(self) -> np.ndarray:
        alphas = self.accepted / self.reached  # [G] conditional acceptance
        for i in range(1, len(alphas)):
            if self.seen[i] < 1.0 <= self.seen[i - 1]:
                alphas[i:] = alphas[i - 1]
                break
        return alphas

    def _choose(self) -> int:
        return best_gamma(cumulative_from_conditional(self.alphas), self.cost_ratio, self.verify_cost)

    def observe_row(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.reached *= self.decay
        self.accepted *= self.decay
        self.seen *= self.decay
        reached = min(accepted + 1, proposed)  # positions 0..reached-1 were looked at
        self.reached[:reached] += 1.0
        self.seen[:reached] += 1.0
        self.accepted[:accepted] += 1.0
        self.gamma = self._choose()


def adaptive_from_record(record, gamma_max: int, alpha: float, cost_ratio: float) -> AdaptiveGamma:
    """AdaptiveGamma seeded from a bundle's γ calibration (a GammaRecord, or None: alphas, cost ratio, and the
    measured verify cost r(γ) when the calibration used it); `alpha` and `cost_ratio` stand in for what it lacks."""
    if record is None:
        return AdaptiveGamma(gamma_max, cost_ratio, np.full(gamma_max, alpha))
    alphas = np.resize(record.alphas or [alpha], gamma_max)
    verify = record.verify_cost if record.verify_cost_used else None
    if verify is not None:  # measured for γ = 1..len(verify); beyond it, the last step's growth continues
        verify = np.asarray(verify, dtype=np.float64)
        slope = verify[-1] - verify[-2] if len(verify) > 1 else 0.0
        extra = verify[-1] + slope * np.arange(1, max(gamma_max - len(verify), 0) + 1)
        verify = np.concatenate([verify, extra])[:gamma_max]
    return AdaptiveGamma(gamma_max, record.cost_ratio or cost_ratio, alphas, verify_cost=verify)


@dataclass(frozen=True)
class GammaStart:
    """What a request's γ policy starts from: its γ, the bundle's γ_max and γ calibration (a GammaRecord or None),
    and the acceptance and cost ratio that stand in where the calibration says nothing."""

    gamma: int
    gamma_max: int
    record: object
    alpha: float
    cost_ratio: float


class GammaPolicyName(StrEnum):
    """A `gamma_policy=` value."""

    FIXED = "fixed"
    ADAPTIVE = "adaptive"
    HEURISTIC = "heuristic"


@dataclass(frozen=True)
class PolicyKind:
    """One `gamma_policy=` choice: a name and how a request's policy is built from its GammaStart."""

    name: GammaPolicyName
    build: Callable[[GammaStart], GammaPolicy]


GAMMA_POLICY_KINDS = {kind.name: kind for kind in (
    PolicyKind(GammaPolicyName.FIXED, lambda start: FixedGamma(start.gamma)),
    PolicyKind(GammaPolicyName.ADAPTIVE, lambda s: adaptive_from_record(s.record, s.gamma_max, s.alpha, s.cost_ratio)),
    PolicyKind(GammaPolicyName.HEURISTIC, lambda start: HeuristicGamma(start.gamma, start.gamma_max)),
)}
