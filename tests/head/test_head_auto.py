"""`auto` weighs the draft head: where the bundle has a head its target can feed, a greedy request's `auto` drafts with
the head, the model or neither, whichever its gates (each drafter's measured acceptance and cost) expect to gain most
and only where that pays; prompt lookups go first as before. Its output stays the target's, token for token."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import specdec
from specdec import GenerationConfig
from specdec.runtime.config import DrafterName
from specdec.runtime.drafters import EMPTY, ChainDrafter, ModelGate, PromptLookupDrafter
from tests.head.test_head_exactness import GAMMAS, NEW_TOKENS, _backend_or_skip, _plain
from tests.runtime.test_exactness import PROMPTS


def _sources(gen, prompt, config) -> tuple[list, list]:
    """(the tokens of one request, the drafter of each of its rounds that verified drafts)."""
    request = gen.request([prompt], config)
    sources = [record.rows[0].source for record in gen.rounds(request)
               if record.rows and record.rows[0] is not None and record.rows[0].proposed]
    return gen.result(request.rows[0], request.stats).token_ids, sources


@pytest.mark.parametrize("backend", ["native", "onnxruntime"])
def test_auto_drafts_with_an_accepted_head_and_stays_exact(mirror_head_bundle, backend):
    with specdec.load(mirror_head_bundle, backend=_backend_or_skip(backend)) as gen:
        assert gen.requests.head_gate is not None
        # on a target this tiny a head step costs about a target step, so the measured gate rightly declines the head
        # after its warm-up; a fixed gate that calls the head cheap lets it draft wherever its acceptance pays
        gen.requests.head_gate = ModelGate(cost_ratio=0.05)
        heads = 0
        for prompt in PROMPTS[:6]:
            expected = _plain(gen, prompt)
            for gamma in GAMMAS:
                tokens, sources = _sources(gen, prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=gamma))
                assert tokens == expected, (prompt, gamma)
                assert set(sources) <= {DrafterName.HEAD, DrafterName.PROMPT_LOOKUP}
                heads += sources.count(DrafterName.HEAD)
        assert heads > 20  # the head drafted (its gate learned that it pays), not only lookups
        gate = gen.requests.head_gate
        # it learned from those rounds: this head's acceptance measured 0.17-0.23 (how many rounds the head drafts
        # depends on timing, through the lookup gate); a head of random weights is accepted a few times in a hundred
        assert gate.rounds == heads and gate.steps > 0 and gate.alpha > 0.1


def test_auto_stays_exact_beside_a_rejected_head(random_head_bundle):
    with specdec.load(random_head_bundle) as gen:
        for prompt in PROMPTS[:4]:
            expected = _plain(gen, prompt)
            for gamma in (1, 3, 7):
                assert gen.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=gamma)).token_ids \
                    == expected, (prompt, gamma)


def test_a_sampled_request_leaves_the_head_to_drafter_head(mirror_head_bundle):
    """A sampled request's `auto` gate is fixed (its tokens must not depend on what ran before): it weighs the model
    alone, and a bundle without a draft model then drafts only lookups."""
    with specdec.load(mirror_head_bundle) as gen:
        _, sources = _sources(gen, PROMPTS[0], GenerationConfig(max_new_tokens=NEW_TOKENS, temperature=0.8, seed=3))
        assert DrafterName.HEAD not in sources
        assert gen.requests.head_gate.rounds == 0


def _gate(alpha: float, cost: float, rounds: int = 8) -> ModelGate:
    """A fixed gate past its warm-up that has seen drafts accepted at `alpha` (r = 1: a verify pass costs a step)."""
    gate, taken = ModelGate(cost_ratio=cost, prior_weight=1e-9), round(100 * alpha)
    for _ in range(rounds):  # 100 rows a round, each proposing one draft
        gate.observe(100, taken, 0.01, [(1, 1)] * taken + [(1, 0)] * (100 - taken))
    return gate


class _Drafter:
    """A stand-in model or head that records which rows it was asked to draft for."""

    def __init__(self, token: int, ready: bool = True):
        self.token, self.asked, self._ready = token, [], ready

    def ready(self, row) -> bool:
        return self._ready

    def propose(self, rows, limits):
        self.asked.append(list(limits))
        return [SimpleNamespace(tokens=[self.token] * lim, strong=False) if lim else EMPTY for lim in limits]


def _picked(head_gate, model_gate, head_ready: bool = True):
    model, head = _Drafter(1), _Drafter(2, head_ready)
    chain = ChainDrafter(PromptLookupDrafter(), model, head)
    row = SimpleNamespace(gate=model_gate, head_gate=head_gate, tokens=[5, 6, 7, 8], active=True,
                          config=SimpleNamespace(lookup_ngram=3, lookup_min_ngram=1))
    proposal = chain.propose([row], [3])[0]
    return {1: "model", 2: "head"}[proposal.tokens[0]] if len(proposal.tokens) else None


def test_auto_picks_the_drafter_whose_gate_expects_more():
    cheap_good, cheap_poor = _gate(0.8, 0.1), _gate(0.05, 0.1)
    costly_good, costly_poor = _gate(0.9, 0.7), _gate(0.05, 0.7)
    assert _picked(cheap_good, costly_good) == "head"  # both pay; the head costs less
    assert _picked(cheap_poor, costly_good) == "model"  # the head does not pay
    assert _picked(ModelGate(cost_ratio=0.1), costly_good) == "head"  # a gate still learning goes first
    assert _picked(cheap_good, costly_good, head_ready=False) == "model"  # the head holds no features of the row
    assert _picked(None, costly_good) == "model"  # no head gate (a sampled request)
    gate = _gate(0.05, 0.7)
    assert _picked(cheap_poor, costly_poor) is None and costly_poor.refusals == 1  # neither pays: plain (or lookup)
    assert gate.expected(3) < 1.0 < cheap_good.expected(3)


def test_a_head_that_does_not_pay_is_left_out_of_auto_and_probed_now_and_then(mirror_head_bundle):
    """Weighing the head costs the rows' hidden states on every pass: where its gate expects no gain at any γ, a
    greedy request's rows get no head gate (and read no hidden states), but for one request in HEAD_PROBE."""
    from specdec.runtime.requests import HEAD_PROBE

    with specdec.load(mirror_head_bundle) as gen:
        layer, greedy = gen.requests, GenerationConfig()
        assert layer.head_gate_for(greedy) is layer.head_gate  # still learning
        layer.head_gate = _gate(0.8, 0.1)
        assert all(layer.head_gate_for(greedy) is layer.head_gate for _ in range(2 * HEAD_PROBE))  # it pays
        layer.head_gate = _gate(0.05, 0.5)
        weighed = [layer.head_gate_for(greedy) is not None for _ in range(2 * HEAD_PROBE)]
        assert weighed.count(True) == 2 and weighed[HEAD_PROBE - 1] and weighed[-1]
        assert layer.head_gate_for(GenerationConfig(temperature=0.8, seed=1)) is None
        request = gen.request([PROMPTS[0]], GenerationConfig(max_new_tokens=8))
        row = request.rows[0]
        assert row.head_gate is None and request.loop.feature_tap(row) is None  # no hidden states asked for
        assert [r for r in gen.rounds(request)] and row.head is None


