"""Speculative sampling reproduces the target's sampling distribution (and a broken rule does not).

Statistical test: Pearson's chi-square over the joint distribution of the first two sampled tokens
(top_k = 3, so 9 outcomes), N = 1500 generations with fixed seeds; pass at p > 0.001. The exact target
distribution is computed from the target's own logits. The draft is the INT4 copy of the target: q overlaps p but differs from it.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import specdec
import specdec.runtime.loop as loop_module
from specdec import GenerationConfig
from specdec.runtime.sampling import sample, warp

SAMPLES = 1500
CONFIG = dict(temperature=1.0, top_k=3, max_new_tokens=2, gamma=2)
PROMPT = "The quick brown fox"


def chi_square_p_value(stat: float, dof: int) -> float:
    """Upper tail of the chi-square distribution (Wilson-Hilferty normal approximation)."""
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def exact_pair_distribution(gen, prompt_ids, config):
    target = gen.target
    target.reset(1)

    def probs(ids):
        logits = target.forward(np.array([ids], dtype=np.int64), np.zeros(1, dtype=np.int64))
        return warp(logits[0, -1], config)

    first = probs(prompt_ids)
    return {(a, b): first[a] * pb
            for a in np.flatnonzero(first) for b, pb in enumerate(probs(prompt_ids + [int(a)])) if pb > 0}


def sampled_pairs(gen, prompt_ids, drafter):
    counts = {}
    for seed in range(SAMPLES):
        out = gen.generate(prompt_ids, GenerationConfig(seed=seed, drafter=drafter, **CONFIG)).token_ids
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    return counts


def p_value(expected: dict, counts: dict) -> float:
    assert set(counts) <= set(expected)
    stat = sum((counts.get(k, 0) - SAMPLES * p) ** 2 / (SAMPLES * p) for k, p in expected.items())
    return chi_square_p_value(stat, len(expected) - 1)


def broken_rule(drafts, q, p, uniforms, rng):
    """Accept whenever p(d) >= q(d): a common mistake that biases the output."""
    for i, token in enumerate(drafts):
        if p[i, token] >= (1.0 if q is None else q[i, token]):
            continue
        return i, sample(np.maximum(p[i] - (0 if q is None else q[i]), 0), rng)
    return len(drafts), sample(p[len(drafts)], rng)


@pytest.fixture(scope="module")
def setup(int4_bundle):
    with specdec.load(int4_bundle) as gen:
        prompt_ids = gen.codec.encode(PROMPT)
        yield gen, prompt_ids, exact_pair_distribution(gen, prompt_ids, GenerationConfig(**CONFIG))


@pytest.mark.parametrize("drafter", ["model", "none"])
def test_speculative_sampling_matches_the_target_distribution(setup, drafter):
    gen, prompt_ids, expected = setup
    assert p_value(expected, sampled_pairs(gen, prompt_ids, drafter)) > 1e-3


def test_a_broken_acceptance_rule_is_detected(setup, monkeypatch):
    gen, prompt_ids, expected = setup
    monkeypatch.setattr(loop_module, "accept_sampled", broken_rule)
    assert p_value(expected, sampled_pairs(gen, prompt_ids, "model")) < 1e-6
