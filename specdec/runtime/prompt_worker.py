"""Prompt workers: chat templates rendered, and prompts tokenized, in processes of their own, each request on a budget.

A chat template is data from a bundle, rendered in jinja2's sandbox, and the sandbox blocks code, not work: a template
can build a string of many GB or loop for ever. So every rendering runs in a worker process, under a PromptBudget:
`timeout_s` of wall time (past it the worker is killed, and the next request starts a new one), `memory_mb` of data
memory (RLIMIT_DATA: an allocation past it fails in the worker, never in the caller), and no more output than the
caller's bound of bytes (what S tokens can hold). A request over the budget gets an error; the caller goes on.

A Generator renders through one worker of its own (PromptWorker, started at its first chat prompt, stopped by
close()); the server through a pool of them (specdec.serving.prompts), which tokenizes long text prompts there too
(the tokenizer holds the GIL while it works).
"""
from __future__ import annotations

import enum
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from specdec.errors import BackendError, ConfigError, ManifestError, SpecDecError
from specdec.runtime.limits import MAX_TIMEOUT_S, PER_CORE, bounded_int, bounded_seconds, cpu_count, memory_bytes

START_TIMEOUT_S = 60.0  # a worker that has not opened the tokenizer by then failed to start
STOP_TIMEOUT_S = 2.0  # a worker asked to stop that has not ended by then is killed
MAX_WAITING = 1 << 16  # requests waiting for a worker (the server's --max-queue has the same bound)
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding this specdec: the worker imports the same
# A worker's program: `-c`, not `-m` (the runtime package imports this module before -m could run it as __main__), and
# its replies pickle this module's enums, which the caller unpickles as its own
WORKER_MAIN = ("import sys; from multiprocessing.connection import Connection; "
               "from specdec.runtime.prompt_worker import work; "
               "work(Connection(int(sys.argv[1])), sys.argv[2], int(sys.argv[3]))")


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
    LIMIT = "limit"  # the rendering grew past its bound of bytes
    REFUSED = "refused"  # the template refused the conversation, or failed on it
    UNSAFE = "unsafe"  # the sandbox refused the template
    MEMORY = "memory"  # the worker's data memory ran out


class PromptBudgetError(SpecDecError):
    """A prompt's rendering or tokenization broke the workers' budget (time, memory), or its worker died."""


BUDGET_HINT = "`specdec generate|serve --prompt-timeout/--prompt-worker-memory`, or specdec.load(prompt_budget=...)"


@dataclass(frozen=True)
class PromptBudget:
    """What one prompt may cost in a worker, and (the server's pool) how many workers and waiting requests there are.
    Checked against this machine: its cores and its memory (specdec.runtime.limits)."""

    workers: int = 2  # processes (the server's pool; a Generator has one)
    timeout_s: float = 2.0  # wall time of one rendering plus tokenization
    memory_mb: int = 1024  # data memory of one worker (its tokenizer included, ~100 MB for a 50k vocabulary)
    max_waiting: int = 64  # requests waiting for a worker; one more is refused

    def __post_init__(self):
        cores, memory_mb = cpu_count(), memory_bytes() >> 20
        bounded_int("prompt workers", self.workers, 1, PER_CORE * cores, f"{PER_CORE} per core of the {cores} cores "
                    "this process may use", "pass --prompt-workers 2 (the default), or fewer")
        bounded_seconds("prompt timeout_s", self.timeout_s, MAX_TIMEOUT_S, "pass --prompt-timeout 2 (seconds), the "
                        "default, or PromptBudget(timeout_s=2)")
        bounded_int("prompt worker memory_mb", self.memory_mb, 256, memory_mb, "this machine's memory",
                    "pass --prompt-worker-memory 1024 (MB), the default, or PromptBudget(memory_mb=1024)")
        if self.workers * self.memory_mb > memory_mb:
            raise ConfigError(f"{self.workers} prompt workers of {self.memory_mb} MB could take "
                              f"{self.workers * self.memory_mb} MB, more than this machine's {memory_mb} MB",
                              "pass fewer --prompt-workers or a smaller --prompt-worker-memory")
        bounded_int("prompt max_waiting", self.max_waiting, 1, MAX_WAITING, "requests that wait for a worker",
                    "pass --max-queue 64, the default, or fewer")


