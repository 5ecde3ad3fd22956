"""Prompt workers: the server renders chat templates and tokenizes long prompts in processes of its own, on a budget.

A chat template is data from a bundle, rendered in jinja2's sandbox, and the sandbox blocks code, not work: a
template can build a string of many GB or loop for ever. And the tokenizer holds the GIL while it tokenizes (a
900 KB prompt: about half a second in which no stream of the server moves). So both run in a small pool of worker
processes, each request under a budget: `timeout_s` of wall time (past it the worker is killed and a new one
started), `memory_mb` of data memory (RLIMIT_DATA: an allocation past it fails in the worker, never in the server),
and as output no more characters than S tokens can hold. A request that exceeds it gets an error; the server, its
plain completions and its streams go on. Short text prompts are tokenized in the server (a worker's round trip
costs more than they do); a text too long for S by its byte count never reaches a tokenizer (RequestLayer).
"""
from __future__ import annotations

import asyncio
import enum
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from multiprocessing.connection import Connection

from specdec.errors import ConfigError, ManifestError, SpecDecError

INLINE_CHARS = 8192  # text prompts up to this many characters are tokenized in the server (a few ms at most)
START_TIMEOUT_S = 60.0  # a worker that has not opened the tokenizer by then failed to start
STOP_TIMEOUT_S = 2.0  # a worker asked to stop that has not ended by then is killed


class Op(enum.Enum):
    """What a worker is asked to do (the pipe carries members: they pickle as themselves)."""
    CHAT = "chat"  # render a conversation and tokenize it
    TEXT = "text"  # tokenize a text


class Reply(enum.Enum):
    READY = "ready"  # the worker opened the tokenizer
    FAILED = "failed"  # ... it could not
    OK = "ok"
    ERROR = "error"


class Failure(enum.Enum):
    """Why a worker's request failed."""
    LIMIT = "limit"  # the rendering grew past its bound of characters
    REFUSED = "refused"  # the template refused the conversation, or failed on it
    UNSAFE = "unsafe"  # the sandbox refused the template
    MEMORY = "memory"  # the worker's data memory ran out


class PromptBudgetError(SpecDecError):
    """A prompt's rendering or tokenization broke the workers' budget (time, memory), or its worker died."""


class PromptWorkersBusy(SpecDecError):
    """Every prompt worker is busy and the line of requests waiting for one is full."""


@dataclass(frozen=True)
class PromptBudget:
    workers: int = 2  # processes
    timeout_s: float = 2.0  # wall time of one rendering plus tokenization
    memory_mb: int = 1024  # data memory of one worker (its tokenizer included, ~100 MB for a 50k vocabulary)
    max_waiting: int = 64  # requests waiting for a worker; one more is refused


def _work(conn, root: str, memory_bytes: int) -> None:
    """A worker process: open the bundle's tokenizer and chat template, then answer requests until the pipe closes.
    Requests: (Op.CHAT, messages, max_chars) -> ids of the rendered conversation; (Op.TEXT, text, None) -> ids.
    Replies: (Reply.OK, ids) or (Reply.ERROR, Failure, detail)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the server stops us
    threading.Thread(target=_orphan_watch, args=(os.getppid(),), daemon=True).start()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from specdec.chat_template import RenderLimitError
    from specdec.runtime.text import TextCodec

    try:
        codec = TextCodec(Path(root)).open()
        resource.setrlimit(resource.RLIMIT_DATA, (memory_bytes, memory_bytes))
    except (SpecDecError, OSError, ValueError) as exc:
        conn.send((Reply.FAILED, str(exc)))
        return
    conn.send((Reply.READY, None))
    while True:
        try:
            op, payload, max_chars = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if op is Op.CHAT:
                text = codec.render_chat(payload, max_chars)
                if max_chars is not None and len(text.encode("utf-8", "surrogatepass")) > max_chars:
                    raise RenderLimitError(max_chars)
                reply = (Reply.OK, codec.encode(text, special=False))
            else:
                reply = (Reply.OK, codec.encode(payload))
        except MemoryError:
            reply = (Reply.ERROR, Failure.MEMORY, None)
        except RenderLimitError as exc:
            reply = (Reply.ERROR, Failure.LIMIT, exc.limit)
        except ManifestError as exc:
            reply = (Reply.ERROR, Failure.UNSAFE, exc.message)
        except ConfigError as exc:
            reply = (Reply.ERROR, Failure.REFUSED, exc.message)
        del payload
        try:
            conn.send(reply)
        except MemoryError:
            conn.send((Reply.ERROR, Failure.MEMORY, None))


def _orphan_watch(parent: int) -> None:
    """End the worker, mid-render or not, once the server that started it is gone (killed, so it could not)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