def _measured(step_ratios: dict, cost: float = 0.12) -> ModelGate:
    """A measured gate past its warm-up whose drafts were accepted at 0.42, then 0.38, then 0.375 (conditional; 100
    rows of 3 drafts a round), with a draft step `cost` of a one-token step and verify passes of γ drafts costing
    step_ratios[γ] one-token steps (4 passes of each)."""
    gate, plain = ModelGate(warmup_rounds=2, prior_weight=1e-9), 0.01
    runs = [(3, 0)] * 58 + [(3, 1)] * 26 + [(3, 2)] * 10 + [(3, 3)] * 6
    for gamma, ratio in sorted(step_ratios.items()):
        for _ in range(4):
            gate.observe(sum(p for p, _ in runs), sum(a for _, a in runs), ratio * plain,
                         [(min(p, gamma), min(a, gamma)) for p, a in runs])
    for _ in range(4):
        gate.observe_plain(plain)
        gate.observe_draft_step(cost * plain)
    return gate


def test_auto_drafts_with_each_drafter_the_gamma_its_gate_expects_the_most_of():
    # a compute-bound verify pass (a CPU's: each token checked costs a share of a step): one draft a round pays best
    cpu = _measured({1: 1.10, 3: 1.40})
    assert abs(cpu.verify_ratio_at(1) - 1.10) < 1e-9 and abs(cpu.verify_ratio_at(3) - 1.40) < 1e-9
    assert abs(cpu.verify_ratio_at(4) - (1 + 0.40 * 4 / 3)) < 1e-9  # scaled from γ = 3, the nearest timed
    assert abs(cpu.verify_ratio_at(2) - (1 + 0.10 * 2)) < 1e-9  # (γ = 1 and 3 are as near: the one of more passes,
    # else the fewer drafts)
    assert cpu.best_gamma(4) == 1 and cpu.expected(1) > max(cpu.expected(g) for g in (2, 3, 4))
    # r is kept between passes and read again once a pass is timed: one-token passes twice as fast double it
    timed = _measured({1: 1.10})
    assert abs(timed.verify_ratio_at(1) - 1.10) < 1e-9
    for _ in range(5):
        timed.observe_plain(0.005)
    assert abs(timed.verify_ratio_at(1) - 2.20) < 1e-9
    # a memory-bound one (r near 1 whatever γ): two drafts
    gpu_like = _measured({1: 1.0, 3: 1.0})
    assert gpu_like.best_gamma(4) == 2
    # auto drafts that many with the head, and γ = limit with a gate still learning or a fixed one
    head, model = _Drafter(2), _Drafter(1)
    chain = ChainDrafter(PromptLookupDrafter(), model, head)
    row = SimpleNamespace(gate=_gate(0.05, 0.7), head_gate=cpu, tokens=[5, 6, 7, 8], active=True,
                          config=SimpleNamespace(lookup_ngram=3, lookup_min_ngram=1))
    assert list(chain.propose([row], [4])[0].tokens) == [2] and head.asked[-1] == [1]
    assert ModelGate(cost_ratio=0.1).best_gamma(4) == 4 and ModelGate().best_gamma(4) == 4
