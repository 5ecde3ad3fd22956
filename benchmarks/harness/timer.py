"""Interleaved timing: every case takes its turn in each round, the order rotated by one per round, after a
warm-up, so a drift of the machine (a neighbour, the memory bus, the clock) falls on every case alike.
Read ratios within one run; min is the least disturbed call, median the typical one, spread their distance.

Request timing: `timed` (one call end to end), `Request` (a streamed request: time to the first piece, the gaps
after it) and `token_weighted_tpot` (time per output token after each request's first, over many requests).
`busy` runs processes that each spin on a core, for timing beside other work."""
from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def busy(count: int):
    """`count` processes that each spin on one core, killed on exit."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def rotated(items: list, shift: int) -> list:
    """`items` shifted left by `shift` (mod its length): round k starts with item k."""
    if not items:
        return []
    shift %= len(items)
    return list(items[shift:]) + list(items[:shift])


@dataclass(frozen=True)
class Spread:
    """A case's samples in seconds: n, min, median, max; spread = max / min − 1."""

    n: int
    min: float
    median: float
    max: float

    @property
    def spread(self) -> float:
        return self.max / self.min - 1.0 if self.min > 0 else float("nan")

    def ms(self, digits: int = 1) -> str:
        """'min / median' in milliseconds, the form every table prints."""
        return f"{self.min * 1e3:.{digits}f} / {self.median * 1e3:.{digits}f}"


def summarize(samples: list) -> Spread:
    if not samples:
        raise ValueError("no samples to summarize")
    return Spread(len(samples), min(samples), statistics.median(samples), max(samples))


def interleave(cases: dict, rounds: int, warmup: int = 1, calls: int = 1,
               clock: Callable[[], float] = time.perf_counter, reported: bool = False) -> dict:
    """{name: [seconds per call]} for `cases` ({name: a callable of no arguments}).

    Each case runs `warmup` times first (not recorded); then `rounds` rounds, in each every case `calls` times in
    a row, the case order rotated by one per round. `reported`: a sample is the seconds the callable returns (a time
    it measured itself, such as seconds per token after the first), not the call's wall time."""
    if rounds < 1 or warmup < 0 or calls < 1:
        raise ValueError(f"need rounds >= 1, warmup >= 0, calls >= 1; got {rounds}, {warmup}, {calls}")
    names = list(cases)
    for name in names:
        for _ in range(warmup):
            cases[name]()
    samples = {name: [] for name in names}
    for index in range(rounds):
        for name in rotated(names, index):
            for _ in range(calls):
                started = clock()
                got = cases[name]()
                samples[name].append(float(got) if reported else clock() - started)
    return samples


def compared(a: Spread, b: Spread, digits: int = 2) -> list:
    """Table cells of two cases side by side: each one's 'min / median' ms, then a / b of the minima and of the
    medians."""
    return [a.ms(digits), b.ms(digits), f"{a.min / b.min:.3f}", f"{a.median / b.median:.3f}"]


# --- request timing ------------------------------------------------------------------------------------------------

def timed(call: Callable[[], T], clock: Callable[[], float] = time.perf_counter) -> tuple[T, float]:
    """(what `call` returns, the seconds it took by `clock`): one request (or one piece of work) end to end. A clock
    that waits for a device first (torch.cuda.synchronize, then perf_counter) times the device's work too."""
    started = clock()
    got = call()
    return got, clock() - started


class Request:
    """One streamed request's clock, a context manager: entered as the request is sent, `arrived()` at each piece of
    output as it comes, left when the request ends (however it ends)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.sent = self.first = self.last = self.ended = None

    def __enter__(self) -> "Request":
        self.sent = self.clock()
        return self

    def __exit__(self, *exc) -> bool:
        self.ended = self.clock()
        return False

    def arrived(self) -> None:
        """A piece of output came now."""
        self.last = self.clock()
        if self.first is None:
            self.first = self.last

    def times(self, tokens: int) -> dict:
        """{"e2e_s", "ttft_s", "tpot_s"} of a request that made `tokens` tokens: TTFT up to the first piece (the end
        where none came), TPOT the first piece to the last over the tokens after the first (nan below two tokens)."""
        ended = self.clock() if self.ended is None else self.ended
        first = ended if self.first is None else self.first
        tpot = (self.last - self.first) / (tokens - 1) if self.first is not None and tokens > 1 else float("nan")
        return {"e2e_s": ended - self.sent, "ttft_s": first - self.sent, "tpot_s": tpot}


def token_weighted_tpot(requests: list, tokens: str = "new_tokens") -> float:
    """Seconds per output token after each request's first over `requests` (dicts with e2e_s, ttft_s and a token
    count under `tokens`): their total time after the first token over their total tokens after it; nan without
    any."""
    after = sum(r[tokens] - 1 for r in requests)
    return sum(r["e2e_s"] - r["ttft_s"] for r in requests) / after if after > 0 else float("nan")