class _Worker:
    """One worker: `python -m specdec.serving.prompts FD ROOT BYTES`, a socket of a socketpair as its pipe (a plain
    subprocess, so nothing of the server's process, its main module included, is imported or inherited)."""

    def __init__(self, root: Path, memory_bytes: int):
        ours, theirs = socket.socketpair()
        for end in (ours, theirs):  # a default socket timeout (set by some library) would make them non-blocking
            end.setblocking(True)
        command = [sys.executable, "-m", "specdec.serving.prompts", str(theirs.fileno()), str(root), str(memory_bytes)]
        try:
            self.process = subprocess.Popen(command, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())

    def ready(self) -> None:
        """Wait for the worker to open the tokenizer; PromptBudgetError (and the worker stopped) where it cannot."""
        if not self.conn.poll(START_TIMEOUT_S):
            self.stop()
            raise PromptBudgetError(f"a prompt worker did not start within {START_TIMEOUT_S:.0f} s",
                                    "check the machine's load and memory")
        try:
            state, detail = self.conn.recv()
        except (EOFError, OSError):
            state, detail = Reply.FAILED, f"it exited with code {self.process.poll()}"
        if state is not Reply.READY:
            self.stop()
            raise PromptBudgetError(f"a prompt worker failed to start: {detail}",
                                    "raise --prompt-worker-memory, or check the bundle's tokenizer files")

    def stop(self) -> None:
        self.conn.close()
        try:
            self.process.wait(STOP_TIMEOUT_S)  # it ends once its pipe closes, unless it is still working
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class PromptPool:
    """The prompt workers of one server: `await chat_ids(...)` / `await text_ids(...)`, each under the budget.
    Created and used on the server's event loop; `await start()` returns once every worker has opened the tokenizer,
    and a worker killed past its budget is replaced in the background."""

    def __init__(self, root: Path, budget: PromptBudget = PromptBudget()):
        self.root, self.budget = Path(root), budget
        self._idle: asyncio.Queue | None = None
        self._alive = 0  # workers started and not stopped
        self._waiting = 0
        self._closed = False
        self._lock = threading.Lock()
        self._all: set = set()

    async def start(self) -> "PromptPool":
        """Start the workers and wait until each has opened the tokenizer (a server answers once they have)."""
        self._idle = asyncio.Queue()
        started = await asyncio.gather(*(asyncio.to_thread(self._spawn) for _ in range(self.budget.workers)),
                                       return_exceptions=True)
        failed = [error for error in started if isinstance(error, BaseException)]
        for worker in started:
            if not isinstance(worker, BaseException):
                self._alive += 1
                self._idle.put_nowait(worker)
        if failed:
            self.close()
            raise failed[0]
        return self

    def _spawn(self) -> _Worker:
        worker = _Worker(self.root, self.budget.memory_mb << 20)
        with self._lock:
            closed = self._closed
            if not closed:
                self._all.add(worker)
        if closed:  # close() ran while it started: it has no claim on this one
            worker.process.kill()
            worker.stop()
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

    async def chat_ids(self, messages: list, max_chars: int | None) -> list:
        """Ids of a conversation rendered by the bundle's template (the assistant's turn opened), at most
        `max_chars` characters. Raises RenderLimitError or ConfigError (the template's refusal) as rendering
        in the server would, ManifestError for an unsafe template, PromptBudgetError past the budget."""
        return await self._ask((Op.CHAT, messages, max_chars))

    async def text_ids(self, text: str) -> list:
        return await self._ask((Op.TEXT, text, None))

    async def _ask(self, request: tuple) -> list:
        from specdec.chat_template import RenderLimitError, TemplateRefusal

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
        if reply[0] is Reply.OK:
            return reply[1]
        kind, detail = reply[1], reply[2]
        if kind is Failure.LIMIT:
            raise RenderLimitError(detail)
        if kind is Failure.REFUSED:
            raise TemplateRefusal(detail)
        if kind is Failure.UNSAFE:
            raise ManifestError(detail)
        raise PromptBudgetError(f"the prompt needed more than the prompt workers' {self.budget.memory_mb} MB",
                                "the chat template builds too much text, or raise --prompt-worker-memory")

    async def _in_thread(self, worker: _Worker, request: tuple) -> tuple:
        """_exchange on a daemon thread of its own: a blocking pipe is what the worker's budget needs (an event loop
        such as uvloop makes a pipe it watches non-blocking), and a daemon thread never holds up the process's exit
        (an executor's threads are joined at exit, and one waiting on a worker would wait out its timeout)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle(outcome):
            if not done.done():
                done.set_result(outcome)

        def run():
            try:
                outcome = (True, self._exchange(worker, request))
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

    def _exchange(self, worker: _Worker, request: tuple) -> tuple:
        """Send a request and wait for its reply (blocking), at most the budget's seconds."""
        try:
            worker.conn.send(request)
            if not worker.conn.poll(self.budget.timeout_s):
                raise PromptBudgetError(f"the prompt took more than the prompt workers' {self.budget.timeout_s:g} s "
                                        "to render and tokenize", "the chat template does too much work, or raise "
                                        "--prompt-timeout")
            return worker.conn.recv()
        except (EOFError, OSError):
            raise PromptBudgetError(f"a prompt worker died (exit code {worker.process.poll()})",
                                    "check the machine's memory; the chat template may build too much text") from None

    def _retire(self, worker: _Worker) -> None:
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

        def started(worker: _Worker | None) -> None:
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


if __name__ == "__main__":  # a worker, started by _Worker: its replies pickle this package module's enums
    from specdec.serving.prompts import _work as work  # (not __main__'s copies, which the server cannot unpickle)

    work(Connection(int(sys.argv[1])), sys.argv[2], int(sys.argv[3]))
