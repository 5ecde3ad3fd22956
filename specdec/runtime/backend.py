"""The Backend contract every engine implements (docs/backends.md), and the onnxruntime session options.

run(ForwardRequest) -> ForwardResult (specdec.runtime.forward): logits [B,T,V] ([B,1,V] if last_only), and the hidden
states of the layers the request names where the backend's `capabilities` declare them. forward(input_ids[B,T],
cache_len[B], last_only=False, slots=None) -> logits is its shorthand.
A backend owns static KV buffers for `batch` slots (set by reset); row b of a call uses slot slots[b]
(default b) and its new K/V land at [cache_len[b], cache_len[b] + T) of that slot. The KV of slots a call does
not list stays valid below their committed length. Rollback is the caller passing a smaller cache_len.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from specdec.errors import BackendError, CapacityError, nonfinite_logits
from specdec.manifest import ModelEntry
from specdec.native_record import Activations
from specdec.runtime.config import Device
from specdec.runtime.forward import LOGITS_ONLY, Capabilities, ForwardRequest, ForwardResult, feature_order


def bounds(values: np.ndarray) -> tuple[int, int]:
    """(min, max) of a non-empty integer array; a small one through Python ints (numpy's reductions cost microseconds
    each on a handful of values, several times a forward call: the host time of a GPU round)."""
    if values.size <= 64:
        flat = values.ravel().tolist()
        return min(flat), max(flat)
    return int(values.min()), int(values.max())


def check_capacity(cache_len: np.ndarray, steps: int, max_seq_len: int) -> None:
    low, high = bounds(cache_len)
    end = high + steps
    if end > max_seq_len or low < 0:
        raise CapacityError(
            f"a forward of T={steps} at cache_len={cache_len.tolist()} needs {end} slots; S is {max_seq_len}",
            "the caller must end the row with reason 'length' first; re-export with a larger --max-seq-len",
        )


class Backend:
    """Shared fields, checks and lifetime of every backend; subclasses implement open, _reset, _forward, close."""

    name = ""  # the `backend=` value of specdec.load (a BackendName)
    devices = (Device.CPU,)  # device prefixes it runs on
    # Whether a position's K/V depends only on the tokens up to it, bit for bit, however they were fed (whole or in
    # pieces, alone or batched, by a prompt or a verify pass): then a slot's K/V of an earlier request's tokens may
    # stand in for a prefill of the same tokens, invisibly (specdec serve reuses a shared prompt prefix so)
    exact_prefix_kv = False
    capabilities: Capabilities = LOGITS_ONLY  # what its calls return beyond logits (an open backend may say more)
    activations = Activations.FP32  # what its target's activations are in its products (native: fp32, int8 or bf16)

    def __init__(self, root: Path, entry: ModelEntry):
        self.root = Path(root)
        self.entry = entry
        self.max_seq_len = entry.max_seq_len
        self.max_batch = entry.max_batch
        self.vocab_size = entry.dims.vocab_size
        self.batch = 0  # slots of the latest reset

    @classmethod
    def for_target(cls, root: Path, entry: ModelEntry, device: str, threads: int | None) -> "Backend":
        """A target on `device` (not opened yet); specdec.runtime.registry.open_pair opens the pair."""
        return cls(root, entry, threads)

    @classmethod
    def runs_draft(cls, draft: ModelEntry, target: "Backend") -> bool:
        """Whether this backend runs `draft` beside the open `target` (the pair planner asks each candidate)."""
        return False

    @classmethod
    def for_draft(cls, root: Path, draft: ModelEntry, threads: int | None, target: "Backend") -> "Backend":
        return cls(root, draft, threads)

    @classmethod
    def files_read(cls, entry: ModelEntry) -> list:
        """The bundle files this backend reads of `entry` (load(verify=True) hashes these before opening it)."""
        native = entry.native.path if entry.native is not None else None
        return list(dict.fromkeys([entry.onnx_path, *(rel for rel in entry.files if rel != native)]))

    @classmethod
    def check_files(cls, root: Path, entry: ModelEntry) -> None:
        """Cheap checks of the files it reads of `entry` (their sizes against what they say of themselves), which
        load(verify=True) runs before it hashes them: a file refused here is never read whole. None by default."""

    @property
    def kv_layout(self) -> str | None:
        """The lowering whose KV layout this backend's driver holds in numpy (a KV source for copy_kv), or None."""
        return None

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

    def run(self, request: ForwardRequest) -> ForwardResult:
        """One forward call (specdec.runtime.forward): checked here, computed by _run."""
        slots = self.check_call(request.input_ids, request.cache_len, request.slots)
        layers = feature_order(request.feature_layers, self.entry.dims.num_layers)
        self.capabilities.check(request, self.entry.role, self.name)
        return self._run(request, slots, layers)

    def forward(self, input_ids: np.ndarray, cache_len: np.ndarray, last_only: bool = False,
                slots: np.ndarray | None = None) -> np.ndarray:
        """input_ids: [B, T] int64; cache_len: [B] int64; slots: [B] distinct slots -> logits [B, T or 1, V]."""
        return self.run(ForwardRequest(input_ids, cache_len, last_only, slots)).logits

    def check_call(self, input_ids: np.ndarray, cache_len: np.ndarray, slots) -> np.ndarray:
        rows, steps = input_ids.shape
        if self.batch == 0:
            raise BackendError(f"{self.entry.role} backend: forward before reset", "call reset(batch) first")
        slots = np.arange(rows, dtype=np.int64) if slots is None else np.asarray(slots, dtype=np.int64)
        if cache_len.shape != (rows,) or slots.shape != (rows,):
            raise BackendError(f"forward of {rows} rows got cache_len {cache_len.shape} and slots {slots.shape}",
                               "pass one cache_len and one slot per row")
        low, high = bounds(slots) if rows else (0, 0)
        if rows and (low < 0 or high >= self.batch or len(set(slots.tolist())) != rows):
            raise BackendError(f"slots {slots.tolist()} are not distinct slots of 0..{self.batch - 1}",
                               "call reset(batch) with enough slots")
        check_capacity(cache_len, steps, self.max_seq_len)
        return slots

    def _reset(self, batch: int) -> None:
        raise NotImplementedError

    def _run(self, request: ForwardRequest, slots: np.ndarray, layers: tuple) -> ForwardResult:
        """A checked call; a backend that returns logits alone implements _forward instead."""
        return ForwardResult(self._forward(request.input_ids, request.cache_len, request.last_only, slots))

    def _forward(self, input_ids, cache_len, last_only: bool, slots: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        """Release sessions and buffers; harmless on a backend that never opened."""

    def __enter__(self):
        return self.open()

    def __exit__(self, *exc):
        self.close()


def unwrapped(backend):
    """The backend inside its wrappers (Observed)."""
    while hasattr(backend, "backend"):
        backend = backend.backend
    return backend


def cpu_count() -> int:
    """The cores this process may use: its affinity mask, capped by its cgroup's CPU quota (a container limited to 2
    CPUs on a 64-core host has an affinity of 64)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota()
    return max(1, min(cores, quota)) if quota else cores


def cgroup_cpu_quota(proc: Path = Path("/proc/self/cgroup"), fs: Path = Path("/sys/fs/cgroup")) -> int | None:
    """ceil(quota / period) of this process's cgroup (v2 cpu.max, or v1 cpu.cfs_quota_us), None where unlimited or
    unreadable. Every cgroup from this process's up to the root counts: the smallest quota wins."""
    try:
        lines = proc.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        v2 = parts[0] == "0" and parts[1] == ""
        if not v2 and "cpu" not in parts[1].split(","):
            continue
        folder = fs / parts[2].lstrip("/") if v2 else _v1_folder(fs, parts[1], parts[2])
        for level in [folder, *folder.parents]:
            quota = _quota_v2(level) if v2 else _quota_v1(level)
            if quota:
                quotas.append(quota)
            if level == fs or fs not in level.parents:
                break
    return min(quotas) if quotas else None


def _v1_folder(fs: Path, controllers: str, path: str) -> Path:
    for name in (controllers, "cpu,cpuacct", "cpu"):
        if (fs / name).is_dir():
            return fs / name / path.lstrip("/")
    return fs / "cpu" / path.lstrip("/")


def _quota_v2(folder: Path) -> int | None:
    try:
        quota, period = (folder / "cpu.max").read_text(encoding="utf-8").split()[:2]
        return None if quota == "max" else -(-int(quota) // int(period))
    except (OSError, ValueError):
        return None


def _quota_v1(folder: Path) -> int | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text(encoding="utf-8"))
        period = int((folder / "cpu.cfs_period_us").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return -(-quota // period) if quota > 0 and period > 0 else None


default_threads = cpu_count  # what the native kernels and onnxruntime use when the caller names no count


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
    """onnxruntime options for alternating draft/target sessions on few cores (docs/backends.md). Workers spin while a
    Run lasts (a step is hundreds of short kernels: waking sleeping workers for each slows plain decoding) and stop
    spinning when it returns, so an idle session never takes cores from the one running. `python
    benchmarks/thread_schemes.py BUNDLE --rounds 3` compares the schemes (records in benchmarks/results/threads/)."""
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


def check_logits(logits: np.ndarray, role: str, cache_len: np.ndarray, steps: int, last_only: bool) -> np.ndarray:
    """A host backend's logits [B, T or 1, V] of rows at cache_len [B], returned where every position's are sound: no
    NaN, and a finite largest logit (+inf, or all -inf, leaves no distribution; a -inf logit alone is a token of
    probability 0); else NumericError naming the first position that is not. One reduction meets every value: a
    position's max is NaN where one of its logits is (`python benchmarks/step.py BUNDLE --backends onnxruntime`
    measures it with the step)."""
    top = logits.max(axis=-1) if logits.size else None
    if top is not None and not np.isfinite(top).all():
        raise nonfinite_logits(role, np.isfinite(top).tolist(), cache_len.tolist(), steps, last_only)
    return logits


def check_tokens(input_ids: np.ndarray, vocab: int, what: str = "the vocabulary") -> None:
    """BackendError where a token id lies outside 0..vocab - 1."""
    if input_ids.size:
        low, high = bounds(input_ids)
        if low < 0 or high >= vocab:
            raise BackendError(f"token ids {low}..{high} are outside {what} 0..{vocab - 1}",
                               "encode the text with the bundle's tokenizer")
