"""The server's prompt workers: a pool of the budgeted worker processes of specdec.runtime.prompt_worker, which render
chat templates and tokenize long prompts off the server's process.

A chat template is data from a bundle, rendered in jinja2's sandbox, and the sandbox blocks code, not work: a
template can build a string of many GB or loop for ever. And the tokenizer holds the GIL while it tokenizes (a
900 KB prompt: about half a second in which no stream of the server moves). So both run in a small pool of worker
processes, each request under the PromptBudget (wall time, data memory, and as output no more bytes than S tokens can
hold), as the library's Generator renders in a worker of its own. A request that exceeds it gets an error; the server,
its plain completions and its streams go on. Short text prompts are tokenized in the server (a worker's round trip
costs more than they do); a text too long for S by its byte count never reaches a tokenizer (RequestLayer).
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specdec.errors import SpecDecError
from specdec.runtime.prompt_worker import (  # noqa: F401 - PromptBudget and PromptBudgetError: the server's names
    Op, PromptBudget, PromptBudgetError, WorkerProcess, reply_ids,
)

INLINE_CHARS = 8192  # text prompts up to this many characters are tokenized in the server (a few ms at most)
START_THREADS = 8  # workers started at once (each start is a process that imports the runtime and opens a tokenizer)


class PromptWorkersBusy(SpecDecError):
    """Every prompt worker is busy and the line of requests waiting for one is full."""


class PromptPool:
    """The prompt workers of one server: `await chat_ids(...)` / `await text_ids(...)`, each under the budget.
    Used on the server's event loop; `await start()` (or `open()`, before the loop runs) returns once every worker
    has opened the tokenizer, and a worker killed past its budget is replaced in the background."""

    def __init__(self, root: Path, budget: PromptBudget | None = None):
        self.root, self.budget = Path(root), budget or PromptBudget()
        self._idle: asyncio.Queue | None = None
        self._alive = 0  # workers started and not stopped
        self._waiting = 0
        self._closed = False
        self._lock = threading.Lock()
        self._all: set = set()

    async def start(self) -> "PromptPool":
        """open() on a thread, for a caller on an event loop (the app's lifespan)."""
        return await asyncio.to_thread(self.open)

    def open(self) -> "PromptPool":
        """Start the workers and wait until each has opened the tokenizer (a server answers once they have). The
        calling thread waits, so where it is the main thread a SIGTERM (Terminated) or Ctrl-C ends the wait at once;
        then, as on any failure, the workers started so far are killed and the others are not started."""
        self._idle = asyncio.Queue()  # bound to the event loop that first waits on it, not to this thread
        starter = ThreadPoolExecutor(min(START_THREADS, self.budget.workers), thread_name_prefix="specdec-prompt-start")
        try:
            for started in [starter.submit(self._spawn) for _ in range(self.budget.workers)]:
                worker = started.result()
                self._alive += 1
                self._idle.put_nowait(worker)
        except BaseException:
            self.close()
            raise
        finally:
            starter.shutdown(wait=False, cancel_futures=True)
        return self

    def _spawn(self) -> WorkerProcess:
        worker = WorkerProcess(self.root, self.budget.memory_mb << 20)
        with self._lock:
            closed = self._closed
            if not closed:
                self._all.add(worker)
        if closed:  # close() ran while it started: it has no claim on this one
            worker.kill()
            raise PromptBudgetError("the server is stopping", "retry on another replica")
        try:
            worker.ready()
        except BaseException:
            with self._lock:
                self._all.discard(worker)
            raise
        return worker

    @property
    def saturated(self) -> bool:
        """Whether a request is waiting for a worker, or none is alive (what /health reports)."""
        return self._waiting > 0 or self._alive == 0

    def state(self) -> dict:
        return {"workers": self._alive, "idle": self._idle.qsize() if self._idle is not None else 0,
                "waiting": self._waiting}

    async def chat_ids(self, messages: list, max_bytes: int | None) -> list:
        """Ids of a conversation rendered by the bundle's template (the assistant's turn opened), at most
        `max_bytes` of UTF-8. Raises RenderLimitError or ConfigError (the template's refusal) as rendering
        in the server would, ManifestError for an unsafe template, PromptBudgetError past the budget."""
        return await self._ask((Op.CHAT, messages, max_bytes))

    async def text_ids(self, text: str) -> list:
        return await self._ask((Op.TEXT, text, None))

    async def _ask(self, request: tuple) -> list:
        if self._closed:
            raise PromptBudgetError("the server is stopping", "retry on another replica")
        if self._waiting >= self.budget.max_waiting:
            raise PromptWorkersBusy(f"all {self.budget.workers} prompt workers are busy and {self._waiting} requests "
                                    "wait for one", "retry shortly")
        self._waiting += 1
        try:
            worker = await self._idle.get()
        finally:
            self._waiting -= 1
        try:
            reply = await self._in_thread(worker, request)
        except BaseException:  # timed out, died, or the request was cancelled mid-work: a fresh worker takes its place
            self._retire(worker)
            raise
        self._idle.put_nowait(worker)
        return reply_ids(reply, self.budget)

    async def _in_thread(self, worker: WorkerProcess, request: tuple) -> tuple:
        """worker.exchange on a daemon thread of its own: a blocking pipe is what the worker's budget needs (an event
        loop such as uvloop makes a pipe it watches non-blocking), and a daemon thread never holds up the process's
        exit (an executor's threads are joined at exit, and one waiting on a worker would wait out its timeout)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle(outcome):
            if not done.done():
                done.set_result(outcome)

        def run():
            try:
                outcome = (True, worker.exchange(request, self.budget.timeout_s))
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
                outcome = (False, exc)
            try:
                loop.call_soon_threadsafe(settle, outcome)
            except RuntimeError:  # the loop is closed: nobody waits for this reply
                pass

        threading.Thread(target=run, daemon=True, name="specdec-prompt").start()
        ok, value = await done
        if not ok:
            raise value
        return value

    def _retire(self, worker: WorkerProcess) -> None:
        """Stop `worker` (killing it: it may be mid-render) and start another, both off the event loop."""
        worker.process.kill()
        self._alive -= 1
        self._all.discard(worker)
        threading.Thread(target=worker.stop, daemon=True).start()
        if not self._closed:
            self._replace()

    def _replace(self) -> None:
        """Start a worker on a daemon thread (it takes a second or so); it joins the idle ones when it is ready."""
        loop = asyncio.get_running_loop()

        def started(worker: WorkerProcess | None) -> None:
            if worker is None:
                return  # no worker: saturated shows it (a worker that cannot start will not start the next time)
            if self._closed:
                threading.Thread(target=worker.stop, daemon=True).start()
                return
            self._alive += 1
            self._idle.put_nowait(worker)

        def spawn():
            try:
                worker = None if self._closed else self._spawn()
            except SpecDecError:
                worker = None
            try:
                loop.call_soon_threadsafe(started, worker)
            except RuntimeError:  # the loop is closed: the server stopped meanwhile
                if worker is not None:
                    worker.stop()

        threading.Thread(target=spawn, daemon=True, name="specdec-prompt-start").start()

    def close(self) -> None:
        """Stop every worker now, whatever it is doing (a server's shutdown must not wait for a runaway template)."""
        with self._lock:
            self._closed = True
            workers = list(self._all)
            self._all.clear()
        for worker in workers:
            worker.process.kill()
        for worker in workers:
            worker.stop()
        self._alive = 0

