"""coupling="gumbel": each generated position's sample is argmax(log p + G) with noise G fixed by (seed, row,
position). Verification then works like greedy, so sampled output is identical across drafters and γ, and it is
still an exact sample of the warped target (chi-square over three tokens, as in test_distribution)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from specdec import GenerationConfig
from specdec.errors import ConfigError
from specdec.runtime.sampling import gumbel_choice
from tests.runtime.test_distribution import NEW_TOKENS, PROMPT, SAMPLES, exact_joint, p_value, window

PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time", "a + b\n"]


@pytest.fixture(scope="module")
def gen(int4_gen):
    return int4_gen


def _config(**options):
    return GenerationConfig(max_new_tokens=20, temperature=0.9, top_k=40, coupling="gumbel", **options)


def test_the_same_seed_gives_the_same_text_for_every_drafter_and_gamma(gen, random_gen):
    for generator in (gen, random_gen):  # an INT4 draft that is mostly right, a random one that is mostly wrong
        for prompt in PROMPTS:
            for seed in (0, 1):
                plain = generator.generate(prompt, _config(seed=seed, drafter="none")).token_ids
                for drafter in ("model", "prompt_lookup", "auto"):
                    for gamma in (1, 3, 6):
                        result = generator.generate(prompt, _config(seed=seed, drafter=drafter, gamma=gamma))
                        assert result.token_ids == plain, (prompt, seed, drafter, gamma)


def test_seeds_differ_and_batches_keep_each_rows_noise(gen):
    texts = {tuple(gen.generate(PROMPTS[0], _config(seed=s, drafter="model")).token_ids) for s in range(6)}
    assert len(texts) > 1
    batch = gen.generate(PROMPTS[:3], _config(seed=4, drafter="model", gamma=4))
    rows = [gen.generate(PROMPTS[:3], _config(seed=4, drafter="none"))[b].token_ids for b in range(3)]
    assert [r.token_ids for r in batch] == rows


def test_gumbel_choice_is_a_sample_of_p():
    probs = np.array([0.5, 0.3, 0.2, 0.0])
    rng = np.random.default_rng(0)
    counts = np.bincount([gumbel_choice(probs, rng.gumbel(size=4)) for _ in range(20000)], minlength=4)
    assert counts[3] == 0 and np.allclose(counts / counts.sum(), probs, atol=0.015)


def test_gumbel_coupling_matches_the_target_distribution(gen):
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3, drafter="model", temperature=1.0, top_k=3,
                              coupling="gumbel")
    prompt_ids = gen.codec.encode(PROMPT)
    counts, accepted = {}, 0
    for seed in range(SAMPLES):
        result = gen.generate(prompt_ids, dataclasses.replace(config, seed=seed))
        key = window(result.token_ids)
        counts[key] = counts.get(key, 0) + 1
        accepted += result.stats.accepted
    assert accepted > SAMPLES  # drafts were accepted, so positions past the first came from verification
    assert p_value(exact_joint(gen, prompt_ids, config), counts) > 1e-3


def test_an_unknown_coupling_is_refused():
    with pytest.raises(ConfigError, match="coupling 'maximal' is unknown"):
        GenerationConfig(coupling="maximal")