def work(conn, root: str, memory_bytes: int) -> None:
    """A worker process: open the bundle's tokenizer and chat template, then answer requests until the pipe closes.
    Requests: (Op.CHAT, messages, max_bytes) -> ids of the rendered conversation; (Op.TEXT, text, None) -> ids.
    Replies: (Reply.OK, ids) or (Reply.ERROR, Failure, detail: the limit, or an error's (message, hint))."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the caller stops us
    threading.Thread(target=_orphan_watch, args=(os.getppid(),), daemon=True).start()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
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
            op, payload, max_bytes = conn.recv()
        except (EOFError, OSError):
            return
        reply = _answer(codec, op, payload, max_bytes)
        del payload
        try:
            conn.send(reply)
        except MemoryError:
            conn.send((Reply.ERROR, Failure.MEMORY, None))


def _answer(codec, op: Op, payload, max_bytes: int | None) -> tuple:
    """One request's reply, its failures as a Failure (a worker never raises them)."""
    from specdec.chat_template import RenderLimitError

    try:
        if op is Op.CHAT:
            return Reply.OK, codec.encode(codec.render_chat(payload, max_bytes), special=False)
        return Reply.OK, codec.encode(payload)
    except MemoryError:
        return Reply.ERROR, Failure.MEMORY, None
    except RenderLimitError as exc:
        return Reply.ERROR, Failure.LIMIT, exc.limit
    except ManifestError as exc:
        return Reply.ERROR, Failure.UNSAFE, (exc.message, exc.hint)
    except ConfigError as exc:
        return Reply.ERROR, Failure.REFUSED, (exc.message, exc.hint)


