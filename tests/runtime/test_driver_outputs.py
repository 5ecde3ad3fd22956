"""The drivers hand each call its own logits: the gqa driver binds a new array as the output of every run, so a
caller that keeps one call's logits (the draft's q, the target's p) never sees a later call write into them."""
from __future__ import annotations

import numpy as np


def test_a_later_call_leaves_an_earlier_calls_logits_alone(int4_gen):
    target = int4_gen.target
    target.reset(2)
    ids = np.arange(5, 13, dtype=np.int64)[None]  # [1, 8]
    first = target.forward(ids, np.zeros(1, np.int64), slots=np.array([0]))
    kept = first.copy()
    second = target.forward(ids[:, ::-1].copy(), np.zeros(1, np.int64), slots=np.array([1]))
    assert first.shape == (1, 8, target.vocab_size) and second.shape == first.shape
    assert not np.shares_memory(first, second)
    np.testing.assert_array_equal(first, kept)
    assert not np.array_equal(first, second)  # different inputs: the calls really produced different logits


def test_rows_run_together_give_what_each_row_gives_alone(int4_gen):
    target = int4_gen.target
    target.reset(2)
    prompt = np.arange(5, 13, dtype=np.int64)[None]
    for slot in (0, 1):
        target.forward(prompt, np.zeros(1, np.int64), slots=np.array([slot]))
    step = np.array([[7], [9]], np.int64)
    together = target.forward(step, np.array([8, 8]), slots=np.array([0, 1]))  # T = 1, both rows: one run
    for slot in (0, 1):
        target.reset(2)  # the KV of both slots is rebuilt, then one row alone
        target.forward(prompt, np.zeros(1, np.int64), slots=np.array([slot]))
        alone = target.forward(step[slot : slot + 1], np.array([8]), slots=np.array([slot]))
        np.testing.assert_allclose(together[slot], alone[0], atol=1e-5)
    last = target.forward(step[:1], np.array([9]), slots=np.array([0]), last_only=True)
    assert last.shape == (1, 1, target.vocab_size)
