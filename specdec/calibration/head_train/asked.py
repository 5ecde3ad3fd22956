"""Requests the target writes itself (the Magpie recipe: Xu et al., 2024): fed its chat template up to where a user's
message begins, an instruction-tuned model samples a request such as its users send, from the distribution its
own tuning taught it. The head then trains on the target's answers to prompts of the kind it will draft for, not
only to templated ones. The request is the target's sampled text (temperature 1, top-k 50) up to its end of turn or
ASK_TOKENS tokens, seeded by the run's seed and the prompt's index; the data engine writes it in a row of its own,
batched with the rows that answer (head_train.generate: Answering.ask), then answers it in the same slot."""
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
