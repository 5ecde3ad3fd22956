"""The goodput γ controller, the serving loop's per-row γ and verify grouping, options, and `specdec serve`."""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from specdec.errors import ConfigError
from specdec.runtime.forward import Capabilities, ForwardResult, Observed, Output
from specdec.runtime.state import Round, RowRound
from specdec.serving.goodput import Costs, GoodputGamma
from specdec.serving.options import API_KEY_ENV, ServeOptions
from tests.conftest import free_port  # noqa: E402

GAMMA_MAX = 6


def _costs(step_growth: float) -> Costs:
    """A machine where a batched T=1 step over n rows costs 20 ms · (1 + growth · (n − 1)), a draft step a third of
    that, and a one-row verify pass of T tokens 20 ms · (1 + 0.05 · (T − 1))."""
    rows = np.arange(9)
    step = np.where(rows > 0, 0.020 * (1 + step_growth * (rows - 1)), 0.0)
    verify = 0.020 * (1 + 0.05 * np.maximum(np.arange(GAMMA_MAX + 2) - 1, 0))
    return Costs(step, step / 3, np.asarray([0.0, step[1] / 3, step[1] / 2.5]), verify)


def test_a_draft_that_copies_the_targets_kv_never_pays_a_two_token_catch_up():
    costs = _costs(step_growth=0.15)
    own = GoodputGamma(costs, GAMMA_MAX, prior_alpha=0.9)
    copying = GoodputGamma(costs, GAMMA_MAX, prior_alpha=0.9, copies_kv=True)
    for rows in (1, 4, 8):  # its catch-up is the batched T = 1 step; the other's is partly a T = 2 pass per row
        tokens, seconds = copying.expected(rows, rows, 4)
        assert tokens == own.expected(rows, rows, 4)[0]
        assert seconds == pytest.approx(own.expected(rows, rows, 4)[1] - _pairs(rows, 0.9, 4) * (
            rows * costs.draft_pass[2] - costs.draft_step[rows]))


def _pairs(rows: int, alpha: float, gamma: int) -> float:
    """The chance some of `rows` rows had all γ drafts accepted (the prior α is per position, conditional)."""
    return 1.0 - (1.0 - alpha ** gamma) ** rows


def test_controller_speculates_alone_and_stops_under_load_when_batching_pays():
    controller = GoodputGamma(_costs(step_growth=0.15), GAMMA_MAX, prior_alpha=0.9)
    assert controller.plan(rows=1, drafting=1) > 0
    assert GoodputGamma(_costs(step_growth=0.15), GAMMA_MAX, prior_alpha=0.9).plan(rows=8, drafting=8) == 0
    for rows in range(1, 9):  # never a γ whose expected rate is below plain decoding's
        gamma = controller.best(rows, rows)
        tokens, seconds = controller.expected(rows, rows, gamma)
        plain_tokens, plain_seconds = controller.expected(rows, rows, 0)
        assert tokens / seconds >= plain_tokens / plain_seconds


def test_controller_keeps_speculating_where_batching_gains_nothing_and_turns_off_for_a_bad_draft():
    costly = GoodputGamma(_costs(step_growth=1.0), GAMMA_MAX, prior_alpha=0.9)  # rows cost as much batched as not
    assert costly.plan(rows=8, drafting=8) > 0
    bad = GoodputGamma(_costs(step_growth=1.0), GAMMA_MAX, prior_alpha=0.05)
    assert bad.plan(rows=1, drafting=1) == 0


def test_controller_decides_by_measured_goodput_and_re_measures_the_other_side():
    controller = GoodputGamma(_costs(step_growth=1.0), GAMMA_MAX, prior_alpha=0.9)  # the model favours speculating
    plan = []
    for _ in range(200):  # but speculative rounds measure 20 tokens/s, plain ones 30
        gamma = controller.plan(rows=2, drafting=2)
        plan.append(gamma)
        controller.observe_round(2, 8 if gamma else 2, 0.4 if gamma else 2 / 30)
    assert plan[0] > 0 and plan[-1] == 0
    assert controller.measured(2, True) < controller.measured(2, False)
    late = plan[100:]
    assert 0 < sum(g > 0 for g in late) <= len(late) // 20  # speculation is re-measured, less and less often
    assert controller.interval[2] > 40
    batched = GoodputGamma(_costs(step_growth=0.15), GAMMA_MAX, prior_alpha=0.3)  # batching pays: no α could win
    assert not any(batched.plan(rows=8, drafting=8) for _ in range(400))


