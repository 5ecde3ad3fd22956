"""Drafters propose up to `limits[b]` tokens per row. Every drafter is exact: a model drafter returns its warped
distributions q; prompt lookup returns point masses (q = None). Which drafter a `drafter=` name builds is
specdec.runtime.config.DRAFTER_KINDS: adding a drafter is its class here and one entry there."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from specdec.runtime.adaptive_gamma import cumulative_from_conditional
from specdec.runtime.backend import unwrapped
from specdec.runtime.config import DrafterName
from specdec.runtime.forward import Output
from specdec.runtime.sampling import gumbel_choice, sample, warp
from specdec.runtime.state import Row, feed_chunks, forward_rows


@dataclass
class Proposal:
    tokens: np.ndarray  # [k] int64
    q: np.ndarray | None  # [k, V] warped draft probabilities, or None for point masses (and greedy)
    source: DrafterName  # the drafter that proposed them (NONE: none did)
    strong: bool = False  # a lookup that matched the longest n-gram and filled the whole limit


EMPTY = Proposal(np.zeros(0, dtype=np.int64), None, DrafterName.NONE)


def lookup(tokens: list, limit: int, max_ngram: int, min_ngram: int = 1) -> np.ndarray:
    """Prompt lookup: the tokens that followed the latest earlier match of the context's last n-gram that has
    `limit` tokens after it (else the earliest match), trying the longest n-gram first (max_ngram down to
    min_ngram)."""
    return lookup_match(tokens, limit, max_ngram, min_ngram)[0]


def lookup_match(tokens: list, limit: int, max_ngram: int, min_ngram: int = 1) -> tuple[np.ndarray, int]:
    """(proposed tokens, size of the n-gram that matched; 0 when nothing did)."""
    if limit <= 0 or len(tokens) < 2:
        return EMPTY.tokens, 0
    context = np.asarray(tokens, dtype=np.int64)
    for size in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        pattern = context[-size:]
        windows = np.lib.stride_tricks.sliding_window_view(context[:-1], size)  # [N-size, size]
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            # the latest match whose continuation fills the limit; else the one with the longest continuation
            # (in a repetitive run the latest match sits right before the end and leaves one token)
            full = hits[hits + size + limit <= len(context)]
            start = int(full[-1] if full.size else hits[0]) + size
            found = context[start : start + limit]
            if found.size:
                return found, size
    return EMPTY.tokens, 0


class PromptLookupDrafter:
    """n-gram match in the context; no model, no cost."""

    name = DrafterName.PROMPT_LOOKUP

    def propose(self, rows: list, limits: list) -> list:
        return [self._one(row, lim) if lim > 0 else EMPTY for row, lim in zip(rows, limits)]

    @staticmethod
    def _one(row: Row, limit: int) -> Proposal:
        longest = row.config.lookup_ngram
        found, size = lookup_match(row.tokens, limit, longest, row.config.lookup_min_ngram)
        return Proposal(found, None, DrafterName.PROMPT_LOOKUP, strong=size == longest and found.size == limit)


class ModelDrafter:
    """Autoregressive drafts from the bundle's draft model (a static-KV backend), each row with its own options.

    A draft that takes the target's KV (kv_source) holds the target's KV at every committed position, including
    those of drafts it computed itself and the target then accepted: it copies them again before drafting. So its
    state depends only on the row's tokens, never on whether the row was interrupted and prefilled again (another
    request used the models meanwhile), and a seeded request drafts the same tokens on every path."""

    name = DrafterName.MODEL

    def __init__(self, backend, chunk: int, step_timer=None, kv_source=None):
        self.backend = backend
        self.chunk = chunk
        self.step_timer = step_timer  # told the seconds of every one-token draft step (or None)
        # the target, where the draft may copy its committed KV instead of computing its own (takes_kv_from)
        self.kv_source = kv_source if kv_source is not None and backend.takes_kv_from(kv_source) else None

    @staticmethod
    def _choose(logits: np.ndarray, row: Row, step: int):
        # logits: [V] of the draft's `step`-th proposal -> (token, q or None)
        if row.config.greedy:
            return int(np.argmax(logits)), None
        q = warp(logits, row.config)
        if row.config.gumbel:  # the draft's guess at the target's coupled sample: a point proposal
            return gumbel_choice(q, row.noise(row.generated + step, len(logits))), None
        return sample(q, row.rng), q

    def propose(self, rows: list, limits: list) -> list:
        wanted = [row.active and lim > 0 for row, lim in zip(rows, limits)]
        if not any(wanted):
            return [EMPTY] * len(rows)
        if self.kv_source is not None:  # the prompt and accepted tokens: copied from the target's committed KV
            for row, w in zip(rows, wanted):
                start = min(row.draft_len, row.kv_copied)
                if w and start < row.target_len:
                    self.backend.copy_kv(self.kv_source, row.slot, start, row.target_len)
                    row.draft_len = row.kv_copied = row.target_len
        # catch the draft up on what it has not seen (the last round's bonus token, lookup rounds' tokens)
        pending = [row.tokens[row.draft_len :] if w else None for row, w in zip(rows, wanted)]
        logits = feed_chunks(self.backend, rows, pending, [row.draft_len for row in rows], self.chunk)  # [V] per row
        for row, w in zip(rows, wanted):
            if w:
                row.draft_len = len(row.tokens)
        drafts, dists = [[] for _ in rows], [[] for _ in rows]
        for step in range(max(limits)):
            for b, row in enumerate(rows):
                if wanted[b] and step < limits[b]:
                    token, q = self._choose(logits[b], row, step)
                    drafts[b].append(token)
                    dists[b].append(q)
            feeding = [wanted[b] and step + 1 < limits[b] for b in range(len(rows))]
            if not any(feeding):
                break
            logits = None  # released first: a device backend copies logits still held at its next forward
            if step == 0 and self._chain(rows, drafts, feeding, limits):
                break
            logits = self._step(rows, drafts, feeding)
        return [self._proposal(row, d, q) if w else EMPTY for row, d, q, w in zip(rows, drafts, dists, wanted)]

    def _step(self, rows: list, drafts: list, feeding: list) -> list:
        seqs = [[drafts[b][-1]] if feeding[b] else None for b in range(len(rows))]
        started = time.perf_counter()
        logits = forward_rows(self.backend, rows, seqs, [row.draft_len for row in rows], last_only=True)
        if self.step_timer is not None:
            self.step_timer(time.perf_counter() - started)
        for b, row in enumerate(rows):
            if feeding[b]:
                row.draft_len += 1
        return [None if out is None else out[-1] for out in logits]

    def _chain(self, rows: list, drafts: list, feeding: list, limits: list) -> bool:
        """Every fed row's remaining greedy drafts in one call, where the backend chains one-token steps on its device
        (the cuda backend: one graph, no round trip a step); False where it cannot, and the steps go one by one."""
        backend = unwrapped(self.backend)
        fed = [b for b, f in enumerate(feeding) if f]
        steps = max(limits[b] for b in fed) - 1
        if Output.GREEDY_CHAIN not in backend.capabilities or not all(rows[b].config.greedy for b in fed) \
                or not backend.chains(len(fed), steps) \
                or any(rows[b].draft_len + steps > backend.max_seq_len for b in fed):
            return False
        started = time.perf_counter()
        chosen = self.backend.propose_greedy(  # [fed, steps]; a row drafting fewer ignores the rest
            np.asarray([drafts[b][-1] for b in fed], np.int64), np.asarray([rows[b].draft_len for b in fed], np.int64),
            np.asarray([rows[b].slot for b in fed], np.int64), steps)
        if self.step_timer is not None:
            for _ in range(steps):
                self.step_timer((time.perf_counter() - started) / steps)
        for i, b in enumerate(fed):
            drafts[b].extend(chosen[i, : limits[b] - 1].tolist())
            rows[b].draft_len += limits[b] - 1
        return True

    @staticmethod
    def _proposal(row: Row, drafts: list, dists: list) -> Proposal:
        q = None if row.config.greedy or row.config.gumbel else np.stack(dists)
        return Proposal(np.asarray(drafts, dtype=np.int64), q, DrafterName.MODEL)


def _median(values) -> float:
    """The median of a few numbers (a gate's recent passes), without numpy's overhead."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    return (ordered[middle] + ordered[~middle]) / 2


class ModelGate:
    """Decides from acceptance, cost ratio c and verify cost r whether model drafts beat plain decoding.

    Acceptance is counted by position: α_j, how often draft j was accepted where drafts 1..j−1 were (each position's
    prior the overall α). A round of γ drafts then emits 1 + A_1 + ... + A_γ tokens (A_j = α_1···α_j). Acceptances
    come in runs (easy stretches take every draft), so this is more than the paper's constant-α formula gives, and
    a gate on that formula declines rounds where the model pays (benchmarks/lockstep.py shows both: the tokens a
    round emitted against the formula's, and how often the gate drafted; docs/choices.md).

    Two kinds (docs/generation.md): a *measured* gate lives as long as its generator and learns α, c (the draft's time
    per one-token step over the target's time per verify pass, both from rounds that drafted with the model) and
    r (the median of the target's last TIMES such verify passes over the median of its last TIMES one-token passes,
    from rounds where no row drafted) on this machine; greedy requests share it, since their output does not depend
    on it. Until it has timed `plain_probes` one-token passes, it declines the model for a round now and then to time
    one (at most `plain_probes` * probe_every declines): where the target's verify pass costs much more than its step
    (the native backend's compute-bound verify), the model may not pay even at a high α. It gates lookups too
    (lookup_pays), by what they emitted per second of verify. A *fixed* gate serves one
    sampled request: c is fixed bundle data (the γ calibration's, or a default), r is 1 and α comes from that
    request alone, so the same seed gives the same tokens whatever ran before.
    """

    TIMES = 64  # passes of each kind r is the ratio of medians of
    MIN_PASSES = 3  # verify passes of a γ before its own r is read from them
    PROBE_BOUND = 16  # a model that could not pay at any acceptance is probed this many times more rarely

    def __init__(self, cost_ratio: float | None = None, warmup_rounds: int = 4, prior_alpha: float = 0.7,
                 prior_weight: float = 4.0, probe_every: int = 16, plain_probes: int = 4):
        self.fixed_cost = cost_ratio
        self.warmup_rounds = warmup_rounds
        self.probe_every = probe_every  # while the model does not pay, still try it every n-th round
        self.plain_probes = plain_probes
        self.refusals = self.plain_declines = 0
        self.prior = (prior_alpha * prior_weight, prior_weight)
        self.rounds = self.proposed = self.accepted = 0
        self.tries, self.passes = [], []  # per draft position j: rows that reached it with 1..j-1 accepted; took it
        self.verify_s = self.step_s = 0.0
        self.steps = self.plain_steps = 0
        # r from medians of recent passes of each kind: the fastest of each would compare the fastest of hundreds of
        # verify passes with the fastest of a few one-token ones, and so judge the verify pass cheaper than it is
        self.verify_times, self.plain_times = deque(maxlen=self.TIMES), deque(maxlen=self.TIMES)
        self.verify_by_gamma = {}  # γ (the most drafts a row of the pass had) -> its recent verify passes' seconds
        self._ratios = {}  # γ -> verify_ratio_at(γ) until the next pass is timed (a round asks for it several times)
        # per kind of lookup (strong or weak): (tokens a row emitted, seconds of the pass) of recent lookup rounds
        self.lookups = {strong: deque(maxlen=self.TIMES) for strong in (True, False)}
        self.lookup_refusals = {True: 0, False: 0}

    def observe(self, proposed: int, accepted: int, verify_s: float, runs=None) -> None:
        """A verify pass that checked model drafts: `proposed` and `accepted` over its rows, and per row
        (proposed, accepted) in `runs` (default: one row)."""
        self.rounds += 1
        self.proposed += proposed
        self.accepted += accepted
        self.verify_s += verify_s
        self.verify_times.append(verify_s)
        self._ratios.clear()
        runs = runs if runs is not None else [(proposed, accepted)]
        width = max((row_proposed for row_proposed, _ in runs), default=0)
        if width:
            self.verify_by_gamma.setdefault(width, deque(maxlen=self.TIMES)).append(verify_s)
        for row_proposed, row_accepted in runs:
            while len(self.tries) < row_proposed:
                self.tries.append(0)
                self.passes.append(0)
            for j in range(min(row_proposed, row_accepted + 1)):  # position j + 1, reached with j accepted
                self.tries[j] += 1
                self.passes[j] += j < row_accepted

    def observe_draft_step(self, seconds: float) -> None:
        self.step_s += seconds
        self.steps += 1

    def observe_plain(self, seconds: float) -> None:
        """A round in which the target verified no drafts: one token per row."""
        self.plain_times.append(seconds)
        self.plain_steps += 1
        self._ratios.clear()

    def observe_lookup(self, strong: bool, emitted: float, verify_s: float) -> None:
        """A verify pass that checked lookups alone: each row of this gate that looked one up emitted `emitted` tokens
        (mean), its lookup strong or weak."""
        self.lookups[strong].append((emitted, verify_s))

    def lookup_pays(self, strong: bool) -> bool:
        """Whether to verify a lookup of this kind this round: its recent rounds emitted more tokens per second of
        their verify passes than one-token passes do (a verify pass costs about r one-token passes: where r is large,
        a lookup right half the time loses); until warmup_rounds of them and a one-token pass are timed, and for a
        fixed gate, yes; declined ones are still tried every probe_every-th time."""
        seen = self.lookups[strong]
        if self.fixed_cost is not None or len(seen) < self.warmup_rounds or not self.plain_times:
            return True
        tokens, seconds = (sum(column) for column in zip(*seen))
        if tokens / seconds * _median(self.plain_times) > 1.0:
            return True
        self.lookup_refusals[strong] += 1
        return self.lookup_refusals[strong] % self.probe_every == 0

    def lookup_kinds(self) -> set:
        """The kinds of lookup (strong: True, weak: False) worth verifying this round (lookup_pays of each)."""
        return {strong for strong in (True, False) if self.lookup_pays(strong)}

    @property
    def alpha(self) -> float:
        return (self.accepted + self.prior[0]) / (self.proposed + self.prior[1])

    def _conditional(self, gamma: int) -> list:
        """[α_1..α_γ] from the per-position counts, each position's prior the overall α."""
        alpha, weight = self.alpha, self.prior[1]
        return [(self.passes[j] + alpha * weight) / (self.tries[j] + weight) if j < len(self.tries) else alpha
                for j in range(gamma)]

    def cumulative(self, gamma: int) -> np.ndarray:
        """[A_1..A_γ] from the per-position counts, each position's prior the overall α."""
        return cumulative_from_conditional(self._conditional(gamma))

    @property
    def cost_ratio(self) -> float:
        if self.fixed_cost is not None:
            return self.fixed_cost
        if not self.steps or not self.verify_s:
            return 0.0
        return (self.step_s / self.steps) / (self.verify_s / self.rounds)

    @property
    def verify_ratio(self) -> float:
        """r: the median of the target's recent model-round verify passes over the median of its recent one-token
        passes (a median shrugs off a pass the machine slowed, and both come from as many passes or fewer); 1 until
        both are timed, and for a fixed gate."""
        if self.fixed_cost is not None or not self.plain_times or not self.verify_times:
            return 1.0
        plain = _median(self.plain_times)
        return _median(self.verify_times) / plain if plain > 0 else 1.0

    def verify_ratio_at(self, gamma: int) -> float:
        """r of a round of γ drafts: the median of the recent verify passes of rounds of γ drafts over the median of
        the recent one-token passes, where MIN_PASSES of them are timed; else scaled from the nearest γ timed so (a
        verify pass costs one step plus a share per token it checks: compute-bound on a CPU, it grows with γ);
        verify_ratio where no γ has enough passes yet. 1 for a fixed gate. Kept until the next pass is timed."""
        if self.fixed_cost is not None or not self.plain_times:
            return 1.0
        ratio = self._ratios.get(gamma)
        if ratio is None:
            ratio = self._ratios[gamma] = self._verify_ratio_at(gamma)
        return ratio

    def _verify_ratio_at(self, gamma: int) -> float:
        plain = _median(self.plain_times)
        timed = {g: times for g, times in self.verify_by_gamma.items() if len(times) >= self.MIN_PASSES}
        if plain <= 0 or not timed:
            return self.verify_ratio
        if gamma in timed:
            return _median(timed[gamma]) / plain
        near = min(timed, key=lambda g: (abs(g - gamma), -len(timed[g]), g))
        return 1.0 + max(_median(timed[near]) / plain - 1.0, 0.0) * gamma / near

    def _speedup(self, gamma: int, every: bool = False) -> float:
        """speedup_table(...)[-1] / r for a round of γ drafts (every: as if every draft were accepted), r that of γ
        drafts, in plain Python: the gate decides every round, where numpy's overhead on arrays of γ values would cost
        more than the arithmetic."""
        tokens, run = 1.0, 1.0
        for alpha in ([1.0] * gamma if every else self._conditional(gamma)):
            run *= min(max(alpha, 0.0), 1.0)  # A_j, as cumulative_from_conditional clips
            tokens += run
        return tokens / (gamma * self.cost_ratio + 1.0) / self.verify_ratio_at(gamma)

    def best_gamma(self, limit: int) -> int:
        """The γ of 1..limit it expects the most of (the fewest drafts of equals): `limit` while it warms up and for
        a fixed gate (a sampled request drafts the γ it asked for)."""
        if self.warming or self.fixed_cost is not None or limit <= 1:
            return limit
        return max(range(1, limit + 1), key=lambda g: (self._speedup(g), -g))

    @property
    def warming(self) -> bool:
        """Whether it still drafts every round to learn: fewer than warmup_rounds rounds, or no draft step timed."""
        return self.rounds < self.warmup_rounds or (self.fixed_cost is None and not self.steps)

    def expected(self, gamma: int) -> float:
        """The speedup over plain steps it expects of a round of γ drafts (tokens per round over its cost in steps)."""
        return self._speedup(gamma)

    def pays(self, gamma: int) -> bool:
        """Whether to draft with the model this round (the expected gain, or a periodic probe)."""
        if self.warming:
            return True
        if self.fixed_cost is None and self.plain_steps < self.plain_probes:
            self.plain_declines += 1  # time a one-token pass now and then, until plain_probes of them
            if self.plain_declines <= self.plain_probes * self.probe_every and self.plain_declines % 4 == 1:
                return False
        if self._speedup(gamma) > 1.0:
            return True
        self.refusals += 1
        # a probe learns α; where even every draft accepted would not pay (the draft too costly, the verify pass too
        # long), α cannot change the answer, and a probe is a round lost: then one in PROBE_BOUND times as many
        hopeless = self._speedup(gamma, every=True) <= 1.0
        return self.refusals % (self.probe_every * (self.PROBE_BOUND if hopeless else 1)) == 0


class ChainDrafter:
    """`auto`: prompt lookup where the context offers a match; elsewhere the model or the draft head (where the bundle
    has one and its target returns the head's features), whichever its gate expects to gain more, and only where it
    pays."""

    name = DrafterName.AUTO

    def __init__(self, lookup_drafter: PromptLookupDrafter, model: ModelDrafter | None, head=None):
        self.lookup = lookup_drafter
        self.model = model
        self.head = head  # a HeadDrafter, which reads the hidden states of the rows auto weighs it for

    def feature_tap(self, row):
        """The drafter `row`'s hidden states go to (the head's, where it weighs the head for the row), or None."""
        return None if self.head is None else self.head.feature_tap(row)

    def _pick(self, row, limit: int) -> tuple:
        """(the drafter of a row's round: the model, the head or None; its drafts): each gate that says it pays at the
        γ of up to `limit` it expects the most of is a candidate; one still learning first (the head before the
        model), at `limit`, else the one expecting the larger speedup. (A cheap head that is right less often gains
        most from one draft a round, a costly model that is right often from several.)"""
        picked, best, drafts = None, 0.0, 0
        for drafter, gate in ((self.head, row.head_gate), (self.model, row.gate)):
            if drafter is None or gate is None or (drafter is self.head and not drafter.ready(row)):
                continue
            gamma = gate.best_gamma(limit)
            if gate.pays(gamma):
                score = float("inf") if gate.warming else gate.expected(gamma)
                if picked is None or score > best:
                    picked, best, drafts = drafter, score, gamma
        return picked, drafts

    def propose(self, rows: list, limits: list) -> list:
        # a strong lookup (longest n-gram, full length) costs nothing to find and is usually right: it goes first
        # where lookups of its kind pay; elsewhere the model or the head drafts where the row's gate says it pays, and
        # weak lookups fill in where neither does (and where they pay)
        kinds = [None if row.gate is None else row.gate.lookup_kinds() for row in rows]  # worth verifying here
        found = self.lookup.propose(rows, [lim if k is None or k else 0 for lim, k in zip(limits, kinds)])  # (no
        # search where no kind is)
        proposals = [p if k is None or p.strong in k else EMPTY for p, k in zip(found, kinds)]
        if self.model is None and self.head is None:
            return proposals
        picks = [self._pick(row, lim) if lim and not p.strong else (None, 0)
                 for row, p, lim in zip(rows, proposals, limits)]
        for drafter in (self.model, self.head):
            need = [drafts if pick is drafter and drafter is not None else 0 for pick, drafts in picks]
            if any(need):
                drafted = drafter.propose(rows, need)
                proposals = [d if n else p for p, d, n in zip(proposals, drafted, need)]
        return proposals
