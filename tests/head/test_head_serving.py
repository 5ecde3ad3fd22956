"""A served request drafting with the head: greedy completions equal offline generation, alone and batched with
rows of other drafters (the verify passes that feed head rows return the target's hidden states, the others' none)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import specdec
from specdec import GenerationConfig
from tests.serving.conftest import KEY, client, metric, start

PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time", "there was a tiny model"]
NEW_TOKENS = 24


def test_served_head_requests_equal_offline(mirror_head_bundle):
    with specdec.load(mirror_head_bundle) as offline:
        want = {(p, d): offline.generate(p, GenerationConfig(max_new_tokens=NEW_TOKENS, drafter=d, gamma=3)).text
                for p in PROMPTS for d in ("head", "none")}
    with start(mirror_head_bundle, api_key=KEY, speculation="fixed", gamma=3) as server:
        api = client(server)

        def complete(case):
            prompt, drafter = case
            result = api.completions.create(model=mirror_head_bundle.name, prompt=prompt, max_tokens=NEW_TOKENS,
                                            temperature=0, extra_body={"specdec": {"drafter": drafter}})
            return result.choices[0].text

        alone = {case: complete(case) for case in want}
        with ThreadPoolExecutor(4) as pool:  # batched: head rows beside target-only rows
            batched = dict(zip(want, pool.map(complete, list(want))))
        exposition = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert alone == want and batched == want
    assert metric(exposition, "specdec_draft_tokens_accepted_total") > 20  # the head drafted, and was accepted


@pytest.mark.parametrize("rounds", [6, 0])
def test_a_reused_prefix_keeps_the_head_k_v_bit_for_bit(random_head_bundle, rounds):
    """A head row admitted to the slot of an earlier head row skips the prefill of their shared prefix and keeps what
    the earlier head held there: its K/V where it drafted (rounds 6), the target's hidden states it had not fed yet
    where it never drafted (rounds 0). Its head then scores what a head fed from scratch on another slot scores, the
    same bits."""
    import numpy as np

    from specdec.runtime.adaptive_gamma import FixedGamma
    from specdec.runtime.config import DrafterName
    from specdec.serving.batching import ServingLoop

    with specdec.load(random_head_bundle, backend="native") as gen:
        gen.target.reset(2)
        drafters = gen.requests.drafters(None, gen.target)
        loop = ServingLoop(gen.target, drafters, FixedGamma(2), 16, gen.manifest.tokenizer.eos_token_ids)
        head = next(d for d in drafters.values() if getattr(d, "name", None) == DrafterName.HEAD)
        config = GenerationConfig(max_new_tokens=40, drafter="head", temperature=1.0, seed=5)
        prompt = [int(t) for t in np.random.default_rng(4).integers(3, 200, 19)]
        first = gen.requests.row(prompt, config, slot=0)
        loop.prefill([first])
        for _ in range(rounds):
            loop.step([first])  # the head drafts, so it feeds the verified positions
        if rounds:
            head.propose([first], [2])  # it feeds them all (its last position read the pending token), then drafts
        assert first.head.length == (first.target_len if rounds else 0)
        carried = first.tokens[: first.target_len] + [9, 8, 7]  # a later turn on the earlier one
        reused, fresh = gen.requests.row(carried, config, slot=0), gen.requests.row(carried, config, slot=1)
        loop.prefill([reused])
        loop.prefill([fresh])
        # nothing of the shared prefix is fed again, but for its last position where the head fed it (reading the
        # token after it, which the later turn replaced)
        assert fresh.reused == 0 and reused.reused == first.target_len - (1 if rounds else 0)
        drafted = head.propose([reused, fresh], [3, 3])
        assert np.array_equal(drafted[0].tokens, drafted[1].tokens)
        assert np.array_equal(drafted[0].q, drafted[1].q)  # the head's distributions, bit for bit
        assert reused.head.length == fresh.head.length == reused.target_len == len(carried)  # (the first token: pending)


def test_served_head_requests_reuse_their_prefix_and_speculation_off_reads_no_hidden_states(mirror_head_bundle):
    """Greedy requests extending one another: with drafter auto (which weighs the head) their texts equal offline
    target-only decoding, whether the server speculates or not, and each later one skips the prefill of what its
    slot holds (before, a head row fed every prompt whole)."""
    base = "The quick brown fox"
    with specdec.load(mirror_head_bundle) as offline:
        answer = offline.generate(base, GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="none")).text
        prompts = [base, base + answer + " and then", base + answer + " and then it ran"]
        want = [offline.generate(p, GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="none")).text for p in prompts]
    for speculation in ("off", "fixed"):
        with start(mirror_head_bundle, api_key=KEY, speculation=speculation, gamma=2, max_batch=1) as server:
            api = client(server)
            texts = [api.completions.create(model=mirror_head_bundle.name, prompt=p, max_tokens=NEW_TOKENS,
                                            temperature=0).choices[0].text for p in prompts]
            exposition = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        assert texts == want, speculation
        assert metric(exposition, "specdec_prompt_tokens_reused_total") > 0, speculation
