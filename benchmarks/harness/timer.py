"""Interleaved timing: every case takes its turn in each round, the order rotated by one per round, after a
warm-up, so a drift of the machine (a neighbour, the memory bus, the clock) falls on every case alike.
Read ratios within one run; min is the least disturbed call, median the typical one, spread their distance."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable


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
