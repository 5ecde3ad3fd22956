"""A served request drafting with the head: greedy completions equal offline generation, alone and batched with
rows of other drafters (the verify passes that feed head rows return the target's hidden states, the others' none)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

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
