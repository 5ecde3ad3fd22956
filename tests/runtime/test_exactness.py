"""Greedy speculative output equals target-only greedy output, token for token, for every drafter and γ."""
from __future__ import annotations

import pytest

import specdec
from specdec import GenerationConfig
from tests.conftest import GAMMA_MAX

PROMPTS = [
    "The quick brown fox", "def add(a, b):", "Once upon a time", "Summarize the following text",
    "Speculative decoding drafts", "a small model", "return a + b", "there was a tiny model",
    "The lazy dog", "jumps over", "verifies them with a large one.", "wanted to speak.",
    "in one sentence", "The quick", "def", "Once", "brown fox jumps over the lazy dog. The quick brown fox",
    "tokens with a small model and verifies", "a + b\n", "Summarize the following text in one sentence. Summarize",
    "model that wanted", "large one. Speculative",
]
GAMMAS = [1, 2, 4, GAMMA_MAX]
NEW_TOKENS = 24


def _plain(gen, prompt):
    return gen.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="none")).token_ids


@pytest.mark.parametrize("drafter", ["model", "prompt_lookup", "auto"])
def test_greedy_equality_int4_draft(int4_gen, drafter):
    for prompt in PROMPTS:
        expected = _plain(int4_gen, prompt)
        for gamma in GAMMAS:
            config = GenerationConfig(max_new_tokens=NEW_TOKENS, drafter=drafter, gamma=gamma)
            assert int4_gen.generate(prompt, config).token_ids == expected, (prompt, gamma)


@pytest.mark.parametrize("drafter", ["model", "auto"])
def test_greedy_equality_with_a_draft_built_to_be_rejected(random_gen, drafter):
    rejected = 0
    for prompt in PROMPTS:
        expected = _plain(random_gen, prompt)
        for gamma in GAMMAS:
            result = random_gen.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, drafter=drafter, gamma=gamma))
            assert result.token_ids == expected, (prompt, gamma)
            rejected += result.stats.proposed - result.stats.accepted
    # the random draft really was rejected, so rollback was exercised (auto soon stops asking a draft that loses)
    assert rejected > (100 if drafter == "model" else 10)


@pytest.mark.parametrize("policy", ["adaptive", "heuristic"])
def test_greedy_equality_under_gamma_policies(random_gen, int4_gen, policy):
    for gen in (random_gen, int4_gen):
        for prompt in PROMPTS[:10]:
            config = GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="model", gamma=2, gamma_policy=policy)
            assert gen.generate(prompt, config).token_ids == _plain(gen, prompt), (prompt, policy)


def test_batch_of_three_equals_three_single_runs(random_gen, int4_gen):
    prompts = [PROMPTS[0], PROMPTS[16], PROMPTS[5]]  # ragged prompt lengths
    for gen in (random_gen, int4_gen):
        for drafter in ("model", "auto", "none"):
            config = GenerationConfig(max_new_tokens=NEW_TOKENS, drafter=drafter, gamma=3)
            batch = gen.generate(prompts, config)
            assert [r.token_ids for r in batch] == [_plain(gen, p) for p in prompts]


def test_sampled_batch_rows_have_their_own_streams_from_seed_and_row(random_gen):
    config = GenerationConfig(max_new_tokens=12, temperature=1.0, seed=7, drafter="none")
    batch = random_gen.generate([PROMPTS[2], PROMPTS[2], PROMPTS[3]], config)
    single = random_gen.generate(PROMPTS[2], config)
    assert batch[0].token_ids == single.token_ids  # row 0 of a request is the stream (seed, 0)
    assert batch[1].token_ids != batch[0].token_ids  # the same prompt in row 1: the stream (seed, 1)
    # (seed 7, row 1) is not (seed 8, row 0): rows of different seeds never share a stream
    shifted = random_gen.generate(PROMPTS[2], GenerationConfig(max_new_tokens=12, temperature=1.0, seed=8, drafter="none"))
    assert shifted.token_ids != batch[1].token_ids
    again = random_gen.generate([PROMPTS[2], PROMPTS[2], PROMPTS[3]], config)
    assert [r.token_ids for r in again] == [r.token_ids for r in batch]


def test_lowerings_agree_token_for_token(int4_bundle, gqa_int4_bundle):
    with specdec.load(int4_bundle) as plain, specdec.load(gqa_int4_bundle) as gqa:
        for prompt in PROMPTS:
            assert _plain(plain, prompt) == _plain(gqa, prompt)


def test_target_only_greedy_equals_transformers_generate(int4_gen, tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    for prompt in PROMPTS[:8]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        ours = int4_gen.generate(ids[0].tolist(), GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="none"))
        assert ours.token_ids == out[0, ids.shape[1]:].tolist()
