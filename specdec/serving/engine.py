"""The engine: one thread owns the backends and runs rounds over the running batch (continuous batching).

HTTP handlers prepare a request through the engine's request layer (`Engine.requests`, the generator's: prompt ids,
the effective options with the bundle's defaults, checks), call `submit` (which only enqueues) and await the
`Ticket`'s events; the engine thread admits waiting requests at round boundaries while KV slots are free (each joiner
is prefilled alone, on its own slot), runs one speculative round over every active row, delivers text deltas and
finish events, and frees the slots of rows that finished or whose client went away. γ per round comes from
`GoodputGamma`. `drain` ends it all gracefully.

Exactness: greedy rows' output does not depend on γ or on their batch-mates. A seeded sampled request keeps the γ
policy and the `auto` gate it would have offline (`RequestLayer.own_policy`, `RequestLayer.gate_for`), its own
random stream row_rng(seed, 0), and forward calls of its own (ServingLoop.alone), so it reproduces
`Generator.generate` of the same prompt and options.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

from specdec.errors import SpecDecError
from specdec.manifest import Role
from specdec.runtime.config import DRAFTER_KINDS, DrafterName, GenerationConfig
from specdec.runtime.forward import Observed
from specdec.runtime.generator import Generator, load
from specdec.runtime.requests import RequestLayer
from specdec.runtime.state import Finish, Row
from specdec.runtime.text import StopStrings
from specdec.serving.batching import ServingLoop
from specdec.serving.goodput import GoodputGamma, measure_costs
from specdec.serving.metrics import Metrics
from specdec.serving.options import ServeOptions, Speculation

log = logging.getLogger(__name__)
FINISH_REASONS = {Finish.EOS: "stop", Finish.STOP: "stop", Finish.MAX_NEW_TOKENS: "length", Finish.LENGTH: "length"}


class QueueFullError(SpecDecError):
    """Every row is busy and the waiting queue is full (HTTP 429)."""


class EngineClosedError(SpecDecError):
    """The engine is not running (HTTP 503)."""


class EventKind(StrEnum):
    """What an Event carries to the HTTP side."""

    TEXT = "text"  # a delta
    DONE = "done"  # the final event
    ERROR = "error"  # the request failed (message, no details)


@dataclass(frozen=True)
class Event:
    kind: EventKind
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    status: int = 500  # of an error: the HTTP status it is answered with


FAILED = Event(EventKind.ERROR, "the engine failed on this request")
CANCELLED = Event(EventKind.ERROR, "cancelled", status=499)
SHUTTING_DOWN = Event(EventKind.ERROR, "the server is shutting down; retry on another replica or later", status=503)


@dataclass(eq=False)
class Job:
    """One request inside the engine."""

    prompt_ids: list
    config: GenerationConfig
    stream: bool
    deliver: object  # callable(Event), safe to call from the engine thread
    arrived: float = field(default_factory=time.perf_counter)
    row: Row | None = None
    pinned: object = None  # the request's own γ policy (seeded sampled requests)
    cancelled: bool = False
    shown: str = ""  # text already delivered (streams)
    first_token_at: float | None = None


class Ticket:
    """The HTTP side of a Job: an asyncio queue of its Events, and `cancel` for a client that went away."""

    def __init__(self, engine: "Engine", job: Job, queue: asyncio.Queue):
        self.engine = engine
        self.job = job
        self.queue = queue

    async def events(self):
        while True:
            event = await self.queue.get()
            yield event
            if event.kind != EventKind.TEXT:
                return

    def cancel(self) -> None:
        self.engine.cancel(self.job)


def _deliverer(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
    def deliver(event: Event) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, event)
        except RuntimeError:  # the event loop closed: nobody is waiting any more
            pass

    return deliver


class Engine:
    def __init__(self, generator: Generator, options: ServeOptions, metrics: Metrics | None = None):
        self.gen = generator
        self.options = options
        self.metrics = metrics or Metrics()
        self.batch = 0
        self.loop = None  # ServingLoop
        self.controller = None  # GoodputGamma
        self._pending = deque()
        self._active = []  # jobs holding a slot
        self._free = []  # free KV slots
        self._cond = threading.Condition()
        self._thread = None
        self._stopping = False
        self._drain_deadline = None  # monotonic time at which a drain ends the rows still running
        self._drained = threading.Event()

    @classmethod
    def from_options(cls, options: ServeOptions, metrics: Metrics | None = None) -> "Engine":
        generator = load(options.bundle, backend=options.backend, device=options.device, verify=options.verify_files,
                         threads=options.threads, activations=options.activations)
        try:
            generator.requests.gamma(options.gamma)  # serve --gamma against the bundle's γ_max, before any work
            generator.requests.batch(options.max_batch)  # and --max-batch against its max_batch
        except SpecDecError:
            generator.close()
            raise
        return cls(generator, options, metrics)

    # --- lifetime ------------------------------------------------------------------------------------------
    def start(self) -> "Engine":
        """Reset both backends to `max_batch` slots, measure the costs γ is chosen from, start the loop thread."""
        gen, requests = self.gen, self.gen.requests
        defaults = gen.manifest.defaults
        self.batch = requests.batch(self.options.max_batch)
        gen.target.reset(self.batch)
        if gen.draft is not None:
            gen.draft.reset(self.batch)
        costs = measure_costs(gen.target.backend, gen.draft.backend if gen.draft is not None else None,
                              self.batch, defaults.gamma_max)
        record = requests.gamma_record
        self.controller = GoodputGamma(costs, defaults.gamma_max, self.options.speculation,
                                       requests.gamma(self.options.gamma), (record.alphas if record else None) or 0.7,
                                       gen.draft is not None or gen.head is not None,  # (a head step counts as free)
                                       gen.draft is not None and gen.draft.takes_kv_from(gen.target))
        observe = self.controller.observe_call
        draft = Observed(gen.draft, functools.partial(observe, Role.DRAFT)) if gen.draft is not None else None
        self.loop = ServingLoop(Observed(gen.target, functools.partial(observe, Role.TARGET)),
                                requests.drafters(draft, gen.target), self.controller, defaults.max_prefill_chunk,
                                gen.manifest.tokenizer.eos_token_ids, StopStrings(gen.codec),
                                reuse_prefix=self.options.reuse_prefix)
        self._free = list(range(self.batch))  # joiners take the slot ServingLoop.best_slot picks (else the lowest)
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._thread.start()
        return self

    def drain(self, grace_s: float) -> None:
        """Graceful stop (SIGTERM): take no more requests and answer the waiting ones 503; let the running rows go on
        for up to `grace_s` seconds, then end the rest with a shutdown error (an SSE error event on a stream).
        Returns when no row runs any more."""
        with self._cond:
            if self._thread is None or self._drain_deadline is not None:
                return
            self._drain_deadline = time.monotonic() + grace_s
            waiting, self._pending = list(self._pending), deque()
            self.metrics.queue_depth.set(0)
            self._cond.notify_all()
        for job in waiting:
            self._release(job, "rejected", SHUTTING_DOWN)
        self._drained.wait(timeout=grace_s + 60)  # a round outlasting this would mean a stuck engine thread

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.gen.close()

    @property
    def running(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and self._drain_deadline is None)

    # --- the HTTP side -------------------------------------------------------------------------------------
    @property
    def requests(self) -> RequestLayer:
        """What the HTTP side prepares a request with before `submit`: the request layer offline generation uses
        (specdec.runtime.requests): prompt ids, chat prompts' checks, the effective options (`config`)."""
        return self.gen.requests

    def submit(self, prompt_ids: list, config: GenerationConfig, stream: bool) -> Ticket:
        """Enqueue a request (from the event loop's thread) whose prompt and options the request layer prepared and
        checked (`requests`); raises QueueFullError or EngineClosedError."""
        queue = asyncio.Queue()
        job = Job(list(prompt_ids), config, stream, _deliverer(asyncio.get_running_loop(), queue))
        with self._cond:
            if not self.running:
                raise EngineClosedError("the engine is not running", "retry later")
            if len(self._pending) >= len(self._free) + self.options.max_queue:
                raise QueueFullError(f"all {self.batch} rows are busy and {len(self._pending)} requests wait",
                                     f"retry after {self.options.retry_after_s} s")
            self._pending.append(job)
            self.metrics.queue_depth.set(len(self._pending))
            self._cond.notify()
        return Ticket(self, job, queue)

    def cancel(self, job: Job) -> None:
        with self._cond:
            job.cancelled = True
            self._cond.notify()

    # --- the engine thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            joiners = self._wait_for_work()
            if joiners is None:
                break
            for job in joiners:
                self._admit(job)
            self._drop_cancelled()
            self._end_overdue()
            if self._active:
                self._round()
        self._fail_all()

    def _wait_for_work(self) -> list | None:
        with self._cond:
            while not self._stopping and not self._pending and not self._active:
                if self._drain_deadline is not None:
                    self._drained.set()
                self._cond.wait()
            if self._stopping:
                return None
            joiners = []
            while self._pending and self._free:
                joiners.append(self._pending.popleft())
                self._free_slot_for(joiners[-1])
            self.metrics.queue_depth.set(len(self._pending))
            return joiners

    def _free_slot_for(self, job: Job) -> None:
        requests = self.gen.requests
        slot = self.loop.best_slot(self._free, job.prompt_ids)
        self._free.remove(slot)
        job.row = requests.row(job.prompt_ids, job.config, slot=slot)
        job.pinned = requests.own_policy(job.config)
        if job.pinned is None and self.options.speculation == Speculation.OFF:
            # it never drafts: no head reads its hidden states, so its prefill skips the prefix its slot holds
            job.row.drafter, job.row.head_gate = DRAFTER_KINDS[DrafterName.NONE], None

    def _admit(self, job: Job) -> None:
        if job.cancelled:
            self._release(job, "cancelled", CANCELLED)
            return
        try:
            _, first = self.loop.prefill([job.row])  # the prefill gives the row its first token
        except SpecDecError as exc:
            self._release(job, "error", Event(EventKind.ERROR, exc.message))
            return
        except Exception:  # noqa: BLE001 - the engine outlives a failed prefill; the request gets a clean 500
            log.exception("a prefill failed")
            self._release(job, "error", FAILED)
            return
        self.metrics.prompt_tokens.inc(job.row.prompt_len)
        self.metrics.prompt_tokens_reused.inc(job.row.reused)
        self._active.append(job)
        self.metrics.active_rows.set(len(self._active))
        self.metrics.generation_tokens.inc(len(first.rows[0].committed))
        self._progress(job, first.rows[0])

    def _drop_cancelled(self) -> None:
        for job in [job for job in self._active if job.cancelled]:
            self._active.remove(job)
            self._release(job, "cancelled", CANCELLED)
        self.metrics.active_rows.set(len(self._active))

    def _end_overdue(self) -> None:
        """Past a drain's grace: the rows still running end with the shutdown error."""
        if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
            for job in self._active:
                self._release(job, "error", SHUTTING_DOWN)
            self._active = []
            self.metrics.active_rows.set(0)

    def _plan(self) -> None:
        """γ for this round: the controller's for most rows, their own policy's for seeded sampled rows (a row's
        first token came from its prefill). Rows with a policy of their own also run their calls alone."""
        free = [job.row for job in self._active if job.pinned is None and job.row.drafter.drafts]
        self.controller.plan(len(self._active), len(free))
        self.loop.gammas = {job.row.slot: job.pinned.gamma for job in self._active if job.pinned is not None}
        self.loop.alone = set(self.loop.gammas)

    def _round(self) -> None:
        rows = [job.row for job in self._active]
        started = time.perf_counter()
        self._plan()
        try:
            record = self.loop.step(rows)
        except Exception:  # noqa: BLE001 - the engine must outlive a failed round; its rows get a clean 500
            log.exception("an engine round failed")
            for job in self._active:
                self._release(job, "error", FAILED)
            self._active = []
            return
        stepped = time.perf_counter()
        self.controller.observe_host(stepped - started - record.draft_s - record.verify_s, len(rows))
        for job, row_round in zip(list(self._active), record.rows):
            if job.pinned is not None and row_round.from_model:
                job.pinned.observe_row(row_round.proposed, row_round.accepted)
            self._progress(job, row_round)
        seconds = time.perf_counter() - started
        done = [r for r in record.rows if r is not None]
        self.controller.observe_round(len(rows), sum(len(r.committed) for r in done), seconds,
                                      any(r.proposed for r in done))
        self.metrics.observe_round(record, seconds)
        self.metrics.active_rows.set(len(self._active))

    def _progress(self, job: Job, row_round) -> None:
        if job.first_token_at is None and row_round.committed:
            job.first_token_at = time.perf_counter()
        row = job.row
        if row.active:
            if job.stream:
                self._send_delta(job, self.gen.requests.text(row))
            return
        self._active.remove(job)
        self._send_delta(job, self.gen.requests.text(row))
        job.deliver(Event(EventKind.DONE, finish_reason=FINISH_REASONS.get(row.finish, "stop"),
                          prompt_tokens=row.prompt_len, completion_tokens=row.generated))
        self._release(job, "success")

    def _send_delta(self, job: Job, text: str) -> None:
        if len(text) > len(job.shown) and text.startswith(job.shown):
            job.deliver(Event(EventKind.TEXT, text[len(job.shown) :]))
            job.shown = text

    def _release(self, job: Job, status: str, event: Event | None = None) -> None:
        """Free the job's slot (if it had one), end its event stream with `event` (if any) and count it under
        `status` (specdec_requests_total)."""
        if job.row is not None:
            with self._cond:
                self._free.append(job.row.slot)
        if event is not None:
            job.deliver(event)
        ttft = tpot = None
        if event is None and job.first_token_at is not None:
            ttft = job.first_token_at - job.arrived
            tokens = job.row.generated
            if tokens > 1:
                tpot = (time.perf_counter() - job.first_token_at) / (tokens - 1)
        self.metrics.observe_finish(status, ttft, tpot)

    def _fail_all(self) -> None:
        with self._cond:
            pending, self._pending = list(self._pending), deque()
        for job in pending + self._active:
            self._release(job, "error", SHUTTING_DOWN)
        self._active = []
