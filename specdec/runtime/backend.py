"""The Backend contract every engine implements (DESIGN §5), and the onnxruntime session options.

forward(input_ids[B,T], cache_len[B], last_only=False, slots=None) -> logits[B,T,V] ([B,1,V] if last_only).
A backend owns static KV buffers for `batch` slots (set by reset); row b of a call uses slot slots[b]
(default b) and its new K/V land at [cache_len[b], cache_len[b] + T) of that slot. The KV of slots a call does
not list stays valid below their committed length. Rollback is the caller passing a smaller cache_len.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from specdec.errors import BackendError, CapacityError
from specdec.manifest import Manifest, ModelEntry


def check_capacity(cache_len: np.ndarray, steps: int, max_seq_len: int) -> None:
    end = int(cache_len.max()) + steps
    if end > max_seq_len or int(cache_len.min()) < 0:
        raise CapacityError(
            f"a forward of T={steps} at cache_len={cache_len.tolist()} needs {end} slots; S is {max_seq_len}",
            "the caller must end the row with reason 'length' first; re-export with a larger --max-seq-len",
        )


class Backend:
    """Shared fields, checks and lifetime of every backend; subclasses implement open, _reset, _forward, close."""

    name = ""  # the `backend=` value of specdec.load

    def __init__(self, root: Path, entry: ModelEntry):
        self.root = Path(root)
        self.entry = entry
        self.max_seq_len = entry.max_seq_len
        self.max_batch = entry.max_batch
        self.vocab_size = entry.dims.vocab_size
        self.batch = 0  # slots of the latest reset

    @classmethod
    def open_models(cls, root: Path, manifest: Manifest, device: str, threads: int | None) -> tuple:
        """(target, draft or None), opened, for `specdec.load`."""
        raise NotImplementedError

    def open(self) -> "Backend":
        raise NotImplementedError

    def reset(self, batch: int) -> None:
        """Prepare KV buffers for `batch` slots; every slot starts empty."""
        if not isinstance(batch, (int, np.integer)) or not 1 <= batch <= self.max_batch:
            raise CapacityError(f"batch {batch} is outside 1..max_batch={self.max_batch}",
                                "split the batch, or re-export with a larger --max-batch")
        self._reset(int(batch))
        self.batch = int(batch)

    def takes_kv_from(self, source) -> bool:
        """Whether `copy_kv(source, ...)` may stand in for this model computing its own KV (no by default)."""
        return False

    def copy_kv(self, source, slot: int, start: int, stop: int) -> None:
        """Write positions [start, stop) of `slot` from `source`'s KV (only where takes_kv_from(source))."""
        raise BackendError(f"the {self.name} backend does not copy KV between models", "draft without copying")

    def forward(self, input_ids: np.ndarray, cache_len: np.ndarray, last_only: bool = False,
                slots: np.ndarray | None = None) -> np.ndarray:
        """input_ids: [B, T] int64; cache_len: [B] int64; slots: [B] distinct slots -> logits [B, T or 1, V]."""
        slots = self.check_call(input_ids, cache_len, slots)
        return self._forward(input_ids, cache_len, last_only, slots)

    def check_call(self, input_ids: np.ndarray, cache_len: np.ndarray, slots) -> np.ndarray:
        rows, steps = input_ids.shape
        if self.batch == 0:
            raise BackendError(f"{self.entry.role} backend: forward before reset", "call reset(batch) first")
        slots = np.arange(rows, dtype=np.int64) if slots is None else np.asarray(slots, dtype=np.int64)
        if cache_len.shape != (rows,) or slots.shape != (rows,):
            raise BackendError(f"forward of {rows} rows got cache_len {cache_len.shape} and slots {slots.shape}",
                               "pass one cache_len and one slot per row")
        if rows and (slots.min() < 0 or slots.max() >= self.batch or len(set(slots.tolist())) != rows):
            raise BackendError(f"slots {slots.tolist()} are not distinct slots of 0..{self.batch - 1}",
                               "call reset(batch) with enough slots")
        check_capacity(cache_len, steps, self.max_seq_len)
        return slots

    def _reset(self, batch: int) -> None:
        raise NotImplementedError

    def _forward(self, input_ids, cache_len, last_only: bool, slots: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        """Release sessions and buffers; harmless on a backend that never opened."""

    def __enter__(self):
        return self.open()

    def __exit__(self, *exc):
        self.close()


def unwrapped(backend):
    """The backend inside its wrappers (Timed, Metered)."""
    while hasattr(backend, "backend"):
        backend = backend.backend
    return backend


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@functools.cache
def steady_malloc() -> None:
    """Keep a long-running process's resident memory flat (glibc only; once per process; skipped when the user
    set MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ themselves). glibc raises its mmap threshold each time a
    large block is freed, so later logits and KV-sized numpy arrays come from the heap, which fragments and grows;
    a fixed 512 KiB threshold returns every such block to the system when freed (soak: README, "Memory stays
    flat")."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    mallopt(m_mmap_threshold, 512 * 1024)
    mallopt(m_trim_threshold, 1024 * 1024)


def session_options(threads: int | None = None):
    """onnxruntime options for alternating draft/target sessions on few cores (DESIGN §5). Workers spin while a
    Run lasts (a step is hundreds of short kernels: waking sleeping workers for each cost 15 % of plain decoding
    on 2 cores) and stop spinning when it returns, so an idle session never takes cores from the one running
    (benchmarks/results/issue11/threads.md)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or cpu_count()
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    options.enable_cpu_mem_arena = False  # the arena keeps every shape's largest buffer: RSS crept up under varied
    # requests; without it step times stayed within the measurement's noise (README, "Memory stays flat")
    options.log_severity_level = 3
    return options


def check_device(name: str, device: str, allowed: tuple) -> None:
    if not device.startswith(allowed):
        raise BackendError(f"backend={name!r} does not run on device={device!r}",
                           "use backend='onnxruntime' with device='cpu', or backend='tensorrt' with device='cuda:N'")