def test_controller_keeps_the_bundles_gamma_or_its_own_near_the_optimum_and_moves_when_they_fall_behind():
    probe = GoodputGamma(_costs(step_growth=1.0), GAMMA_MAX, prior_alpha=0.9)
    best, rates = probe.best(1, 1), probe.rates(1, 1)
    near = [g for g in range(1, GAMMA_MAX + 1) if g != best and rates[g] >= 0.95 * rates[best]]
    far = [g for g in range(1, GAMMA_MAX + 1) if rates[g] < 0.9 * rates[best]]
    assert best > 0 and near and far, "the test needs a flat optimum and a poor γ"
    anchored = GoodputGamma(_costs(step_growth=1.0), GAMMA_MAX, prior_alpha=0.9, fixed=near[0])
    assert anchored.plan(rows=1, drafting=1) == near[0]  # the bundle's γ, close enough to the model's best
    controller = GoodputGamma(_costs(step_growth=1.0), GAMMA_MAX, prior_alpha=0.9, fixed=far[0])
    assert controller.plan(rows=1, drafting=1) == best  # the bundle's γ is too far behind
    controller.gamma = near[-1]  # as if the previous round had chosen another γ close to the best
    assert controller.plan(rows=1, drafting=1) == near[-1]
    controller.gamma = far[0]
    assert controller.plan(rows=1, drafting=1) == best


def test_a_side_seen_only_a_few_times_is_re_measured_soon():
    controller = GoodputGamma(_costs(step_growth=1.0), GAMMA_MAX, prior_alpha=0.9)  # the model favours speculating
    plan = []
    for i in range(60):  # speculation's first rounds are bad (a cold start), later ones good
        gamma = controller.plan(rows=1, drafting=1)
        plan.append(gamma)
        good = sum(g > 0 for g in plan) > 4
        controller.observe_round(1, (gamma + 1 if good else 1) if gamma else 1, 0.03 if gamma else 0.02)
    assert 0 in plan[:20]  # the bad start turned it to plain decoding ...
    assert all(g > 0 for g in plan[-10:])  # ... and it came back well before EXPLORE_EVERY (40) plain rounds


def _measure(controller, rows: int, spec_rate: float, plain_rate: float, rounds: int) -> list:
    """Run `rounds` rounds at `rows` rows on a machine where speculative rounds measure spec_rate tokens/s and plain
    ones plain_rate; -> the planned γ per round."""
    plan = []
    for _ in range(rounds):
        gamma = controller.plan(rows=rows, drafting=rows)
        plan.append(gamma)
        tokens = rows * (3 if gamma else 1)
        controller.observe_round(rows, tokens, tokens / (spec_rate if gamma else plain_rate))
    return plan


def test_plain_decoding_ahead_at_fewer_rows_stops_speculation_being_measured_at_more():
    controller = GoodputGamma(_costs(step_growth=1.0), GAMMA_MAX, prior_alpha=0.9)  # the model favours speculating
    assert controller.settled(2) is None and controller.implied(4) is None
    _measure(controller, 2, spec_rate=20.0, plain_rate=30.0, rounds=300)
    assert controller.settled(2) is False and controller.implied(4) is False and controller.implied(1) is None
    plan = _measure(controller, 4, spec_rate=20.0, plain_rate=40.0, rounds=400)  # the smoothed load passes 2 and 3
    assert round(controller.load) == 4 and not any(plan[60:])  # from 3 rows on, speculation is never re-measured
    ahead = GoodputGamma(_costs(step_growth=1.0), GAMMA_MAX, prior_alpha=0.3)  # the model: plain at 6 rows ...
    assert ahead.best(6, 6) == 0
    _measure(ahead, 8, spec_rate=60.0, plain_rate=40.0, rounds=300)  # ... but speculation measured ahead at 8
    assert ahead.settled(8) is True and ahead.implied(6) is True
    assert ahead.plan(rows=6, drafting=6) > 0
    wrong = GoodputGamma(_costs(step_growth=1.0), GAMMA_MAX, prior_alpha=0.9)
    _measure(wrong, 8, spec_rate=60.0, plain_rate=40.0, rounds=300)
    _measure(wrong, 2, spec_rate=20.0, plain_rate=30.0, rounds=300)  # noise: the two loads disagree
    assert wrong.settled(8) is True and wrong.settled(2) is False and wrong.implied(4) is None


def test_a_round_without_drafts_counts_as_plain_whatever_was_planned():
    controller = GoodputGamma(_costs(step_growth=1.0), GAMMA_MAX, prior_alpha=0.9)
    controller.plan(rows=1, drafting=1)
    controller.plan(rows=1, drafting=1)  # the previous γ was > 0 too: this round's goodput counts
    assert controller.gamma > 0
    controller.observe_round(1, 1, 0.02, speculated=False)  # every row ran its first round at γ = 0
    assert controller.measured(1, False) == pytest.approx(50.0) and controller.measured(1, True) is None
    controller.observe_round(1, 5, 0.1)
    assert controller.measured(1, True) == pytest.approx(50.0)


def test_a_round_counts_at_the_rows_it_had_not_the_smoothed_load():
    controller = GoodputGamma(_costs(step_growth=0.15), GAMMA_MAX, prior_alpha=0.9)
    for _ in range(20):
        controller.plan(rows=1, drafting=1)
        controller.observe_round(1, 1, 0.025, speculated=False)  # one row alone: 40 tokens/s
    controller.plan(rows=8, drafting=8)  # a burst of 8 rows while the smoothed load still reads about 1
    assert round(controller.load) < 8
    controller.observe_round(8, 8, 0.035, speculated=False)
    assert controller.measured(1, False) == pytest.approx(40.0) and controller.measured(8, False) > 200


