"""Speculative sampling with drafter="head" reproduces the target's distribution, the head's trimmed vocabulary
included (q = 0 outside it), and a rule that forgets those zeros is caught.

The χ² machinery of tests/runtime/test_distribution.py: the joint of the three sampled tokens after the first, γ = 3
so that every round verifies drafts at positions 0, 1 and 2, against the target's enumerated distribution under a
top-k warp. Heads: random weights over two thirds of the vocabulary (drafts mostly rejected: the residual carries
the output), and the mirror head over three quarters of it on a model that repeats itself (drafts mostly accepted).
"""
from __future__ import annotations

import numpy as np
import pytest

import specdec
import specdec.runtime.loop as loop_module
from specdec import GenerationConfig
from specdec.runtime.sampling import sample, warp
from tests.runtime.test_distribution import NEW_TOKENS, PROMPT, TOP_K, _repetitive, exact_joint, p_value, sampled


@pytest.fixture(scope="module")
def random_gen(random_head_bundle):
    with specdec.load(random_head_bundle) as gen:
        yield gen


@pytest.fixture(scope="module")
def mirror_gen(mirror_head_bundle):
    with specdec.load(mirror_head_bundle) as gen:
        yield gen


def _config() -> GenerationConfig:
    return GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3, drafter="head", **TOP_K)


def _outside_mass(gen, prompt_ids, config) -> float:
    """The target's warped probability of the tokens the head cannot propose, at the prompt's next token."""
    gen.target.reset(1)
    logits = gen.target.forward(np.array([prompt_ids]), np.zeros(1, np.int64), True)[0, -1]
    probs = warp(logits, config)
    outside = np.ones(len(probs), bool)
    outside[gen.head.draft_ids] = False
    return float(probs[outside].sum())


@pytest.mark.parametrize("which", ["random", "mirror"])
def test_sampling_with_the_head_matches_the_target_distribution(random_gen, mirror_gen, which):
    gen = random_gen if which == "random" else mirror_gen
    prompt_ids = gen.codec.encode(PROMPT) if which == "random" else _repetitive(gen)
    config = _config()
    counts, (proposed, accepted) = sampled(gen, prompt_ids, config)
    assert proposed[2] > 100, proposed  # draft positions 0, 1 and 2 were verified
    if which == "mirror":
        assert accepted[1] > 50 and accepted[2] > 20, (proposed, accepted)
    assert p_value(exact_joint(gen, prompt_ids, config), counts) > 1e-3


def test_the_trimmed_vocabulary_matters_here(random_gen):
    """The target puts real mass on tokens the random head cannot propose: the tests above and below see q's zeros."""
    assert _outside_mass(random_gen, random_gen.codec.encode(PROMPT), _config()) > 0.05


def test_a_rule_that_forgets_the_zeros_outside_the_draft_vocabulary_is_caught(random_gen, monkeypatch):
    """At a rejection, a residual restricted to the head's vocabulary (as if tokens outside it were impossible, not
    q = 0) never emits those tokens but as a bonus: the χ² test sees it."""
    draft_vocabulary = np.zeros(random_gen.head.record.vocab_size, bool)
    draft_vocabulary[random_gen.head.draft_ids] = True

    def forgetful(drafts, q, p, uniforms, rng):
        for i, token in enumerate(drafts):
            q_token = 1.0 if q is None else q[i, token]
            if uniforms[i] * q_token < p[i, token]:
                continue
            residual = np.where(draft_vocabulary, np.maximum(p[i] - (0 if q is None else q[i]), 0.0), 0.0)
            return i, sample(residual if residual.sum() > 0 else p[i], rng)
        return len(drafts), sample(p[len(drafts)], rng)

    config = _config()
    prompt_ids = random_gen.codec.encode(PROMPT)
    expected = exact_joint(random_gen, prompt_ids, config)
    monkeypatch.setattr(loop_module, "accept_sampled", forgetful)
    assert p_value(expected, sampled(random_gen, prompt_ids, config)[0]) < 1e-6
