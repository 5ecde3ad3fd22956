"""Small pieces of the bench: the prediction, the mode plan and rotation, prompt and peer-record checks."""
from __future__ import annotations

import pytest

from specdec.bench.config import BASELINE, BenchConfig, plan_modes
from specdec.bench.peers import peer_record_from_json
from specdec.bench.prompts import Prompt, prompt_from_json, select_prompts
from specdec.bench.run import rotated
from specdec.bench.summary import predicted, verify_ratio
from specdec.errors import ConfigError
from specdec.runtime.adaptive_gamma import expected_speedup


def test_prediction_is_design_formula_when_every_round_drafts_gamma():
    step = 0.03  # P, the target-only step
    # every round drafts γ = 4, the verify pass costs one step (r = 1), d = c·P: the paper's formula
    assert predicted(0.8, 4, 1.0, 0.2 * step, step, step, "model γ=4") == pytest.approx(expected_speedup(0.8, 4, 0.2))
    tokens = (1 - 0.8**5) / 0.2
    assert predicted(0.8, 4, 1.0, 0.2 * step, 2 * step, step, "m") == pytest.approx(tokens / (4 * 0.2 + 2))  # r = 2
    # half the rounds drafted: mean pass 0.5·V + 0.5·P = 0.045 s -> V = 0.06 s, r = 2
    assert verify_ratio(0.045, 0.5, step) == pytest.approx(2.0)
    mixed = (0.5 * tokens + 0.5) * step / (0.5 * (4 * 0.2 * step + 0.06) + 0.5 * step)
    assert predicted(0.8, 4, 0.5, 0.2 * step, 0.045, step, "m") == pytest.approx(mixed)
    assert predicted(None, 4, 1.0, 0.006, step, step, "m") is None
    assert predicted(0.5, None, 0.0, None, step, step, "m") == pytest.approx(1.0)  # no round drafted: plain decoding
    assert predicted(float("nan"), 4, 1.0, 0.006, step, step, "m") is None
    assert predicted(None, None, None, None, None, None, BASELINE) == 1.0
    assert verify_ratio(0.045, 0.5, None) is None


def test_plan_and_rotation(tmp_path):
    config = BenchConfig(bundle=str(tmp_path), out=str(tmp_path / "o"), gammas=(1, 4, 9))
    modes = plan_modes(config, has_draft=True, gamma_default=4, gamma_max=8)
    assert [m.name for m in modes] == [BASELINE, "model γ=4", "prompt_lookup γ=4", "auto γ=4", "model γ=1",
                                       "auto γ=1"]  # γ = 9 is past γ_max
    assert [(m.drafter, m.gamma) for m in modes[-2:]] == [("model", 1), ("auto", 1)]
    assert [m.name for m in plan_modes(config, False, 4, 8)] == [BASELINE, "prompt_lookup γ=4", "auto γ=4"]
    only_auto = BenchConfig(bundle=str(tmp_path), out=str(tmp_path / "o"), drafters=("auto",), gammas=(8,))
    assert [m.name for m in plan_modes(only_auto, True, 4, 8)] == [BASELINE, "auto γ=4", "auto γ=8"]
    with_head = BenchConfig(bundle=str(tmp_path), out=str(tmp_path / "o"), drafters=("head", "auto"), gammas=())
    assert [m.name for m in plan_modes(with_head, False, 4, 8, has_head=True)] == [BASELINE, "head γ=4", "auto γ=4"]
    assert [m.name for m in plan_modes(with_head, False, 4, 8)] == [BASELINE, "auto γ=4"]  # no head in the bundle
    assert rotated([1, 2, 3], 1) == [2, 3, 1] and rotated([1, 2, 3], 3) == [1, 2, 3]


def test_config_errors_have_hints(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        BenchConfig(bundle=str(tmp_path / "missing"), out="o")
    with pytest.raises(ConfigError) as info:
        BenchConfig(bundle=str(tmp_path), out="o", drafters=("none",))
    assert info.value.hint
    with pytest.raises(ConfigError):
        BenchConfig(bundle=str(tmp_path), out="o", repeats=0)


def test_prompt_records_and_selection():
    with pytest.raises(ConfigError, match="not a prompt record"):
        prompt_from_json('{"id": "x"}', "f:1")
    prompts = [Prompt("a", "c1", "long", True), Prompt("b", "c1", "short", True), Prompt("c", "c2", "x", True)]
    lengths = {"a": 50, "b": 10, "c": 200}
    assert [p.id for p in select_prompts(prompts, lengths, 1, 100)] == ["b"]  # c does not fit
    assert [p.id for p in select_prompts(prompts, lengths, 0, 1000)] == ["a", "b", "c"]
    with pytest.raises(ConfigError, match="no prompt fits"):
        select_prompts(prompts, lengths, 0, 5)


def test_peer_records_need_system_mode_status():
    assert peer_record_from_json('{"system": "p", "mode": "m", "status": "ok"}', "f:1")["system"] == "p"
    with pytest.raises(ConfigError, match="lacks status"):
        peer_record_from_json('{"system": "p", "mode": "m"}', "f:1")
