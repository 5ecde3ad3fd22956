"""The acceptance rule on the paper's worked example, greedy acceptance, and logits warping."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from specdec.runtime.config import GenerationConfig
from specdec.runtime.sampling import accept_greedy, accept_sampled, sample, softmax, warp

A, B, C = 0, 1, 2


def test_paper_worked_example():
    q = np.array([[0.2, 0.7, 0.1], [0.6, 0.1, 0.3], [0.1, 0.1, 0.8]])
    p = np.array([[0.5, 0.3, 0.2], [0.7, 0.2, 0.1], [0.1, 0.5, 0.4], [0.3, 0.4, 0.3]])
    drafts = np.array([B, A, C])
    for any_r in (0.0, 0.5, 0.999):
        accepted, token = accept_sampled(drafts, q, p, np.array([0.35, any_r, 0.72]), np.random.default_rng(0))
        # accept B (0.35 < 0.3/0.7), accept A (ratio >= 1), reject C (0.72 > 0.4/0.8), residual {0, 1, 0} -> B
        assert (accepted, token) == (2, B)
    # r just above p/q for B rejects at once; residual max(0, p - q) = {0.3, 0, 0.1} never yields B
    tokens = {accept_sampled(drafts, q, p, np.array([0.43, 0, 0]), np.random.default_rng(s))[1] for s in range(50)}
    assert tokens == {A, C}


def test_all_accepted_samples_the_bonus_from_the_last_distribution():
    p = np.array([[0, 1.0, 0], [0, 0, 1.0]])
    q = np.array([[0, 1.0, 0]])
    assert accept_sampled(np.array([B]), q, p, np.array([0.99]), np.random.default_rng(0)) == (1, C)


def test_point_mass_proposals_zero_the_rejected_token():
    p = np.array([[0.5, 0.5, 0.0], [1.0, 0, 0]])
    # q is a point mass on A: accepted with probability p(A) = 0.5, else the residual is p without A -> B
    assert accept_sampled(np.array([A]), None, p, np.array([0.7]), np.random.default_rng(0)) == (0, B)
    assert accept_sampled(np.array([A]), None, p, np.array([0.3]), np.random.default_rng(0)) == (1, A)


def test_greedy_acceptance():
    assert accept_greedy(np.array([4, 5, 6]), np.array([4, 5, 7, 9])) == (2, 7)
    assert accept_greedy(np.array([4, 5]), np.array([4, 5, 8])) == (2, 8)
    assert accept_greedy(np.array([1]), np.array([4, 5])) == (0, 4)
    assert accept_greedy(np.zeros(0, dtype=np.int64), np.array([3])) == (0, 3)


def test_warp_temperature_top_k_top_p():
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1]))
    np.testing.assert_allclose(warp(logits, GenerationConfig(temperature=1.0)), [0.5, 0.25, 0.15, 0.1])
    np.testing.assert_allclose(warp(logits, GenerationConfig(temperature=1.0, top_k=2)), [2 / 3, 1 / 3, 0, 0])
    # top_p keeps the smallest prefix reaching 0.7: {0.5, 0.25}
    np.testing.assert_allclose(warp(logits, GenerationConfig(temperature=1.0, top_p=0.7)), [2 / 3, 1 / 3, 0, 0])
    np.testing.assert_allclose(warp(logits, GenerationConfig(temperature=1.0, top_p=0.5)), [1, 0, 0, 0])
    hot = warp(logits, GenerationConfig(temperature=2.0))
    np.testing.assert_allclose(hot, softmax(logits / 2))
    batch = warp(np.stack([logits, logits[::-1]]), GenerationConfig(temperature=1.0, top_k=1))
    np.testing.assert_allclose(batch, [[1, 0, 0, 0], [0, 0, 0, 1]])


def test_sample_follows_the_distribution():
    rng = np.random.default_rng(0)
    probs = np.array([0.1, 0.0, 0.6, 0.3])
    counts = np.bincount([sample(probs, rng) for _ in range(20000)], minlength=4) / 20000
    np.testing.assert_allclose(counts, probs, atol=0.015)
    assert counts[1] == 0


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                 dict(gamma=0), dict(max_new_tokens=0), dict(drafter="magic"), dict(stop=("",))])
def test_config_rejects_bad_values(bad):
    from specdec.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        GenerationConfig(**bad)
    assert info.value.hint


def test_prompt_lookup_prefers_the_longest_latest_match():
    from specdec.runtime.drafters import lookup

    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 5, 6, 7]
    # the 3-gram [5, 6, 7] occurred at 0 and is followed by 8, 1, ...
    assert lookup(tokens, 3, max_ngram=3).tolist() == [8, 1, 6]
    # with 2-grams only, the latest earlier [6, 7] (at 5) is followed by 9, 2
    assert lookup(tokens, 2, max_ngram=2).tolist() == [9, 2]
    assert lookup([1, 2, 3, 4], 3, max_ngram=3).size == 0
    assert lookup([1, 2, 3, 1], 3, max_ngram=3, min_ngram=2).size == 0
    assert lookup([1, 2, 3, 1], 3, max_ngram=3, min_ngram=1).tolist() == [2, 3, 1]


def test_gate_turns_the_model_off_when_it_does_not_pay():
    from specdec.runtime.adaptive_gamma import expected_speedup
    from specdec.runtime.drafters import ModelGate

    assert expected_speedup(0.0, 4, 0.0) == 1.0
    assert expected_speedup(1.0, 4, 0.25) == 5 / 2
    # alpha = 0.8, c = 0.1: (1 - 0.8^7) / (0.2 * 1.6) = 2.4697 at gamma 6, the best gamma
    values = {g: expected_speedup(0.8, g, 0.1) for g in range(1, 12)}
    assert abs(values[6] - (1 - 0.8**7) / (0.2 * 1.6)) < 1e-12
    assert max(values, key=values.get) == 6
    slow = ModelGate(warmup_rounds=2)
    for _ in range(4):
        slow.observe(proposed=4, accepted=1, verify_s=0.04)  # α low
        slow.observe_draft_step(0.03)  # c = 0.75
        slow.observe_plain(0.04)  # r = 1
    assert not slow.pays(4)
    fast = ModelGate(warmup_rounds=2)
    for _ in range(4):
        fast.observe(proposed=4, accepted=4, verify_s=0.04)  # α high
        fast.observe_draft_step(0.004)  # c = 0.1
    assert not fast.pays(4)  # no one-token pass timed yet: it declines the model for a round to time one
    for seconds in (0.05, 0.035, 0.036, 0.2):  # one pass the machine slowed
        fast.observe_plain(seconds)  # r = 0.04 / 0.043, the medians of each
    assert abs(fast.verify_ratio - 0.04 / 0.043) < 1e-12
    assert fast.pays(4)
    probes = [slow.pays(4) for _ in range(32)]  # still tried every 16th refusal (the assert above was the 1st)
    assert probes.count(True) == 2 and probes[14] and probes[30]


def test_gate_compares_typical_passes_not_the_fastest():
    """Verify passes spread from 8 to 12 ms over a request (longer contexts, a busy machine), one-token passes near
    4.8 (fewer of them), every draft accepted, c = 0.4: a round emits 5 tokens for 2.6 verify passes. The fastest of
    each would say r = 8 / 4.7 = 1.70 and let a model that does not pay draft (5 / 2.6 / 1.70 = 1.13); the medians say
    r = 10 / 4.8 = 2.08 (5 / 2.6 / 2.08 = 0.92), and the gate declines."""
    from specdec.runtime.drafters import ModelGate

    gate = ModelGate(warmup_rounds=2, prior_weight=1e-9)
    for verify_s in np.linspace(0.008, 0.012, 41):
        gate.observe(proposed=4, accepted=4, verify_s=float(verify_s))
        gate.observe_draft_step(0.4 * float(verify_s))
    for seconds in (0.0048, 0.0047, 0.0049, 0.0048):
        gate.observe_plain(seconds)
    assert abs(gate.verify_ratio - 0.010 / 0.0048) < 1e-9 and abs(gate.cost_ratio - 0.4) < 1e-9
    per_verify = (1 + gate.cumulative(4).sum()) / (1 + 4 * gate.cost_ratio)
    assert per_verify / (0.008 / 0.0047) > 1.1 and per_verify / gate.verify_ratio < 0.95
    assert [gate.pays(4) for _ in range(15)] == [False] * 15  # (every 16th refusal is a probe)


def test_gate_counts_acceptance_by_position():
    """Acceptances in runs: 7 rounds of 4 drafts all accepted, 3 with none (α = 0.7). A round emits 1 + 0.7·4 = 3.8
    tokens, where the constant-α formula says 2.77: with c = 0.25 and r = 1.7 the model pays (3.8 / 2 / 1.7 = 1.12),
    although the formula would turn it off (0.81). The per-row runs come from the loop's round records."""
    from specdec.runtime.adaptive_gamma import expected_speedup
    from specdec.runtime.drafters import ModelGate
    from specdec.runtime.loop import SpeculativeLoop
    from specdec.runtime.state import Round, RowRound

    gate = ModelGate(warmup_rounds=2, prior_weight=1e-9)
    rows = [SimpleNamespace(gate=gate, head_gate=None), SimpleNamespace(gate=gate, head_gate=None)]
    for accepted in (4, 4, 4, 0, 4, 4, 0, 4, 0, 4):  # two rows a round: the same run each
        drafted = [RowRound(4, accepted, [7] * (accepted + 1), "model", None)] * 2
        SpeculativeLoop._teach_gates(rows, Round(4, drafted, 0.0, 0.017))
        gate.observe_draft_step(0.017 / 4)  # c = 0.25
    for _ in range(4):
        SpeculativeLoop._teach_gates(rows, Round(4, [RowRound(0, 0, [7], "none", None)] * 2, 0.0, 0.01))  # r = 1.7
    assert abs(gate.alpha - 0.7) < 1e-6 and gate.tries == [20, 14, 14, 14] and gate.passes == [14, 14, 14, 14]
    assert abs(1 + gate.cumulative(4).sum() - 3.8) < 1e-6
    assert expected_speedup(gate.alpha, 4, gate.cost_ratio) / gate.verify_ratio < 1.0
    assert gate.pays(4)
    gate.observe(4, 0, 0.017)  # a rejected first draft: position 1 only
    assert gate.tries == [21, 14, 14, 14] and gate.passes == [14, 14, 14, 14]


