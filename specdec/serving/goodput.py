"""γ per round from measured goodput: speculation only where it beats plain decoding at this load.

A round over n rows, m of them drafting with the model at γ, costs on the onnxruntime gqa backend
    γ = 0:  T1(n)                                   one batched T=1 target step (one read of the weights)
    γ > 0:  C(m) + (γ − 1)·D1(m) + m·V(γ+1) + T1(n − m)
            the draft's catch-up C(m), γ − 1 batched draft steps, the verify passes of the drafting rows one row
            at a time (GroupQueryAttention on the CPU takes B = 1 when T > 1), the other rows batched.
            C(m) = D1(m) when every row has one token to catch up on, m·D2 (one T = 2 pass per row) when one
            has two (all its drafts were accepted): C(m) = P·m·D2 + (1 − P)·D1(m), P = 1 − (1 − A_γ)^m
plus n·h of host time (sampling, acceptance, bookkeeping), and emits n − m + m·(1 + A_1 + … + A_γ) tokens, with
A_j the running per-position acceptance. T1, D1, D2 and V are measured at start (`measure_costs`) and learnt from
every forward call (`Observed` with an observer; moving averages whose first observations weigh most).

The model picks the γ > 0 to speculate with; whether to speculate at all is decided by **measured** goodput: tokens
per second of whole engine rounds (host work and text delivery included), kept per (rows the round had, plain or
speculative) as decayed sums. The load a plan goes by is the number of active rows smoothed over rounds (LOAD_EMA):
under a steady load of C clients the batch dips below C between one request and the next, and following every dip
would switch to speculation and back, each switch costing the draft a catch-up on every row. Where only one side is
measured yet, the model decides. After EXPLORE_EVERY rounds at a load, a run of EXPLORE_RUN rounds re-measures the
other side; the interval doubles each time the run confirms the choice (a speculative run after plain ones costs the
draft's catch-up on every token it missed, about a prefill per row), and speculation is explored only where a high
acceptance (OPTIMISTIC_ALPHA) would make the model expect it to win. That first catching-up round is not counted in
the speculative goodput: it is the price of exploring, not of speculating. Speculation's gain only falls as rows are
added (plain decoding's batched step is sublinear in the rows, verification runs per row), so a load where both
sides are measured (`settled`) speaks for others (`implied`): plain ahead there means plain above it, with no
re-measuring of speculation up there (each would cost every row a catch-up), and speculation ahead means speculation
below it. The model alone errs both ways (acceptance cut short by max_tokens, host time, a T1 measured under other
load), which is why the switch itself is measured.

The constants below are tuned with `python benchmarks/serve_load.py --bundle B --modes plain,fixed,adaptive`
(concurrency 1, 2, 4, 8): adaptive should match the better of plain and fixed at every C. The run records under
benchmarks/results/serve-load/ hold what each choice measured.

Greedy rows' output never depends on γ. Seeded sampled rows keep their own deterministic γ policy (the engine
pins them), so the choice here never reaches their tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from specdec.lowering import PAD_ID
from specdec.manifest import Role
from specdec.runtime.adaptive_gamma import AdaptiveGamma, GammaPolicy, cumulative_from_conditional
from specdec.serving.options import Speculation

EMA = 0.2  # weight of the newest round in a moving average, once a cell has 1/EMA observations
PRIOR_WEIGHT = 2.0  # pseudo-rounds the prior acceptance counts for
OPTIMISTIC_ALPHA = 0.95  # speculation is explored only where it would win at this acceptance
EXPLORE_EVERY = 40  # rounds at one load before the side not chosen is re-measured; doubles (up to EXPLORE_MAX)
EXPLORE_MAX = 1280  # each time a re-measurement confirms the choice, and resets when it does not
EXPLORE_RUN = 3  # rounds a re-measurement lasts
DECAY = 0.97  # weight of older rounds in measured goodput: ~33 rounds, since one speculative round's tokens swing
# from 1 to γ + 1 (with a shorter memory a few rejected rounds in a row stopped speculation that paid)
FEW_ROUNDS = 6  # re-measure every EXPLORE_SOON · rows rounds until both sides of a load have this many counted rounds
EXPLORE_SOON = 8
SWITCH_ON = 1.1  # plain → speculative only where speculation measured 10 % more: the switch costs each row a draft
# catch-up on every token decoded plainly, which no round's goodput counts (where the two sides measure close,
# switching back and forth costs more than either side's own rate)
LOAD_EMA = 0.05  # weight of the newest round in the smoothed number of active rows
KEEP_GAMMA = 0.95  # the bundle's γ, else the current one, is kept while the model rates it within 5 % of its best:
# near the optimum the rate curve is flat and its noisy inputs would otherwise swing γ across its range


@dataclass
class Costs:
    """Seconds per forward call on this machine."""

    target_step: np.ndarray  # [B + 1]: batched T = 1 target forward over n rows at index n (index 0: 0)
    draft_step: np.ndarray  # [B + 1]: the same for the draft (zeros without a draft)
    draft_pass: np.ndarray  # [3]: one-row draft pass of T = 2 at index 2 (a catch-up after all drafts were accepted)
    verify: np.ndarray  # [γ_max + 2]: one-row target forward of T tokens at index T
    host_row: float = 0.0  # host seconds per row and round
    counts: dict = field(default_factory=dict)  # (table id, index) -> observations so far (the start's counts 1)

    def update(self, table: np.ndarray, index: int, seconds: float) -> None:
        if 0 < index < len(table) and seconds > 0:
            key = (id(table), index)
            self.counts[key] = self.counts.get(key, 1) + 1
            table[index] += max(EMA, 1.0 / self.counts[key]) * (seconds - table[index])


def _median_time(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def measure_costs(target, draft, batch: int, gamma_max: int, length: int = 64, repeats: int = 3) -> Costs:
    """Time the calls a round is made of, on empty slots (before any request holds one): batched T = 1 steps of
    both models for n = 1..batch and one-row target passes of T = 2..γ_max + 1, at cache length `length`."""
    length = min(length, target.max_seq_len - gamma_max - 2)

    def step(backend, rows: int):
        ids = np.full((rows, 1), PAD_ID, dtype=np.int64)  # [n, 1]
        lens = np.full(rows, length, dtype=np.int64)
        return lambda: backend.forward(ids, lens, True, np.arange(rows, dtype=np.int64))

    def verify(steps: int, backend=target):
        ids = np.full((1, steps), PAD_ID, dtype=np.int64)  # [1, T]
        return lambda: backend.forward(ids, np.asarray([length], dtype=np.int64), False, np.zeros(1, dtype=np.int64))

    sizes = range(1, batch + 1)
    target_step = np.zeros(batch + 1)
    draft_step = np.zeros(batch + 1)
    verify_s = np.zeros(gamma_max + 2)
    for rows in sizes:
        target_step[rows] = _median_time(step(target, rows), repeats)
        if draft is not None:
            draft_step[rows] = _median_time(step(draft, rows), repeats)
    verify_s[1] = target_step[1]
    for steps in range(2, gamma_max + 2):
        verify_s[steps] = _median_time(verify(steps), repeats)
    draft_pass = np.zeros(3)
    if draft is not None:
        draft_pass[1], draft_pass[2] = draft_step[1], _median_time(verify(2, draft), repeats)
    return Costs(target_step, draft_step, draft_pass, verify_s)


class GoodputGamma(GammaPolicy):
    """The engine's γ policy: `plan(rows, drafting)` before a round sets `gamma`; `observe_call` learns the cost
    of every forward call, the loop's `observe(record)` the acceptance, `observe_round` the measured goodput.
    mode: a Speculation: adaptive (goodput), fixed (always `fixed`), off (0)."""

    def __init__(self, costs: Costs, gamma_max: int, mode: str = Speculation.ADAPTIVE, fixed: int = 4,
                 prior_alpha=0.7, has_model: bool = True, copies_kv: bool = False):
        self.costs = costs
        self.gamma_max = gamma_max
        self.mode = mode
        self.fixed = min(fixed, gamma_max)
        self.has_model = has_model
        self.copies_kv = copies_kv  # the draft copies the target's KV: every catch-up is one T = 1 step
        self.acceptance = AdaptiveGamma(gamma_max, 1.0, prior_alpha, prior_weight=PRIOR_WEIGHT)  # its running α only
        self.gamma = 0 if mode == Speculation.OFF else self.fixed
        self.goodput = {}  # (rows, speculating) -> [decayed tokens, decayed seconds] of whole rounds
        self.counted = {}  # (rows, speculating) -> rounds counted
        self.streak = {}  # rows -> rounds since the side not chosen was last re-measured at that load
        self.interval = {}  # rows -> rounds between re-measurements at that load
        self.explore = (0, False)  # (rounds left, speculating) of a re-measurement run
        self.explored = None  # (rows, the choice it questioned) after a run, until the next plan judges it
        self.previous_gamma = 0
        self.load = 0.0  # active rows, smoothed

    def expected(self, rows: int, drafting: int, gamma: int, alphas=None, gains=None) -> tuple[float, float]:
        """(tokens, seconds) of a round over `rows` rows, `drafting` of them drafting at `gamma`; alphas: the
        conditional acceptance per position (default: the running estimate); gains: their cumulative_from_conditional,
        where the caller has it."""
        c = self.costs
        host = rows * c.host_row
        if gamma == 0 or drafting == 0:
            return float(rows), c.target_step[rows] + host
        if gains is None:
            gains = cumulative_from_conditional(self.acceptance.alphas if alphas is None else alphas)
        gains = gains[:gamma]  # [γ] A_1..A_γ
        tokens = rows - drafting + drafting * (1.0 + float(gains.sum()))
        draft = 0.0
        if self.has_model:
            pairs = 0.0 if self.copies_kv else 1.0 - (1.0 - float(gains[-1])) ** drafting  # a row catches up on two
            catch_up = pairs * drafting * c.draft_pass[2] + (1.0 - pairs) * c.draft_step[drafting]
            draft = catch_up + (gamma - 1) * c.draft_step[drafting]
        seconds = draft + drafting * c.verify[gamma + 1] + c.target_step[rows - drafting] + host
        return tokens, seconds

    def rates(self, rows: int, drafting: int, alphas=None) -> np.ndarray:
        """[γ_max + 1] expected tokens per second for γ = 0..γ_max."""
        gains = cumulative_from_conditional(self.acceptance.alphas if alphas is None else alphas)  # once for every γ
        return np.asarray([tokens / seconds for tokens, seconds in
                           (self.expected(rows, drafting, g, gains=gains) for g in range(self.gamma_max + 1))])

    def best(self, rows: int, drafting: int) -> int:
        """The γ in 0..γ_max with the highest expected tokens per second (ties: the smaller)."""
        return int(np.argmax(self.rates(rows, drafting)))

    def plan(self, rows: int, drafting: int) -> int:
        """Set and return γ for the next round of `rows` active rows, `drafting` of which may draft."""
        self.previous_gamma = self.gamma
        if self.mode != Speculation.ADAPTIVE or not rows:
            return self.gamma
        rows = min(rows, len(self.costs.target_step) - 1)
        self.load = rows if not self.load else self.load + LOAD_EMA * (rows - self.load)
        load = min(max(1, round(self.load)), len(self.costs.target_step) - 1)
        drafting = min(drafting, load)
        rates = self.rates(load, drafting)
        best = int(np.argmax(rates[1:])) + 1
        for anchor in (self.fixed, self.previous_gamma):  # the bundle's (calibrated) γ first, then the last one
            if anchor and rates[anchor] >= KEEP_GAMMA * rates[best]:
                best = anchor
                break
        speculate = drafting > 0 and self.has_model and self._speculate(load, drafting, rates[best] > rates[0])
        self.gamma = best if speculate else 0
        return self.gamma

    def measured(self, rows: int, speculating: bool) -> float | None:
        """Measured tokens per second at `rows` rows, speculating or not; None before any round was counted."""
        tokens, seconds = self.goodput.get((rows, speculating), (0.0, 0.0))
        return tokens / seconds if seconds else None

    def _speculate(self, rows: int, drafting: int, model_says: bool) -> bool:
        left, side = self.explore
        if left:
            self.explore = (left - 1, side)
            return side
        plain, spec = self.measured(rows, False), self.measured(rows, True)
        margin = 1.0 if self.previous_gamma else SWITCH_ON
        implied = self.implied(rows)
        if plain is not None and spec is not None:
            choice = spec > margin * plain
        else:
            choice = model_says if implied is None else implied
        self._judge_run(rows, choice)
        if implied is False and not choice:
            return False  # a lower load measured plain decoding ahead: speculation is not re-measured up here
        self.streak[rows] = self.streak.get(rows, 0) + 1
        interval = self.interval.get(rows, EXPLORE_EVERY)
        if min(self.counted.get((rows, False), 0), self.counted.get((rows, True), 0)) < FEW_ROUNDS:
            # a side seen only a few times (a bad start) is not trusted long; a re-measurement costs every row a
            # draft catch-up, so the early interval grows with the rows (re-measuring every few rounds costs a share of
            # the throughput that grows with C)
            interval = min(interval, EXPLORE_SOON * rows)
        if self.streak[rows] >= interval:
            self.streak[rows] = 0
            hopeful = self.rates(rows, drafting, np.maximum(self.acceptance.alphas, OPTIMISTIC_ALPHA))
            if choice or int(np.argmax(hopeful)) > 0:
                self.explore, self.explored = (EXPLORE_RUN - 1, not choice), (rows, choice)
                return not choice
        return choice

    def settled(self, rows: int) -> bool | None:
        """Whether speculation measured ahead at `rows` rows (None until both sides have FEW_ROUNDS rounds)."""
        if min(self.counted.get((rows, False), 0), self.counted.get((rows, True), 0)) < FEW_ROUNDS:
            return None
        return self.measured(rows, True) > self.measured(rows, False)

    def implied(self, rows: int) -> bool | None:
        """What the loads measured on both sides imply at `rows` rows: speculation's gain only falls as rows are
        added (plain decoding's batched step is sublinear in the rows, verification is per row), so plain ahead
        at fewer rows implies plain here and speculation ahead at more rows implies speculation here. None where
        nothing is implied, or measurements disagree."""
        verdicts = [(load, self.settled(load)) for load in range(1, len(self.costs.target_step))]
        plain_below = any(verdict is False for load, verdict in verdicts if load < rows)
        spec_above = any(verdict is True for load, verdict in verdicts if load > rows)
        return None if plain_below == spec_above else spec_above

    def _judge_run(self, rows: int, choice: bool) -> None:
        """After a re-measurement run: explore less often where it confirmed the choice, as often as at first
        where it changed it."""
        if self.explored is None:
            return
        explored_rows, before = self.explored
        self.explored = None
        interval = self.interval.get(explored_rows, EXPLORE_EVERY)
        self.interval[explored_rows] = min(2 * interval, EXPLORE_MAX) if before == choice else EXPLORE_EVERY

    def observe_round(self, rows: int, tokens: int, seconds: float, speculated: bool | None = None) -> None:
        """A whole round of `rows` rows (planned by the latest `plan`) committed `tokens` in `seconds`. It counts
        at the rows it had, not the smoothed load the plan chose by: a burst of rows counted at the smoothed load would
        credit a single row with the batch's throughput and make plain decoding look ahead where speculation is.
        speculated: whether any row drafted (default: γ > 0); a round the engine ran at γ = 0 for every row (each
        a request's first round) is a plain round whatever γ was planned."""
        speculating = self.gamma > 0 if speculated is None else speculated
        if self.mode != Speculation.ADAPTIVE or (speculating and self.previous_gamma == 0) or seconds <= 0:
            return  # the first speculative round after plain ones pays the draft's catch-up: not counted
        key = (min(max(1, rows), len(self.costs.target_step) - 1), speculating)  # the rows it really had
        old_tokens, old_seconds = self.goodput.get(key, (0.0, 0.0))
        self.goodput[key] = (DECAY * old_tokens + tokens, DECAY * old_seconds + seconds)
        self.counted[key] = self.counted.get(key, 0) + 1

    def observe_call(self, role: Role, width: int, steps: int, seconds: float) -> None:
        """The cost of one forward call (metered: Observed): T = 1 steps of either model by width, target passes of T > 1
        per row."""
        c = self.costs
        if steps == 1:
            c.update(c.draft_step if role == Role.DRAFT else c.target_step, width, seconds)
        elif role == Role.TARGET:
            c.update(c.verify, steps, seconds / width)
        elif steps == 2:
            c.update(c.draft_pass, 2, seconds / width)

    def observe(self, record) -> None:
        """Learn per-position acceptance from the model-drafted rows of a Round record."""
        for row in record.rows:
            if row is not None and row.from_model:
                self.acceptance.observe_row(row.proposed, row.accepted)

    def observe_host(self, seconds: float, rows: int) -> None:
        """Round wall time outside the draft and verify calls, over `rows` rows."""
        if rows:
            self.costs.host_row += EMA * (max(seconds, 0.0) / rows - self.costs.host_row)
