"""The native CPU backend: specdec's own kernels (specdec.native) over the native weights a bundle carries (written
by specdec-export for LLaMA-layout gqa targets: GGUF Q4_1 blocks, or rows in a checkpoint's precision).

- The weights are read into private memory on huge pages (SPECDEC_NATIVE_PAGES=private, the default: faster steps)
  or memory-mapped from the bundle (=shared: one copy in the page cache for every process that opens it).
- The target computes its graph's function in another summation order with fp32 activations; or, with
  activations="int8" (NativeOptions), each row's activations are rounded per block of 32 to int8 before every product
  with blocked weights (the kernels' SPECDEC_ACT_INT8): integer dot products, a row's result still independent of the
  call (docs/backends.md).
- Its int4-q41 draft (make demo's) runs on the same blocks, read from its own copy in pairs of blocks with fp16
  scales, with activations rounded to two int8 parts per block of 32 and its graph's trimmed head. It reads and
  writes the target's KV: committed positions hold the target's K/V, the draft writes only past them, and the
  target's verify pass overwrites what it wrote. So a native draft's forward must start at or past its target's
  committed length: ModelDrafter, given the target as kv_source, starts it there (takes_kv_from).

All rows of a call run in one kernel call (each weight read once for all of them); KV lives in numpy,
[L, slots, Hkv, S, D], in the gqa driver's per-layer layout.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.errors import BackendError, ConfigError
from specdec.manifest import ACTIVATIONS, Activations, Dtype, Method, ModelEntry, Role
from specdec.native.weights import check_file, drafts_natively
from specdec.runtime.backend import Backend, SharedKvDraft, check_tokens, default_threads
from specdec.runtime.config import BackendName, Device
from specdec.runtime.forward import Capabilities, ForwardRequest, ForwardResult, Output

HINT = "use backend='onnxruntime'"
PAGES_ENV = "SPECDEC_NATIVE_PAGES"  # "private" (default) or "shared": how the weights are held (specdec.blocks)


def pages() -> str:
    """How this process holds native weights: $SPECDEC_NATIVE_PAGES, else "private"."""
    from specdec.blocks import PAGES, Pages

    value = os.environ.get(PAGES_ENV, "").strip() or Pages.PRIVATE
    if value not in PAGES:
        raise BackendError(f"{PAGES_ENV}={value!r} is not one of {', '.join(PAGES)}",
                           "set it to private (the default: faster steps) or shared (one copy for all processes)")
    return value


def checked_activations(value) -> Activations:
    """`value` as an Activations (a member or its name); ConfigError otherwise."""
    try:
        return Activations(value)
    except ValueError:
        raise ConfigError(f"activations={value!r} is not one of {', '.join(ACTIVATIONS)}",
                          "pass activations='fp32' or 'int8', or leave it unset (the bundle's default)") from None


@dataclass(frozen=True)
class NativeOptions:
    """How the native backend runs a target: its activations (Activations) in products with blocked weights."""

    activations: str = Activations.FP32

    def __post_init__(self):
        object.__setattr__(self, "activations", checked_activations(self.activations))


class NativeBackend(SharedKvDraft, Backend):
    name = BackendName.NATIVE
    devices = (Device.CPU,)
    capabilities = Capabilities(frozenset({Output.LOGITS, Output.FEATURES}), feature_layers=None)  # any layer

    def __init__(self, root: Path, entry: ModelEntry, threads: int | None = None,
                 target: "NativeBackend | None" = None, options: NativeOptions = NativeOptions()):
        super().__init__(root, entry)
        self.threads = threads
        self.target = target  # a native draft's target: its blocks and its KV
        self.options = options
        self.model = self.driver = None

    @classmethod
    def files_read(cls, entry: ModelEntry) -> list:
        """Only the native weights: the engine reads no ONNX."""
        return [entry.native.path] if entry.native is not None else []

    @classmethod
    def check_files(cls, root: Path, entry: ModelEntry) -> None:
        check_file(root, entry.native, entry.role)  # native.bin's size against its header's, before it is hashed

    @classmethod
    def runs_draft(cls, draft: ModelEntry, target: Backend) -> bool:
        """Whether this backend runs `draft` beside the open `target` (the pair planner asks)."""
        return isinstance(target, cls) and drafts_natively(draft, target.entry)

    @classmethod
    def for_draft(cls, root: Path, draft: ModelEntry, threads: int | None, target: Backend) -> "NativeBackend":
        return cls(root, draft, threads, target=target)

    def open(self) -> "NativeBackend":
        from specdec.native.build import load_kernels
        from specdec.native.model import NativeModel
        from specdec.native.weights import check_layout, draft_weights, target_weights

        role = Role.TARGET if self.target is None else Role.DRAFT
        record = check_layout(self.entry.native, role, self.entry.native_note)  # export writes native weights for gqa graphs only
        if self.entry.kv_dtype != Dtype.FLOAT32:
            raise BackendError(f"the {role} has KV dtype {self.entry.kv_dtype}; the native backend keeps fp32 KV",
                               f"re-export with --dtype fp32, or {HINT}")
        kernels = load_kernels()
        if self.target is None:
            self.activations = self._activations(record.layout)
            weights = target_weights(self.root, record, self.entry.dims, pages())
            self.model = NativeModel(weights, self.entry.dims, kernels, self.max_seq_len, activations=self.activations)
        else:
            if self.target.model is None or not drafts_natively(self.entry, self.target.entry):
                raise BackendError(f"the native backend runs a {Method.INT4_Q41} draft of an open native target only",
                                   "open the draft on onnxruntime (the pair planner chooses)")
            target = self.target.model
            draft = draft_weights(self.root, record, self.entry.dims, target.weights, pages())
            self.model = NativeModel(target.weights, self.entry.dims, kernels, self.max_seq_len, draft=draft,
                                     kv_owner=target)
        self.model.struct  # built and checked now, not on the first call
        self.workers = self.threads or default_threads()  # once: it reads the cgroup quota's files
        self.driver = self.model  # what a draft's copy_kv reads (geometry, buffers)
        return self

    def _activations(self, layout: str) -> Activations:
        """The target's activations: the options', where its weights are blocks; int8 needs blocks to multiply."""
        from specdec.blocks import WEIGHT_LAYOUTS

        if self.options.activations is Activations.INT8 and WEIGHT_LAYOUTS[layout].rows:
            raise BackendError(f"activations='int8' multiply blocked weights, and this target holds {layout} rows",
                               "pass activations='fp32' (the default for rows), or use a bundle exported from a "
                               "GGUF's blocks (Q4_1, Q8_0 or a K-quant mix)")
        return self.options.activations

    @property
    def kv_layout(self) -> str | None:
        return self.entry.lowering  # the gqa driver's per-layer layout

    exact_prefix_kv = True  # a position's result depends only on its position (docs/backends.md; tested)


    def _run(self, request: ForwardRequest, slots: np.ndarray, layers: tuple) -> ForwardResult:
        # input_ids: [B, T] -> logits [B, T or 1, V], features [B, T, F, H] of `layers`
        check_tokens(request.input_ids, self.model.weights.vocab, "the weights' vocabulary")
        out = self.model.compute(request.input_ids, request.cache_len, slots, request.last_only, self.workers,
                                 layers)  # checked by run
        return ForwardResult(*out) if layers else ForwardResult(out)

    def close(self) -> None:
        self.model = self.driver = None
        self.batch = 0
