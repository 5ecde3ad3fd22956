"""γ choice against brute force, the γ policies, and `calibrate_gamma` writing a valid manifest."""
from __future__ import annotations

import dataclasses

import itertools

import numpy as np
import pytest

from specdec import GenerationConfig, load
from specdec.calibration.gamma import GammaConfig, calibrate_gamma, tune_gamma
from specdec.calibration.policies import run_policy
from specdec.errors import ConfigError
from specdec.manifest import GammaRecord, check_bundle_files, read_manifest
from specdec.runtime.adaptive_gamma import (
    AdaptiveGamma,
    FixedGamma,
    HeuristicGamma,
    adaptive_from_record,
    best_gamma,
    conditional_from_cumulative,
    cumulative_from_conditional,
)
from specdec.runtime.adaptive_gamma import expected_speedup

ALPHAS = [0.0, 0.1, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0]
COSTS = [0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 2.0]


@pytest.mark.parametrize("gamma_max", [1, 4, 8, 16])
def test_constant_alpha_matches_brute_force_of_the_paper_formula(gamma_max):
    for alpha, cost in itertools.product(ALPHAS, COSTS):
        speedups = [expected_speedup(alpha, g, cost) for g in range(1, gamma_max + 1)]
        brute = int(np.argmax(speedups)) + 1
        ours = best_gamma(cumulative_from_conditional([alpha] * gamma_max), cost)
        assert ours == brute or np.isclose(speedups[ours - 1], speedups[brute - 1]), (alpha, cost)


def _brute(alphas, cost, verify):
    best, best_value = None, -1.0
    for gamma in range(1, len(alphas) + 1):
        tokens, reach = 1.0, 1.0
        for i in range(gamma):  # expected emitted tokens: 1 + sum over positions of P(all drafts up to i accepted)
            reach *= alphas[i]
            tokens += reach
        value = tokens / (gamma * cost + (1.0 if verify is None else verify[gamma - 1]))
        if value > best_value + 1e-12:
            best, best_value = gamma, value
    return best


def test_per_position_tables_match_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(300):
        size = int(rng.integers(1, 10))
        alphas = np.sort(rng.uniform(0, 1, size))[::-1] if rng.random() < 0.5 else rng.uniform(0, 1, size)
        cost = float(rng.choice([rng.uniform(0, 0.3), rng.uniform(0, 2)]))
        verify = None if rng.random() < 0.5 else 1 + np.cumsum(rng.uniform(0, 0.2, size))
        assert best_gamma(cumulative_from_conditional(alphas), cost, verify) == _brute(alphas, cost, verify)


def test_conditional_and_cumulative_round_trip():
    alphas = np.array([0.9, 0.8, 0.5, 0.7])
    assert np.allclose(conditional_from_cumulative(cumulative_from_conditional(alphas)), alphas)
    assert conditional_from_cumulative([0.5, 0.0, 0.0]).tolist() == [0.5, 0.0, 0.0]


def test_heuristic_and_adaptive_policies():
    hf = HeuristicGamma(4, 8)
    hf.observe_row(4, 4)
    assert hf.gamma == 6
    hf.observe_row(6, 6)
    hf.observe_row(8, 8)
    assert hf.gamma == 8
    hf.observe_row(8, 2)
    assert hf.gamma == 7
    ours = AdaptiveGamma(8, cost_ratio=0.1, prior_alphas=0.5)
    start = ours.gamma
    for _ in range(40):
        ours.observe_row(ours.gamma, ours.gamma)  # every draft accepted: γ grows to γ_max
    assert ours.gamma == 8 > start
    for _ in range(60):
        ours.observe_row(ours.gamma, 0)  # every first draft rejected: γ falls to 1
    assert ours.gamma == 1
    fixed = FixedGamma(3)
    fixed.observe_row(3, 0)
    assert fixed.gamma == 3


def test_adaptive_policy_takes_the_calibrated_verify_cost():
    record = GammaRecord(gamma=1, cumulative=[], alphas=[0.95] * 4, cost_ratio=0.1, verify_cost=[1.1, 1.6, 2.2, 2.9],
                         speedups=[], rounds=1, verify_cost_used=True)
    measured = adaptive_from_record(record, 6, alpha=0.5, cost_ratio=0.5)
    paper = adaptive_from_record(dataclasses.replace(record, verify_cost_used=False), 6, alpha=0.5, cost_ratio=0.5)
    assert np.allclose(measured.verify_cost, [1.1, 1.6, 2.2, 2.9, 3.6, 4.3])  # beyond the record: r keeps growing
    want = best_gamma(cumulative_from_conditional([0.95] * 6), 0.1, measured.verify_cost)
    assert measured.gamma == want == 1 and paper.gamma == 6  # a verify pass that grows with γ calls for a short γ
    fallback = adaptive_from_record(None, 4, alpha=0.6, cost_ratio=0.3)
    assert fallback.cost_ratio == 0.3 and fallback.verify_cost is None and np.allclose(fallback.alphas, 0.6)


def test_policies_keep_greedy_equality(int4_bundle):
    with load(int4_bundle) as gen:
        config = GenerationConfig(max_new_tokens=20, drafter="model")
        for prompt in ("The quick brown fox", "def add(a, b):", "Once upon a time"):
            plain = gen.generate(prompt, GenerationConfig(max_new_tokens=20, drafter="none")).token_ids
            for policy in (HeuristicGamma(2, 6), AdaptiveGamma(6, 0.2, 0.6), FixedGamma(5)):
                tokens, stats, _ = run_policy(gen, prompt, config, policy)
                assert tokens == plain and stats.proposed > 0


def test_calibrate_gamma_writes_a_valid_manifest(bundle_copy):
    before = read_manifest(bundle_copy)
    result = calibrate_gamma(bundle_copy, GammaConfig(prompts=("The quick brown fox", "Once upon a time"),
                                                      max_new_tokens=16, chat=False))
    after = read_manifest(bundle_copy)
    check_bundle_files(bundle_copy, after)  # hashes of model files are still valid
    assert 1 <= result.gamma <= before.defaults.gamma_max and after.defaults.gamma == result.gamma
    assert len(result.cumulative) == before.defaults.gamma_max and 0 <= result.cost_ratio
    assert after.draft.calibration.gamma.gamma == result.gamma
    assert result.verify_cost_used and len(result.verify_cost) == before.defaults.gamma_max
    assert result.gamma == best_gamma(result.cumulative, result.cost_ratio, result.verify_cost)
    assert after.draft.calibration.gamma.verify_cost_used
    with pytest.raises(ConfigError, match="prompt"):
        GammaConfig(prompts=())


def test_gamma_calibration_uses_raw_text_where_the_tokenizer_has_no_chat_template(bundle_copy):
    """`specdec calibrate gamma` (chat by default) on a bundle whose tokenizer has no chat template."""
    import json

    (bundle_copy / "chat_template.jinja").unlink(missing_ok=True)
    config_path = bundle_copy / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config.pop("chat_template", None)
    config_path.write_text(json.dumps(tokenizer_config))
    with load(bundle_copy, verify=False) as gen:
        assert not gen.codec.has_chat_template
        with pytest.raises(ConfigError, match="no chat template") as info:
            gen.generate("x", GenerationConfig(chat=True))
        assert "chat=False" in info.value.hint and "generate without" not in info.value.hint
    result = tune_gamma(bundle_copy, GammaConfig(prompts=("The quick brown fox",), max_new_tokens=16))
    assert result.rounds > 0
