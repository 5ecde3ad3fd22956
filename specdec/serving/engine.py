"""The engine: one thread owns the backends and runs rounds over the running batch (continuous batching).

HTTP handlers call `submit` (which only enqueues) and await the `Ticket`'s events; the engine thread admits
waiting requests at round boundaries while KV slots are free (each joiner is prefilled alone, on its own slot),
runs one speculative round over every active row, delivers text deltas and finish events, and frees the slots of
rows that finished or whose client went away. γ per round comes from `GoodputGamma`.

Exactness: greedy rows' output does not depend on γ or on their batch-mates. A seeded sampled request keeps the γ
policy and the `auto` gate it would have offline (`Generator.default_policy`, `Generator._gate`) and its own
random stream `row_rng(seed, 0)`, so it reproduces `Generator.generate` of the same prompt and options.
"""
from __future__ import annotations

import asyncio
import heapq
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from specdec.errors import CapacityError, ConfigError, SpecDecError
from specdec.runtime.config import GenerationConfig
from specdec.runtime.drafters import ChainDrafter, ModelDrafter, PromptLookupDrafter
from specdec.runtime.generator import Generator, load
from specdec.runtime.state import Row, row_rng
from specdec.runtime.text import StopStrings, holdback
from specdec.serving.batching import ServingLoop
from specdec.serving.goodput import GoodputGamma, Metered, measure_costs
from specdec.serving.metrics import Metrics
from specdec.serving.options import ServeOptions

log = logging.getLogger(__name__)
FINISH_REASONS = {"eos": "stop", "stop": "stop", "max_new_tokens": "length", "length": "length"}


class QueueFullError(SpecDecError):
    """Every row is busy and the waiting queue is full (HTTP 429)."""


class EngineClosedError(SpecDecError):
    """The engine is not running (HTTP 503)."""


