"""The native CPU backend: specdec's own kernels (specdec.native) over the native weights a bundle carries (written
by specdec-export for LLaMA-layout gqa targets: GGUF Q4_1 blocks, or rows in a checkpoint's precision).

- The weights are read into private memory on huge pages (SPECDEC_NATIVE_PAGES=private, the default: faster steps)
  or memory-mapped from the bundle (=shared: one copy in the page cache for every process that opens it).
- The target computes its graph's function in another summation order with fp32 activations; or, with
  activations="int8", each row's activations are rounded per block of 32 to int8 before every product with blk4,
  blk8 or blk6 weights (the kernels' SPECDEC_ACT_INT8): integer dot products, a row's result still independent of
  the call it is in (docs/backends.md).
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
from pathlib import Path


from specdec.errors import BackendError, ConfigError
from specdec.manifest import Dtype, ModelEntry
from specdec.native_record import ACTIVATIONS, Activations
from specdec.runtime.backend import Backend, default_threads
from specdec.runtime.config import BackendName, Device
from specdec.runtime.forward import Capabilities, Output
from specdec.runtime.kernel_backend import KernelBackend

HINT = "use backend='onnxruntime'"
PAGES_ENV = "SPECDEC_NATIVE_PAGES"  # "private" (default) or "shared": how the weights are held (specdec.blocks)


def checked_pages(wanted: str | None = None) -> str:
    """How native weights are held: `wanted` (load(pages=...)), else $SPECDEC_NATIVE_PAGES, else "private"."""
    from specdec.weights_file import PAGES, Pages

    source = "pages" if wanted is not None else PAGES_ENV
    value = str(wanted if wanted is not None else os.environ.get(PAGES_ENV, "")).strip() or Pages.PRIVATE
    if value not in PAGES:
        raise BackendError(f"{source}={value!r} is not one of {', '.join(PAGES)}",
                           "choose private (the default: faster steps) or shared (one copy for all processes)")
    return Pages(value)


def checked_activations(value) -> Activations:
    """`value` (an Activations or its name) as an Activations; ConfigError for anything else."""
    try:
        return Activations(value)
    except ValueError:
        raise ConfigError(f"activations={value!r} is not one of {', '.join(ACTIVATIONS)}",
                          "pass activations='fp32', 'int8' or 'bf16' (--activations fp32|int8|bf16), or leave it unset "
                          "for the bundle's default") from None


class NativeBackend(KernelBackend):
    name = BackendName.NATIVE
    devices = (Device.CPU,)
    capabilities = Capabilities(frozenset({Output.LOGITS, Output.FEATURES}), feature_layers=None)  # any layer
    exact_prefix_kv = True  # a position's result depends only on its position (docs/backends.md; tested)

    def __init__(self, root: Path, entry: ModelEntry, threads: int | None = None,
                 target: "NativeBackend | None" = None, activations: str = Activations.FP32,
                 pages: str | None = None, isa: str | None = None):
        super().__init__(root, entry, target)
        self.threads = threads
        self.activations = checked_activations(activations)  # a target's; a draft keeps its own kernels
        self.pages = pages  # how the weights are held (checked_pages at open; a draft's: its target's)
        self.isa = isa  # the kernels' instruction set (None: $SPECDEC_NATIVE_ISA, else the widest this CPU runs)
        self.driver = None

    @classmethod
    def for_draft(cls, root: Path, draft: ModelEntry, threads: int | None, target: Backend) -> "NativeBackend":
        return cls(root, draft, threads, target=target)

    def open(self) -> "NativeBackend":
        if self.entry.kv_dtype != Dtype.FLOAT32:
            raise BackendError(f"the {self.entry.role} has KV dtype {self.entry.kv_dtype}; the native backend keeps "
                               f"fp32 KV", f"re-export with --dtype fp32, or {HINT}")
        self.pages = checked_pages(self.pages) if self.target is None else self.target.pages
        super().open()
        self.model.struct  # built and checked now, not on the first call
        self.driver = self.model  # what a draft's copy_kv reads (geometry, buffers)
        return self

    def _open_target(self, record):
        from specdec.native.build import kernel_runs, load_kernels
        from specdec.native.model import NativeModel
        from specdec.native.weights import target_weights

        from specdec.weight_kinds import WEIGHT_LAYOUTS, Kernel, WeightKind

        if self.activations is Activations.INT8 and WEIGHT_LAYOUTS[record.layout].rows:
            raise BackendError(f"activations='int8' multiply blocked weights, and this target holds "
                               f"{record.layout} rows", "pass activations='fp32', or use a bundle of a GGUF's "
                               "blocks (Q4_1, Q8_0 or a K-quant mix)")
        if self.activations is Activations.BF16 and WEIGHT_LAYOUTS[record.layout].linear is not WeightKind.BF16:
            raise BackendError(f"activations='bf16' multiply bf16 rows, and this target holds {record.layout} weights",
                               "pass activations='fp32' (or 'int8' for a GGUF's blocks), or export the checkpoint "
                               "with --dtype bf16 (make bundle-bf16)")
        kernels = load_kernels(self.isa)
        if self.activations is Activations.BF16 and not kernel_runs(kernels, Kernel.BF16A, WeightKind.BF16):
            raise BackendError("activations='bf16' run on AMX-BF16 tiles, which this CPU or build lacks (an AVX-512 "
                               "build on a CPU with amx_bf16 and avx512_bf16 in /proc/cpuinfo: Sapphire Rapids or "
                               "later)", "pass activations='fp32'")
        weights = target_weights(self.root, record, self.entry.dims, self.pages)
        self.check_family(weights)
        return NativeModel(weights, self.entry.dims, kernels, self.max_seq_len, threads=self._workers(),
                           activations=self.activations)

    def _open_draft(self, record, target_model):
        from specdec.native.model import NativeModel
        from specdec.native.weights import draft_weights

        draft = draft_weights(self.root, record, self.entry.dims, target_model.weights, self.pages)
        return NativeModel(target_model.weights, self.entry.dims, target_model.kernels, self.max_seq_len, draft=draft,
                           kv_owner=target_model, threads=self._workers())

    def _workers(self) -> int:
        return self.threads or default_threads()  # once, at open: it reads the cgroup quota's files

    @property
    def kv_layout(self) -> str | None:
        return self.entry.lowering  # the gqa driver's per-layer layout

    def _release(self) -> None:
        self.driver = None