def test_gate_counts_the_verify_pass_against_a_one_token_step():
    """High α and a cheap draft, but a verify pass that costs 5 one-token steps (r = 5): the model does not pay."""
    from specdec.runtime.adaptive_gamma import expected_speedup
    from specdec.runtime.drafters import ModelGate
    from specdec.runtime.loop import SpeculativeLoop
    from specdec.runtime.state import Round, RowRound

    costly = ModelGate(warmup_rounds=2)
    for _ in range(4):
        costly.observe(proposed=4, accepted=4, verify_s=0.04)
        costly.observe_draft_step(0.004)
    assert expected_speedup(costly.alpha, 4, costly.cost_ratio) > 1.0  # the paper's model (r = 1) says it pays
    declined = [costly.pays(4) for _ in range(9)]  # until four one-token passes are timed: 1st, 5th, 9th, ...
    assert [i for i, d in enumerate(declined) if not d] == [0, 4, 8]
    rows = [SimpleNamespace(gate=costly, head_gate=None), SimpleNamespace(gate=costly, head_gate=None)]
    plain = Round(4, [RowRound(0, 0, [7], "none", None), None], 0.0, 0.008)
    drafted = Round(4, [RowRound(0, 0, [7], "none", None), RowRound(2, 1, [7, 8], "lookup", None)], 0.0, 0.02)
    for record in (plain, drafted, plain):  # a round where some row verified drafts is no one-token pass
        SpeculativeLoop._teach_gates(rows, record)
    assert costly.plain_steps == 2 and abs(costly.verify_ratio - 0.04 / 0.008) < 1e-9
    assert not costly.pays(4)
    fixed = ModelGate(cost_ratio=0.1, warmup_rounds=0)  # a sampled request's gate: r stays 1, whatever it saw
    fixed.observe(proposed=4, accepted=4, verify_s=0.04)
    fixed.observe_plain(0.008)
    assert fixed.verify_ratio == 1.0 and fixed.pays(4)
    # even every draft accepted would not pay (5 tokens for 1.4 passes of 5 steps each): a probe is a lost round, so
    # one comes every 16 * PROBE_BOUND refusals, not every 16th
    costly.refusals = 0
    probes = [i for i in range(1, 600) if costly.pays(4)]
    assert len(probes) == 2 and probes[1] - probes[0] == 16 * ModelGate.PROBE_BOUND, probes  # (and a few declines
    # that time one-token passes: it has timed 2 of its 4)


