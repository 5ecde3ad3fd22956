"""Speculative sampling reproduces the target's sampling distribution (and a broken rule does not).

Statistical test: Pearson's chi-square over the joint distribution of the first THREE sampled tokens, with γ = 3
so that every round verifies drafts at positions 0, 1 and 2; N = 1500 generations with fixed seeds; pass at
p > 0.001. The exact target distribution is enumerated from the target's own logits; cells whose expected count
is below 5 are pooled. Drafters: the INT4 copy of the target (q overlaps p but differs), prompt lookup on a
repetitive prompt of a model that repeats itself (point masses that are often right, at every position), and
`auto`; both lowerings; top-k and top-p warps.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import specdec
import specdec.runtime.loop as loop_module
from specdec import GenerationConfig
from specdec.runtime.sampling import accept_sampled, sample, warp

SAMPLES = 1500
TOKENS = 3  # the window tested: the tokens a round of γ = 3 drafts after the prefill's first token
NEW_TOKENS = TOKENS + 2  # the first token, the window, and that round's own token
TOP_K = dict(temperature=1.0, top_k=3)
TOP_P = dict(temperature=0.7, top_p=0.5)
PROMPT = "The quick brown fox"


def chi_square_p_value(stat: float, dof: int) -> float:
    """Upper tail of the chi-square distribution (Wilson-Hilferty normal approximation)."""
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def window(token_ids: list) -> tuple:
    """The tokens after the first (which the prefill gives, undrafted): the ones drafts can propose."""
    return tuple(token_ids[1 : 1 + TOKENS])


def exact_joint(gen, prompt_ids: list, config: GenerationConfig, depth: int = TOKENS) -> dict:
    """{window: probability}: the joint of generated tokens 2..depth+1 under the warped target (the first one
    summed out), by enumeration of its support."""
    target = gen.target
    target.reset(1)

    def probs(ids):
        logits = target.forward(np.array([ids], dtype=np.int64), np.zeros(1, dtype=np.int64), True)
        return warp(logits[0, -1], config)

    joint = {(): 1.0}
    for _ in range(depth + 1):
        joint = {prefix + (int(t),): mass * p for prefix, mass in joint.items()
                 for t, p in enumerate(probs(prompt_ids + list(prefix))) if p > 0}
    marginal = {}
    for tokens, mass in joint.items():
        marginal[tokens[1:]] = marginal.get(tokens[1:], 0.0) + mass
    return marginal


def sampled(gen, prompt_ids, config: GenerationConfig) -> tuple[dict, tuple]:
    """(counts of the window, (drafts proposed, drafts accepted) per position over all runs)."""
    counts, proposed, accepted = {}, [0] * 3, [0] * 3
    for seed in range(SAMPLES):
        result = gen.generate(prompt_ids, dataclasses.replace(config, seed=seed))
        key = window(result.token_ids)
        counts[key] = counts.get(key, 0) + 1
        for i in range(min(3, len(result.stats.position_proposed))):
            proposed[i] += result.stats.position_proposed[i]
            accepted[i] += result.stats.position_accepted[i]
    return counts, (proposed, accepted)


def p_value(expected: dict, counts: dict) -> float:
    assert set(counts) <= set(expected), "a sequence the target cannot produce was sampled"
    big = {k: p for k, p in expected.items() if SAMPLES * p >= 5}
    pooled_p = 1.0 - sum(big.values())
    pooled_n = sum(n for k, n in counts.items() if k not in big)
    stat = sum((counts.get(k, 0) - SAMPLES * p) ** 2 / (SAMPLES * p) for k, p in big.items())
    cells = len(big)
    if SAMPLES * pooled_p >= 1:
        stat += (pooled_n - SAMPLES * pooled_p) ** 2 / (SAMPLES * pooled_p)
        cells += 1
    return chi_square_p_value(stat, cells - 1)


def broken_rule(drafts, q, p, uniforms, rng):
    """Accept whenever p(d) >= q(d): a common mistake that biases the output."""
    for i, token in enumerate(drafts):
        if p[i, token] >= (1.0 if q is None else q[i, token]):
            continue
        return i, sample(np.maximum(p[i] - (0 if q is None else q[i]), 0), rng)
    return len(drafts), sample(p[len(drafts)], rng)


def broken_after_first(drafts, q, p, uniforms, rng):
    """The exact rule at position 0, the broken one from position 1 on: only a test that reaches later draft
    positions can see it."""
    if len(drafts) == 0:
        return accept_sampled(drafts, q, p, uniforms, rng)
    first, token = accept_sampled(drafts[:1], None if q is None else q[:1], p[:2], uniforms[:1], rng)
    if first == 0:
        return first, token
    rest, token = broken_rule(drafts[1:], None if q is None else q[1:], p[1:], uniforms[1:], rng)
    return 1 + rest, token


@pytest.fixture(scope="module", params=["plain", "gqa"])
def lowering(request):
    return request.param


@pytest.fixture(scope="module")
def gen(lowering, int4_bundle, gqa_int4_bundle):
    with specdec.load(int4_bundle if lowering == "plain" else gqa_int4_bundle) as generator:
        yield generator


@pytest.fixture(scope="module")
def copy_gen(lowering, copy_bundles):
    with specdec.load(copy_bundles[lowering]) as generator:
        yield generator


def _repetitive(gen) -> list:
    """The prompt followed by the model's own greedy continuation: a run that prompt lookup can extend."""
    ids = gen.codec.encode(PROMPT)
    return ids + gen.generate(ids, GenerationConfig(max_new_tokens=12, drafter="none")).token_ids


CASES = [  # (drafter, model, warp)
    ("model", "int4", TOP_K), ("model", "int4", TOP_P), ("prompt_lookup", "copy", TOP_K), ("auto", "copy", TOP_K),
    ("model", "copy", TOP_K), ("none", "int4", TOP_K),
]


@pytest.mark.parametrize("drafter, model, warp_options", CASES)
def test_speculative_sampling_matches_the_target_distribution(gen, copy_gen, drafter, model, warp_options):
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3, drafter=drafter, **warp_options)
    generator = gen if model == "int4" else copy_gen
    prompt_ids = generator.codec.encode(PROMPT) if model == "int4" else _repetitive(generator)
    counts, (proposed, accepted) = sampled(generator, prompt_ids, config)
    if drafter != "none":  # later draft positions really were verified, and accepted
        assert proposed[2] > 100 and accepted[1] > 50, (proposed, accepted)
    assert p_value(exact_joint(generator, prompt_ids, config), counts) > 1e-3


@pytest.mark.parametrize("rule", [broken_rule, broken_after_first])
def test_a_broken_acceptance_rule_is_detected(gen, monkeypatch, rule):
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3, drafter="model", **TOP_K)
    prompt_ids = gen.codec.encode(PROMPT)
    expected = exact_joint(gen, prompt_ids, config)
    monkeypatch.setattr(loop_module, "accept_sampled", rule)
    assert p_value(expected, sampled(gen, prompt_ids, config)[0]) < 1e-6