def _orphan_watch(parent: int) -> None:
    """End the worker, mid-render or not, once the process that started it is gone (killed, so it could not)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


SANITIZER_RUNTIMES = ("libasan", "libubsan", "liblsan", "libtsan")  # preloaded by make test-sanitize


def _without_sanitizers(preload: str) -> str:
    """LD_PRELOAD less the sanitizers' runtimes: they are there for the native kernels, which a worker never loads,
    and AddressSanitizer's shadow mappings are terabytes that the worker's RLIMIT_DATA refuses (it could not start).
    Any other preloaded library (an allocator, say) stays."""
    kept = [item for item in preload.replace(":", " ").split() if not Path(item).name.startswith(SANITIZER_RUNTIMES)]
    return " ".join(kept)


class WorkerProcess:
    """One worker: `python -c WORKER_MAIN FD ROOT BYTES`, a socket of a socketpair as its pipe (a plain subprocess, so
    nothing of the caller's process, its main module included, is imported or inherited).

    Any thread may stop it while another waits on its pipe (a server's shutdown, a request retired mid-render). The
    pipe's descriptor is closed once, by whichever of them lets go of it last: closed under a waiting thread, its
    number could be reused by a file opened meanwhile, and the waiting thread would read that file."""

    def __init__(self, root: Path, memory_bytes: int):
        ours, theirs = socket.socketpair()
        for end in (ours, theirs):  # a default socket timeout (set by some library) would make them non-blocking
            end.setblocking(True)
        command = [sys.executable, "-c", WORKER_MAIN, str(theirs.fileno()), str(root), str(memory_bytes)]
        path = os.environ.get("PYTHONPATH")
        env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT + (os.pathsep + path if path else ""))
        if "LD_PRELOAD" in env:
            env["LD_PRELOAD"] = _without_sanitizers(env["LD_PRELOAD"])
        try:
            self.process = subprocess.Popen(command, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self._lock = threading.Lock()
        self._users = 0  # threads inside _use()
        self._stopping = False

    @contextmanager
    def _use(self):
        """The pipe, held open for the block's duration; PromptBudgetError once the worker is being stopped."""
        with self._lock:
            if self._stopping:
                raise PromptBudgetError("the prompt worker was stopped", "retry the request")
            self._users += 1
        try:
            yield self.conn
        finally:
            with self._lock:
                self._users -= 1
                last = self._stopping and self._users == 0
            if last:
                self.conn.close()

    def ready(self) -> None:
        """Wait for the worker to open the tokenizer; PromptBudgetError (and the worker stopped) where it cannot."""
        with self._use() as conn:
            started = conn.poll(START_TIMEOUT_S)
            if started:
                try:
                    state, detail = conn.recv()
                except (EOFError, OSError):
                    state, detail = Reply.FAILED, f"it exited with code {self.process.poll()}"
        if not started:
            self.kill()
            raise PromptBudgetError(f"a prompt worker did not start within {START_TIMEOUT_S:.0f} s",
                                    "check the machine's load and memory")
        if state is not Reply.READY:
            self.stop()
            raise PromptBudgetError(f"a prompt worker failed to start: {detail}",
                                    "raise the prompt workers' memory (--prompt-worker-memory), or check the bundle's "
                                    "tokenizer files")

    def exchange(self, request: tuple, timeout_s: float) -> tuple:
        """Send a request and wait for its reply (blocking), at most `timeout_s`; PromptBudgetError past it or where
        the worker died (the caller then kills it: it may still be rendering)."""
        with self._use() as conn:
            try:
                conn.send(request)
                if not conn.poll(timeout_s):
                    raise PromptBudgetError(f"the prompt took more than the prompt workers' {timeout_s:g} s to render "
                                            "and tokenize", f"the chat template does too much work, or raise the "
                                            f"timeout: {BUDGET_HINT}")
                return conn.recv()
            except (EOFError, OSError):
                raise PromptBudgetError(f"a prompt worker died (exit code {self.process.poll()})",
                                        "check the machine's memory; the chat template may build too much text") \
                    from None

    def kill(self) -> None:
        """Stop the worker now, whatever it is doing."""
        self.process.kill()
        self.stop()

    def stop(self) -> None:
        """Let go of the pipe (closed now, or by the last thread still waiting on it) and wait for the worker to end;
        from any thread, any number of times. A worker still working is killed after STOP_TIMEOUT_S."""
        with self._lock:
            first = not self._stopping
            self._stopping = True
            last = first and self._users == 0
        if last:
            self.conn.close()
        try:
            self.process.wait(STOP_TIMEOUT_S)  # it ends once its pipe closes, unless it is still working
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def reply_ids(reply: tuple, budget: PromptBudget) -> list:
    """The ids of a worker's reply; its failure as the error rendering in the caller would raise: RenderLimitError
    or TemplateRefusal (ConfigErrors), ManifestError for an unsafe template, PromptBudgetError past the memory."""
    from specdec.chat_template import RenderLimitError, TemplateRefusal

    if reply[0] is Reply.OK:
        return reply[1]
    kind, detail = reply[1], reply[2]
    if kind is Failure.LIMIT:
        raise RenderLimitError(detail)
    if kind is Failure.REFUSED:
        raise TemplateRefusal(*detail)
    if kind is Failure.UNSAFE:
        raise ManifestError(*detail)
    raise PromptBudgetError(f"the prompt needed more than the prompt workers' {budget.memory_mb} MB",
                            f"the chat template builds too much text, or raise the memory: {BUDGET_HINT}")


class PromptWorker:
    """The one worker of a Generator: started at the first request, one request at a time, killed after a request
    that broke the budget (the next request starts another); close() kills it. `__init__` starts nothing."""

    def __init__(self, root: Path, budget: PromptBudget | None = None):
        self.root, self.budget = Path(root), budget or PromptBudget()
        self._worker: WorkerProcess | None = None
        self._lock = threading.Lock()
        self._closed = False

    def chat_ids(self, messages: list, max_bytes: int | None = None) -> list:
        """Ids of a conversation rendered by the bundle's chat template (the assistant's turn opened), its rendering
        at most `max_bytes` of UTF-8 (None: specdec.chat_template.RENDER_MAX_BYTES); errors as reply_ids."""
        return self._ask((Op.CHAT, messages, max_bytes))

    def _ask(self, request: tuple) -> list:
        closed = BackendError("this Generator is closed", "open the bundle again with specdec.load(...)")
        with self._lock:
            if self._closed:
                raise closed
            worker = self._worker or self._start()
            try:
                if self._closed:  # close() ran while the worker started
                    raise closed
                reply = worker.exchange(request, self.budget.timeout_s)
            except BaseException:  # timed out, died, or interrupted mid-work: the next request gets a fresh worker
                self._worker = None
                worker.kill()
                raise
        return reply_ids(reply, self.budget)

    def _start(self) -> WorkerProcess:
        worker = WorkerProcess(self.root, self.budget.memory_mb << 20)
        try:
            worker.ready()
        except BaseException:
            worker.kill()
            raise
        self._worker = worker
        return worker

    def close(self) -> None:
        """Kill the worker, mid-request or not (the request fails): a runaway template never holds up a close."""
        self._closed = True
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.kill()

