"""Models are opened through `specdec.load` only: a benchmark then runs the backend, session options, threads and
KV sharing a user gets. The peers are opened through their own APIs, in their own processes (benchmarks/peers/)."""
from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path


def open_bundle(bundle: str | Path, backend: str = "auto", threads: int | None = None, verify: bool = False,
                activations: str | None = None):
    """specdec.load(bundle, ...): a Generator. Hashes are skipped by default (the runs re-open bundles often);
    activations: the native target's (None: the bundle's default)."""
    from specdec.runtime import load

    return load(bundle, backend=backend, threads=threads, verify=verify, activations=activations)


def parse_modes(text: str, aliases: dict | None = None) -> list:
    """'none,head:1,auto' -> [(drafter, γ or None)]: DRAFTER[:γ] items, comma-separated; `aliases` maps other names
    to drafters (lockstep's target-only to none). SystemExit naming the item otherwise."""
    from specdec.runtime.config import DRAFTERS

    aliases = aliases or {}
    modes = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        drafter, _, gamma = item.partition(":")
        drafter = aliases.get(drafter, drafter)
        if drafter not in DRAFTERS or (gamma and not (gamma.isdigit() and int(gamma) > 0)):
            names = ", ".join([*DRAFTERS, *aliases])
            raise SystemExit(f"mode {item!r} is not DRAFTER[:γ] with DRAFTER one of {names} and γ > 0")
        modes.append((drafter, int(gamma) if gamma else None))
    return modes


def models(generator) -> dict:
    """{"target": backend, "draft": backend, "head": HeadSteps} of an open generator (the draft and the head only
    where the bundle has them): the backends `load` opened, for timing single forwards."""
    found = {"target": generator.target.backend}
    if generator.draft is not None:
        found["draft"] = generator.draft.backend
    if generator.head is not None:
        found["head"] = HeadSteps(generator.head, generator.target.backend.max_seq_len)
    return found


class HeadSteps:
    """A bundle's draft head as step.py times a model: forward(ids [1, T], cache_len [1], last_only) is one head
    call at positions cache_len.. of slot 0, as the head drafter makes it. T = 1: a chain step (the head's own
    prenorm as its feature); T > 1: a catch-up (fc over T positions of the target's three layers, then the layer),
    its last position scored. The features are fixed random numbers: the head's cost does not depend on them."""

    def __init__(self, head, max_seq_len: int):
        import numpy as np

        self.head, self.max_seq_len = head, max_seq_len
        rng = np.random.default_rng(0)
        width = head.record.hidden_size
        self.features = rng.standard_normal((1, max_seq_len, len(head.feature_layers), width)).astype(np.float32)
        self.prenorm = rng.standard_normal((1, 1, width)).astype(np.float32)

    def reset(self, batch: int) -> None:
        self.head.reserve(batch)

    def forward(self, ids, cache_len, last_only: bool = False):
        start, steps = int(cache_len[0]), ids.shape[1]
        hidden = self.prenorm if steps == 1 else self.head.fuse(self.features[:, start : start + steps])
        return self.head.forward(ids, hidden, [start], [0], last_only=steps > 1 or last_only)[0]


def describe(generator) -> dict:
    """The settings a record needs of one specdec system: backend, why not native, γ, the models' precisions, and
    on native the kernels' instruction set and the target's activations."""
    manifest = generator.manifest
    described = {"backend": generator.backend, "gamma": manifest.defaults.gamma,
                 "gamma_max": manifest.defaults.gamma_max, "target": _entry(manifest.target)}
    if manifest.draft is not None:
        described["draft"] = _entry(manifest.draft)
    if generator.backend_note:
        described["backend_note"] = generator.backend_note
    if "native" in str(generator.backend):
        from specdec.native.build import isa

        described["native_isa"] = isa()  # the kernels' instruction set (both compute the same bits)
        described["activations"] = str(generator.activations)  # the native target's: fp32 or int8
    return described


def _entry(entry) -> dict:
    method = entry.calibration.method or entry.derived or "export"
    return {"precision": entry.precision, "lowering": entry.lowering, "layers": entry.dims.num_layers,
            "max_seq_len": entry.max_seq_len, "method": method}


@contextlib.contextmanager
def native_env(pages: str | None = None, isa: str | None = None):
    """While it lasts, the native backend holds its weights as `pages` says (SPECDEC_NATIVE_PAGES) and builds its
    kernels for the instruction set `isa` (SPECDEC_NATIVE_ISA: auto, avx2, avx512); None leaves either as this
    process has it. A bundle opened inside keeps both after it: each instruction set loads a library of its own, so
    builds of both can run in one process."""
    from specdec.native.build import ISA_ENV, forget_kernels
    from specdec.runtime.native_backend import PAGES_ENV

    wanted = {PAGES_ENV: pages, ISA_ENV: isa}
    before = {name: os.environ.get(name) for name in wanted}
    os.environ.update({name: value for name, value in wanted.items() if value is not None})
    if isa is not None:
        forget_kernels()
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if isa is not None:
            forget_kernels()


def add_out(parser: argparse.ArgumentParser) -> None:
    """--out as every entry point spells it."""
    parser.add_argument("--out", default=None,
                        help="output folder (default: benchmarks/results/<experiment>/<date>-<commit>/)")


def add_common(parser: argparse.ArgumentParser, backend: bool = True) -> None:
    """--out, --threads (and --backend) as every entry point spells them."""
    add_out(parser)
    parser.add_argument("--threads", type=int, default=None, help="threads per engine (default: the runtime's)")
    if backend:
        parser.add_argument("--backend", default="auto", choices=("auto", "onnxruntime", "native"),
                            help="the backend specdec.load opens (default auto)")
