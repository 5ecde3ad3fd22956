"""The backend interface every engine implements, and the onnxruntime CPU backend.

forward(input_ids[B,T], cache_len[B]) -> logits[B,T,V]; the backend owns the static KV buffers
[L, B, Hkv, S, D] and writes the new K/V of row b at [cache_len[b], cache_len[b] + T).
Rollback is the caller passing a smaller cache_len next time.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

import numpy as np

from specdec.errors import BackendError, CapacityError, missing_dependency
from specdec.manifest import ModelEntry

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}


class Backend(Protocol):
    max_seq_len: int
    max_batch: int
    vocab_size: int

    def reset(self, batch: int) -> None:
        """Prepare KV buffers for `batch` rows; every row starts empty."""

    def forward(self, input_ids: np.ndarray, cache_len: np.ndarray, last_only: bool = False) -> np.ndarray:
        """input_ids: [B, T] int64; cache_len: [B] int64 -> logits [B, T, V] float32 ([B, 1, V] if last_only)."""

    def close(self) -> None:
        """Release sessions and buffers."""


def check_capacity(cache_len: np.ndarray, steps: int, max_seq_len: int) -> None:
    end = int(cache_len.max()) + steps
    if end > max_seq_len or int(cache_len.min()) < 0:
        raise CapacityError(
            f"a forward of T={steps} at cache_len={cache_len.tolist()} needs {end} slots; S is {max_seq_len}",
            "the caller must end the row with reason 'length' first; re-export with a larger --max-seq-len",
        )


def session_options(threads: int | None = None):
    """onnxruntime options for alternating draft/target sessions on few cores (DESIGN §5). Workers spin while a
    Run lasts (a step is hundreds of short kernels: waking sleeping workers for each cost 15 % of plain decoding
    on 2 cores) and stop spinning when it returns, so an idle session never takes cores from the one running
    (benchmarks/results/issue11/threads.md)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or len(os.sched_getaffinity(0))
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    options.log_severity_level = 3
    return options


class OrtBackend:
    """onnxruntime on the CPU execution provider, KV buffers in numpy."""

    def __init__(self, root: Path, entry: ModelEntry, threads: int | None = None):
        self.root = Path(root)
        self.entry = entry
        self.threads = threads
        self.max_seq_len = entry.max_seq_len
        self.max_batch = entry.max_batch
        self.vocab_size = entry.dims.vocab_size
        self.session = None
        self.keys = self.values = None

    def open(self) -> "OrtBackend":
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise missing_dependency("onnxruntime", "cpu") from exc
        if self.entry.kv_dtype not in NUMPY_DTYPES:
            raise BackendError(
                f"{self.entry.role} has KV dtype {self.entry.kv_dtype}, which the CPU backend does not run",
                "export with --dtype fp32 for the onnxruntime CPU backend",
            )
        path = self.root / self.entry.onnx_path
        try:
            self.session = ort.InferenceSession(str(path), session_options(self.threads), providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types from C++
            raise BackendError(f"onnxruntime cannot load {path}: {exc}", "re-export the bundle") from exc
        return self

    def reset(self, batch: int) -> None:
        if not 1 <= batch <= self.max_batch:
            raise CapacityError(
                f"batch {batch} is outside 1..max_batch={self.max_batch}", "re-export with a larger --max-batch"
            )
        d = self.entry.dims
        shape = (d.num_layers, batch, d.num_kv_heads, self.max_seq_len, d.head_dim)
        if self.keys is None or self.keys.shape != shape:
            dtype = NUMPY_DTYPES[self.entry.kv_dtype]
            self.keys, self.values = np.zeros(shape, dtype), np.zeros(shape, dtype)

    def forward(self, input_ids: np.ndarray, cache_len: np.ndarray, last_only: bool = False) -> np.ndarray:
        # input_ids: [B, T]; cache_len: [B] -> logits [B, T, V] ([B, 1, V] if last_only)
        steps = input_ids.shape[1]
        check_capacity(cache_len, steps, self.max_seq_len)
        feeds = {"input_ids": input_ids, "cache_len": cache_len, "past_keys": self.keys, "past_values": self.values}
        logits, new_keys, new_values = self.session.run(None, feeds)
        # new_*: [L, B, Hkv, T, D] -> static buffers at [cache_len[b], cache_len[b] + T)
        for row, start in enumerate(cache_len.tolist()):
            self.keys[:, row, :, start : start + steps] = new_keys[:, row]
            self.values[:, row, :, start : start + steps] = new_values[:, row]
        return logits[:, -1:] if last_only else logits

    def close(self) -> None:
        self.session = None
        self.keys = self.values = None

    def __enter__(self):
        return self.open()

    def __exit__(self, *exc):
        self.close()
