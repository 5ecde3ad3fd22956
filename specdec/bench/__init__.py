"""`specdec bench`: latency of a bundle's modes on committed prompt sets, with tables (polars) and plots.

Stdlib + numpy at import; polars and matplotlib (the `[bench]` extra) are imported where they are used.
"""
from specdec.bench.config import BenchConfig, Mode
from specdec.bench.run import run_bench

__all__ = ["BenchConfig", "Mode", "run_bench"]