def test_lookups_are_verified_only_where_they_pay():
    """`auto` verifies a lookup of a kind only while lookups of that kind emit more tokens per second of their verify
    passes than one-token passes do: with a 4.5 ms step and a 9 ms verify pass, weak lookups emitting 1.8 tokens a
    round (5 ms a token) are dropped but for a probe every 16th time, strong ones emitting 4 (2.25 ms) are kept, and
    a dropped lookup leaves the row to plain decoding. A sampled request's fixed gate keeps every lookup (its tokens
    must not depend on timing)."""
    from specdec.runtime.drafters import EMPTY, ChainDrafter, ModelGate, PromptLookupDrafter
    from specdec.runtime.loop import SpeculativeLoop
    from specdec.runtime.state import Round, RowRound

    gate = ModelGate(warmup_rounds=4)
    rows = [SimpleNamespace(gate=gate, head_gate=None)]
    assert gate.lookup_pays(False) and gate.lookup_pays(True)  # nothing timed yet
    for _ in range(4):
        SpeculativeLoop._teach_gates(rows, Round(4, [RowRound(0, 0, [7], "none", None)], 0.0, 0.0045))
    for accepted in (0, 1, 1, 0, 2, 1, 0, 1):  # weak: 1.75 tokens a 9 ms pass
        SpeculativeLoop._teach_gates(rows, Round(4, [RowRound(4, accepted, [7], "lookup", None)], 0.0, 0.009))
    for _ in range(4):  # strong: 4 tokens a pass
        SpeculativeLoop._teach_gates(rows, Round(4, [RowRound(4, 3, [7], "lookup", None, True)], 0.0, 0.009))
    assert [len(gate.lookups[k]) for k in (False, True)] == [8, 4] and gate.rounds == 0  # the model gate saw none
    assert gate.lookup_pays(True)
    weak = [gate.lookup_pays(False) for _ in range(32)]
    assert [i for i, pays in enumerate(weak) if pays] == [15, 31]  # the probes
    row = SimpleNamespace(gate=gate, head_gate=None, tokens=[5, 6, 7, 8, 9, 5, 6, 7],
                          config=SimpleNamespace(lookup_ngram=3, lookup_min_ngram=1))
    found = PromptLookupDrafter().propose([row], [4])[0]
    assert found.tokens.tolist() == [8, 9, 5, 6] and found.strong
    assert ChainDrafter(PromptLookupDrafter(), None).propose([row], [4])[0].tokens.tolist() == [8, 9, 5, 6]  # paid
    row.tokens = [5, 6, 7, 8, 9, 4, 3, 7]  # only "7" recurs: a weak lookup, dropped
    assert not PromptLookupDrafter().propose([row], [4])[0].strong
    assert ChainDrafter(PromptLookupDrafter(), None).propose([row], [4])[0] is EMPTY
    fixed = ModelGate(cost_ratio=0.1, warmup_rounds=0)
    fixed.observe_plain(0.0045)
    for _ in range(8):
        fixed.observe_lookup(False, 1.0, 0.009)
    assert all(fixed.lookup_pays(False) for _ in range(20))