def test_controller_follows_the_smoothed_load_not_every_dip():
    controller = GoodputGamma(_costs(step_growth=0.15), GAMMA_MAX, prior_alpha=0.9)  # speculates alone, not at 8
    plan = [controller.plan(rows=7 if i % 8 == 0 else 8, drafting=8) for i in range(200)]  # brief dips to 7 rows
    assert not any(plan)
    rising = [controller.plan(rows=1, drafting=1) for _ in range(200)]  # the load really drops
    assert rising[0] == 0 and sum(g > 0 for g in rising[-50:]) > 25  # mostly speculating (re-measuring plain between)


def test_controller_modes_and_learning_from_rounds_and_calls():
    assert GoodputGamma(_costs(0.15), GAMMA_MAX, mode="off").plan(1, 1) == 0
    assert GoodputGamma(_costs(0.15), GAMMA_MAX, mode="fixed", fixed=3).plan(8, 8) == 3
    controller = GoodputGamma(_costs(0.15), GAMMA_MAX, prior_alpha=0.9)
    assert controller.plan(1, 1) > 0
    before = controller.acceptance.alphas[0]
    for _ in range(10):  # every draft rejected
        controller.observe(Round(4, [RowRound(4, 0, [1], "model", None)] * 2, draft_s=0.05, verify_s=0.1))
    assert controller.acceptance.alphas[0] < before
    controller.observe_call("target", 2, 5, 0.30)  # a verify pass of T = 5 over 2 rows: 0.15 s per row
    assert controller.costs.verify[5] > 0.05
    controller.observe_call("draft", 4, 1, 0.5)  # a batched draft step over slots 0..3
    assert controller.costs.draft_step[4] > _costs(0.15).draft_step[4]
    assert controller.plan(rows=1, drafting=1) == 0  # a rejected, slow draft no longer pays


def test_observed_backend_reports_the_width_a_call_costs_and_keeps_its_capabilities():
    calls = []

    class Echo:
        max_seq_len = 9
        capabilities = Capabilities(frozenset({Output.LOGITS, Output.FEATURES}), None)

        def run(self, request):
            return ForwardResult(request.input_ids)

    metered = Observed(Echo(), functools.partial(lambda *call: calls.append(call[:3]), "target"))
    metered.forward(np.zeros((2, 1)), np.zeros(2), True, np.array([0, 5]))  # batched T=1 over slots 0..5
    metered.forward(np.zeros((3, 4)), np.zeros(3), False, np.array([0, 1, 2]))  # T=4: one run per row
    metered.forward(np.zeros((1, 1)), np.zeros(1), True, np.array([7]))  # one row on its own binding
    assert calls == [("target", 6, 1), ("target", 3, 4), ("target", 1, 1)] and metered.max_seq_len == 9
    assert metered.calls == 3 and metered.seconds > 0
    assert Observed(metered).capabilities is Echo.capabilities  # wrappers keep what the backend declares


def test_serve_options_are_checked():
    with pytest.raises(ConfigError, match="Hint"):
        ServeOptions(bundle="b", speculation="always")
    for bad in ({"port": 70000}, {"max_batch": 0}, {"max_queue": -1}, {"gamma": 0}, {"api_key": ""},
                {"max_body_bytes": 10}, {"header_timeout_s": 0}, {"body_timeout_s": -1}, {"body_timeout_s": True},
                {"drain_s": 1e9}, {"keep_alive_s": 0}, {"max_connections": 0}, {"reuse_prefix": "no"}):
        with pytest.raises(ConfigError):
            ServeOptions(bundle="b", **bad)
    assert ServeOptions(bundle="b").host == "127.0.0.1"
    os.environ[API_KEY_ENV] = "from-env"
    try:
        assert ServeOptions(bundle="b").key == "from-env" and ServeOptions(bundle="b", api_key="k").key == "k"
    finally:
        del os.environ[API_KEY_ENV]



def test_specdec_serve_binds_loopback_and_answers(gqa_int4_bundle):
    pytest.importorskip("uvicorn", reason="the [serve] extra is not installed")
    port = free_port()
    env = {**os.environ, API_KEY_ENV: "cli-key"}
    command = [sys.executable, "-m", "specdec.cli", "serve", str(gqa_int4_bundle), "--port", str(port), "--max-batch", "2"]
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline, health = time.monotonic() + 60, None
        while time.monotonic() < deadline and server.poll() is None:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert health is not None and health.json() == {"status": "ok"}
        body = {"model": "gqa", "prompt": "hi", "max_tokens": 3}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body).status_code == 401
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                            headers={"authorization": "Bearer cli-key"})
        assert answer.json()["usage"]["completion_tokens"] == 3
        if shutil.which("ss"):  # the listening socket's local address is loopback only
            listening = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
            assert [line.split()[3] for line in listening.splitlines()] == [f"127.0.0.1:{port}"]
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_specdec_serve_reports_a_missing_bundle(tmp_path, capsys):
    from specdec.cli import main

    assert main(["serve", str(tmp_path / "missing"), "--port", "0"]) == 1
    assert "Hint:" in capsys.readouterr().err
