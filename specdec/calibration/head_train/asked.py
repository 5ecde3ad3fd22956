"""Requests the target writes itself (the Magpie recipe: Xu et al., 2024): fed its chat template up to where a user's
message begins, an instruction-tuned model samples a request such as its users send, from the distribution its
own tuning taught it. The head then trains on the target's answers to prompts of the kind it will draft for, not
only to templated ones. The request is the target's sampled text (temperature 1, top-k 50) up to its end of turn or
ASK_TOKENS tokens, seeded by the run's seed and the prompt's index."""
from __future__ import annotations

ASK_TOKENS = 96  # the longest request written
ASK_TOP_K = 50


def user_turn_prefix(requests) -> list:
    """The token ids of the chat template up to a user message's first token: what two one-message conversations
    that differ in their message alone share."""
    first, second = requests.prompt_ids("A", chat=True), requests.prompt_ids("Z", chat=True)
    shared = 0
    while shared < min(len(first), len(second)) and first[shared] == second[shared]:
        shared += 1
    return first[:shared]


def asked_request(generator, prefix: list, seed: int, index: int, max_tokens: int = ASK_TOKENS) -> str | None:
    """The request the target writes after `prefix` (user_turn_prefix) for prompt `index` of a run of `seed`, at
    most max_tokens long, or None where it writes nothing but white space."""
    from specdec.runtime import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_tokens, temperature=1.0, top_k=ASK_TOP_K, top_p=1.0,
                              seed=seed * 1_000_003 + index, drafter="none")
    text = generator.generate(list(prefix), config).text.strip()
    return text or None
