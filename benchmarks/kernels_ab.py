"""One native step with two builds of kernels.c in one process: the current source against another (an older
commit's), calls interleaved, so the machine's drift falls on both alike.

    git show c572fa7:specdec/native/kernels.c > /tmp/old_kernels.c   # prefetch 512 bytes ahead, was 2048
    python benchmarks/kernels_ab.py bundles/smollm2-q41 /tmp/old_kernels.c [--role draft|target] [--calls 24]
                                    [--tokens 5]

The other source's exports must have the same signatures (build.SIGNATURES; an older source may lack some) and
read the same model_t (specdec.native.model.ModelStruct; before 7c1b1d2 it lacked the draft's paired pointers). At
cache lengths 64 / 512 / 1000 (a random prompt prefilled by the target): one-token forwards of the role, the two
builds alternating (which goes first alternates too); with --tokens T, forwards of T tokens at the lengths that leave
room for them (up to 9: a verify pass, every row scored; more: a prompt's chunk, its last row scored, which takes
the prompt kernel). Prints min / median ms of each and new/old. Not a test.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import statistics
import time
from pathlib import Path

import numpy as np

from specdec.manifest import read_manifest
from specdec.native import build
from specdec.native.weights import q8_rows
from specdec.runtime.native_backend import NativeBackend

LENGTHS = (64, 512, 1000)
VERIFY_ROWS = 9  # up to γ_max + 1 tokens: a verify pass, which scores every row; more: a prefill chunk (its last)


def kernels_from(source: Path):
    """The compiled library of another kernels.c, the exports it has declared (an older one may lack some that
    the forward does not call, such as prefill_products before fefff85)."""
    lib = ctypes.CDLL(str(build.compiled(source)))
    return build.declare(lib, [name for name in build.SIGNATURES if hasattr(lib, name)])


def float32_embedding(*models) -> None:
    """An older kernels.c (no embedding_rows in its model_t) reads only a float32 embedding: give both builds one,
    rebuilt from the head's blocks where the weights left it there."""
    weights = models[0].weights
    if weights.embedding is not None:
        return
    weights = dataclasses.replace(weights, embedding=q8_rows(weights.head))
    for model in models:
        model.weights = weights
        model.__dict__.pop("struct", None)  # built again over the new weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("old", type=Path, help="the other kernels.c")
    parser.add_argument("--role", choices=("draft", "target"), default="draft")
    parser.add_argument("--calls", type=int, default=24, help="forwards per build and cache length")
    parser.add_argument("--tokens", type=int, default=1, help="tokens per forward")
    args = parser.parse_args()
    builds = {"new": build.load_kernels(), "old": kernels_from(args.old)}
    target, draft = NativeBackend.open_models(args.bundle, read_manifest(args.bundle), "cpu", None)
    if "embedding_rows" not in args.old.read_text(encoding="utf-8"):
        float32_embedding(target.model, draft.model)
    model = (draft if args.role == "draft" else target).model
    rng = np.random.default_rng(0)
    lines = [f"{args.role}, {args.tokens}-token forwards, ms (min / median of {args.calls} calls each); "
             f"old = {args.old}", "",
             "| cache length | new | old | new / old (min) | new / old (median) |", "|---|---|---|---|---|"]
    for length in (n for n in LENGTHS if n + args.tokens <= model.max_seq_len):
        target.reset(1)
        draft.reset(1)
        target.forward(rng.integers(3, target.vocab_size, (1, length)), np.zeros(1, np.int64), last_only=True)
        times = {name: [] for name in builds}
        for call in range(args.calls):
            for name in (("new", "old") if call % 2 else ("old", "new")):
                model.kernels = builds[name]
                started = time.perf_counter()
                model.forward(np.full(args.tokens, 7), length, 0, last_only=args.tokens > VERIFY_ROWS)
                times[name].append((time.perf_counter() - started) * 1e3)
        new, old = times["new"], times["old"]
        lines.append(f"| {length} | {min(new):.2f} / {statistics.median(new):.2f} | {min(old):.2f} / "
                     f"{statistics.median(old):.2f} | {min(new) / min(old):.3f} | "
                     f"{statistics.median(new) / statistics.median(old):.3f} |")
    model.kernels = builds["new"]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