@dataclass(frozen=True)
class Event:
    kind: str  # "text": a delta; "done": the final event; "error": the request failed (message, no details)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


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
            if event.kind != "text":
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

    @classmethod
    def from_options(cls, options: ServeOptions, metrics: Metrics | None = None) -> "Engine":
        generator = load(options.bundle, backend=options.backend, verify=options.verify_files, threads=options.threads)
        return cls(generator, options, metrics)

    # --- lifetime ------------------------------------------------------------------------------------------
    def start(self) -> "Engine":
        """Reset both backends to `max_batch` slots, measure the costs γ is chosen from, start the loop thread."""
        manifest, gen = self.gen.manifest, self.gen
        self.batch = min(self.options.max_batch or manifest.target.max_batch, manifest.target.max_batch)
        if gen.draft is not None:
            self.batch = min(self.batch, manifest.draft.max_batch)
        gen.target.reset(self.batch)
        if gen.draft is not None:
            gen.draft.reset(self.batch)
        defaults = manifest.defaults
        costs = measure_costs(gen.target.backend, gen.draft.backend if gen.draft is not None else None,
                              self.batch, defaults.gamma_max)
        record = self.gen._gamma_record  # the bundle's γ calibration (a GammaRecord), or None
        self.controller = GoodputGamma(costs, defaults.gamma_max, self.options.speculation,
                                       self.options.gamma or defaults.gamma, (record.alphas if record else None) or 0.7,
                                       gen.draft is not None,
                                       gen.draft is not None and gen.draft.takes_kv_from(gen.target))
        self.loop = ServingLoop(Metered(gen.target, "target", self.controller.observe_call), self._drafters(),
                                self.controller, defaults.max_prefill_chunk, manifest.tokenizer.eos_token_ids,
                                StopStrings(gen.codec))
        self._free = list(range(self.batch))  # a heap: joiners take the lowest free slot (fewer holes in T=1 runs)
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._thread.start()
        return self

    def _drafters(self) -> dict:
        """Every drafter kind, as Generator._drafters makes them, with the draft model's calls metered."""
        gen = self.gen
        lookup, model = PromptLookupDrafter(), None
        if gen.draft is not None:
            metered = Metered(gen.draft, "draft", self.controller.observe_call)
            model = ModelDrafter(metered, gen.manifest.defaults.max_prefill_chunk, gen.gate.observe_draft_step,
                                 kv_source=gen.target)
        drafters = {"prompt_lookup": lookup, "model": model, "auto": ChainDrafter(lookup, model)}
        return {kind: drafter for kind, drafter in drafters.items() if drafter is not None}

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
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # --- the HTTP side -------------------------------------------------------------------------------------
    def check(self, prompt_len: int, config: GenerationConfig) -> None:
        """Raise ConfigError / CapacityError for a request this engine cannot serve."""
        size = self.gen.manifest.target.max_seq_len
        if prompt_len > size:
            raise CapacityError(f"the prompt has {prompt_len} tokens; this model's context is {size}",
                                "shorten the prompt")
        if config.drafter == "model" and self.gen.draft is None:
            raise ConfigError("this model has no draft model", "use drafter 'prompt_lookup', 'auto' or 'none'")
        self.gen._gamma(config)  # gamma <= gamma_max

    def submit(self, prompt_ids: list, config: GenerationConfig, stream: bool) -> Ticket:
        """Enqueue a request (from the event loop's thread); raises QueueFullError or EngineClosedError."""
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
            if self._active:
                self._round()
        self._fail_all("the server is shutting down")

    def _wait_for_work(self) -> list | None:
        with self._cond:
            while not self._stopping and not self._pending and not self._active:
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
        slot = heapq.heappop(self._free)
        config = job.config
        job.row = Row(tokens=list(job.prompt_ids), prompt_len=len(job.prompt_ids), rng=row_rng(config.seed, 0),
                      config=config, slot=slot, gate=self.gen._gate(config))
        if not config.greedy and config.seed is not None:
            job.pinned = self.gen.default_policy(config)

    def _admit(self, job: Job) -> None:
        if job.cancelled:
            self._release(job, "cancelled")
            return
        try:
            self.loop.prefill([job.row])
        except SpecDecError as exc:
            self._release(job, "error", exc.message)
            return
        except Exception:  # noqa: BLE001 - the engine outlives a failed prefill; the request gets a clean 500
            log.exception("a prefill failed")
            self._release(job, "error", "the engine failed on this request")
            return
        self.metrics.prompt_tokens.inc(job.row.prompt_len)
        self._active.append(job)
        self.metrics.active_rows.set(len(self._active))

    def _drop_cancelled(self) -> None:
        for job in [job for job in self._active if job.cancelled]:
            self._active.remove(job)
            self._release(job, "cancelled")
        self.metrics.active_rows.set(len(self._active))

    def _plan(self) -> None:
        """γ for this round: the controller's for most rows, their own policy's for seeded sampled rows, and
        (adaptive) 0 for a row's first round, so its first token costs one step after its prefill rather than the
        draft's prefill and a verify pass."""
        free = [job.row for job in self._active if job.pinned is None and job.row.config.drafter != "none"]
        self.controller.plan(len(self._active), len(free))
        self.loop.gammas = {job.row.slot: job.pinned.gamma for job in self._active if job.pinned is not None}
        self.loop.alone = set(self.loop.gammas)
        if self.controller.mode == "adaptive":
            self.loop.gammas.update({row.slot: 0 for row in free if row.generated == 0})

    def _round(self) -> None:
        rows = [job.row for job in self._active]
        started = time.perf_counter()
        self._plan()
        try:
            record = self.loop.step(rows)
        except Exception:  # noqa: BLE001 - the engine must outlive a failed round; its rows get a clean 500
            log.exception("an engine round failed")
            for job in self._active:
                self._release(job, "error", "the engine failed on this request")
            self._active = []
            return
        stepped = time.perf_counter()
        self.controller.observe_host(stepped - started - record.draft_s - record.verify_s, len(rows))
        for job, row_round in zip(list(self._active), record.rows):
            if job.pinned is not None and row_round.source == "model":
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
                self._send_delta(job, self._text(row))
            return
        self._active.remove(job)
        text = self._text(row)
        self._send_delta(job, text)
        job.deliver(Event("done", finish_reason=FINISH_REASONS.get(row.finish, "stop"),
                          prompt_tokens=row.prompt_len, completion_tokens=row.generated))
        self._release(job, "success")

    def _text(self, row: Row) -> str:
        text = self.gen.codec.decode(row.tokens[row.prompt_len :])
        if row.finish == "stop":
            return text[: row.stop_at]
        if row.active:
            text = text[: len(text) - holdback(text, row.config.stop)]
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
                return text[:-1]
        return text

    def _send_delta(self, job: Job, text: str) -> None:
        if len(text) > len(job.shown) and text.startswith(job.shown):
            job.deliver(Event("text", text[len(job.shown) :]))
            job.shown = text

    def _release(self, job: Job, status: str, message: str = "") -> None:
        """Free the job's slot (if it had one) and count it; an error or cancel ends its event stream."""
        if job.row is not None:
            with self._cond:
                heapq.heappush(self._free, job.row.slot)
        if status == "error":
            job.deliver(Event("error", message))
        elif status == "cancelled":
            job.deliver(Event("error", "cancelled"))
        ttft = tpot = None
        if status == "success" and job.first_token_at is not None:
            ttft = job.first_token_at - job.arrived
            tokens = job.row.generated
            if tokens > 1:
                tpot = (time.perf_counter() - job.first_token_at) / (tokens - 1)
        self.metrics.observe_finish(status, ttft, tpot)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            pending, self._pending = list(self._pending), deque()
        for job in pending + self._active:
            self._release(job, "error", message)
        self._active = []
