"""TensorRT backend: the `Backend` interface of specdec.runtime.backend on a TensorRT plan and cuda-python.

One execution context with two optimization profiles (prefill, step); after every change of profile or shape
the input shapes and all tensor addresses are bound again. Every call runs all `batch` slots of the last reset
(the plan's KV layout [L, B, Hkv, S, D] cannot address a subset); slots a call does not list get pad tokens at
cache_len 0 and no KV write-back, so their KV is untouched. Static KV buffers [L, B, Hkv, S, D] live on the
device; input_ids, cache_len and logits pass through pinned host buffers on one non-default stream. Each (B, T)
runs once directly (the warm-up enqueue), then its upload + enqueue + download is captured into a CUDA graph
that later calls replay. The KV write-back of docs/export.md (new_* at [cache_len[b], cache_len[b] + T)) is one
device-to-device cudaMemcpy3DAsync per row and tensor, after the graph, since its offsets change every call.
Nothing GPU-related is imported before `open()`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.engines.trt_config import INPUT_NAMES, OUTPUT_NAMES, PROFILE_NAMES, profile_for, token_limits
from specdec.engines.trt_select import check_plan_file, rebuild_hint, select_engine
from specdec.errors import BackendError
from specdec.files import read_regular
from specdec.lowering import PAD_ID
from specdec.manifest import Dtype, ModelEntry
from specdec.runtime.backend import Backend, check_logits
from specdec.runtime.config import BackendName, Device

KV_ITEMSIZE = {Dtype.FLOAT32: 4, Dtype.FLOAT16: 2, Dtype.BFLOAT16: 2}
INT64 = 8


@dataclass(frozen=True)
class TrtOptions:
    device: int = 0
    cuda_graphs: bool = True  # False: enqueue every call (for latency comparisons and debugging)


class TrtBackend(Backend):
    """A bundle model on its TensorRT plan; `open()` (or `with`) loads it, `close()` frees the GPU."""

    name = BackendName.TENSORRT

    def __init__(self, root: Path, entry: ModelEntry, options: TrtOptions = TrtOptions()):
        super().__init__(root, entry)
        self.options = options
        self.cuda = self.record = None
        self.logger = self.runtime = self.engine = self.context = None
        self.addresses, self.graphs = {}, {}
        self.bound = None  # (profile, B, T) the context is set up for
        self.replays = 0

    devices = (Device.CUDA,)

    @classmethod
    def for_target(cls, root: Path, entry: ModelEntry, device: str, threads: int | None) -> "TrtBackend":
        return cls(root, entry, TrtOptions(device=int(device.split(":")[1]) if ":" in device else 0))

    @classmethod
    def runs_draft(cls, draft: ModelEntry, target: Backend) -> bool:
        """A draft with a plan runs beside a TensorRT target; one without (INT4 MatMulNBits) goes to onnxruntime."""
        return isinstance(target, cls) and bool(draft.engines)

    @classmethod
    def for_draft(cls, root: Path, draft: ModelEntry, threads: int | None, target: Backend) -> "TrtBackend":
        return cls(root, draft, target.options)

    # --- lifetime --------------------------------------------------------------------------------------
    def open(self) -> "TrtBackend":
        from specdec.engines.cuda_glue import CudaSession, compute_capability
        from specdec.engines.trt_compat import import_tensorrt

        trt = import_tensorrt()
        if self.entry.logits_dtype != Dtype.FLOAT32 or self.entry.kv_dtype not in KV_ITEMSIZE:
            raise BackendError(
                f"{self.entry.role} has logits {self.entry.logits_dtype}, KV {self.entry.kv_dtype}",
                "the TensorRT backend needs float32 logits and a float32/float16/bfloat16 KV; re-export",
            )
        capability = compute_capability(self.options.device)
        self.record = select_engine(self.entry, capability, trt.__version__, self.root)
        plan = check_plan_file(self.root, self.record)
        try:
            self.cuda = CudaSession(self.options.device).open()
            self._load_engine(trt, plan)
            self.max_batch = min(self.entry.max_batch, int(self.record.max_batch))
            self._allocate()
        except BaseException:
            self.close()  # free what was made before the failure
            raise
        return self

    def _load_engine(self, trt, path: Path) -> None:
        from specdec.engines.trt_compat import create_logger, create_runtime

        self.logger = create_logger(trt)
        self.runtime = create_runtime(trt, self.logger, bool(self.record.version_compatible))
        self.engine = self.runtime.deserialize_cuda_engine(read_regular(path))
        if self.engine is None:
            raise BackendError(f"TensorRT could not load {self.record.path} (see the log)", rebuild_hint(self.root))
        names = {self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)}
        if names != set(INPUT_NAMES + OUTPUT_NAMES) or self.engine.num_optimization_profiles != len(PROFILE_NAMES):
            raise BackendError(
                f"{self.record.path} has tensors {sorted(names)} and "
                f"{self.engine.num_optimization_profiles} optimization profiles; specdec builds 2",
                rebuild_hint(self.root),
            )
        self.context = self.engine.create_execution_context()

    def _allocate(self) -> None:
        d, cuda = self.entry.dims, self.cuda
        batch, steps, item = self.max_batch, self.max_tokens, KV_ITEMSIZE[self.entry.kv_dtype]
        past = d.num_layers * batch * d.num_kv_heads * self.max_seq_len * d.head_dim * item  # [L, B, Hkv, S, D]
        new = d.num_layers * batch * d.num_kv_heads * steps * d.head_dim * item  # [L, B, Hkv, T, D]
        sizes = {"input_ids": batch * steps * INT64, "cache_len": batch * INT64, "past_keys": past,
                 "past_values": past, "logits": batch * steps * self.vocab_size * 4, "new_keys": new, "new_values": new}
        self.addresses = {name: cuda.malloc(nbytes) for name, nbytes in sizes.items()}
        for name in ("past_keys", "past_values"):
            cuda.memset(self.addresses[name], past)  # never-written slots are masked, but must not hold NaN bits
        self.host_ids = cuda.pinned((batch * steps,), np.int64)  # [B*T] prefix used
        self.host_len = cuda.pinned((batch,), np.int64)
        self.host_logits = cuda.pinned((batch * steps * self.vocab_size,), np.float32)  # [B*T*V] prefix used
        cuda.synchronize()

    @property
    def max_tokens(self) -> int:
        return max(high for _, high in token_limits(self.record.profiles).values())

    def close(self) -> None:
        if self.cuda is not None:
            self.cuda.synchronize()
        self.context = self.engine = self.runtime = self.logger = None  # context before engine before runtime
        if self.cuda is not None:
            self.cuda.close()
        self.cuda, self.addresses, self.graphs, self.bound = None, {}, {}, None
        self.batch = 0

    # --- the Backend interface ---------------------------------------------------------------------------
    def _reset(self, batch: int) -> None:
        if self.context is None:
            raise BackendError(f"the {self.entry.role} TensorRT backend is not open", "call open() first")
        # every forward passes cache_len, and slots past it are masked: nothing to clear

    def _forward(self, input_ids: np.ndarray, cache_len: np.ndarray, last_only: bool, slots: np.ndarray) -> np.ndarray:
        # input_ids: [B, T] int64; cache_len: [B] int64 -> logits [B, T, V] float32 ([B, 1, V] if last_only)
        steps, batch = input_ids.shape[1], self.batch
        ids = np.full((batch, steps), PAD_ID, dtype=np.int64)
        lens = np.zeros(batch, dtype=np.int64)
        ids[slots], lens[slots] = input_ids, cache_len
        profile = profile_for(self.record.profiles, steps)
        self.host_ids[: batch * steps] = ids.reshape(-1)
        self.host_len[:batch] = lens
        self._bind(profile, batch, steps)
        graph = self.graphs.get((batch, steps))
        if graph is not None:
            self.cuda.launch(graph)
            self.replays += 1
        else:
            self._enqueue(batch, steps)  # the warm-up enqueue computes this call's result
        self._write_back(batch, steps, lens, slots)
        self.cuda.synchronize()
        logits = self.host_logits[: batch * steps * self.vocab_size].reshape(batch, steps, self.vocab_size)
        logits = logits[slots, -1:] if last_only else logits[slots]  # a copy: the pinned buffer is reused
        if graph is None and self.options.cuda_graphs:
            self.graphs[(batch, steps)] = self.cuda.capture(lambda: self._enqueue(batch, steps))
        return check_logits(logits, self.entry.role, cache_len, steps, last_only)

    # --- GPU glue ------------------------------------------------------------------------------------------
    def _bind(self, profile: int, batch: int, steps: int) -> None:
        """Select the profile, set input shapes, bind every tensor address (again after any change)."""
        if self.bound == (profile, batch, steps):
            return
        if self.bound is None or self.bound[0] != profile:
            if not self.context.set_optimization_profile_async(profile, self.cuda.stream_handle):
                raise BackendError(f"TensorRT refused optimization profile {PROFILE_NAMES[profile]}", "run with -v")
        d = self.entry.dims
        kv = (d.num_layers, batch, d.num_kv_heads, self.max_seq_len, d.head_dim)  # [L, B, Hkv, S, D]
        shapes = {"input_ids": (batch, steps), "cache_len": (batch,), "past_keys": kv, "past_values": kv}
        for name, shape in shapes.items():
            if not self.context.set_input_shape(name, shape):
                raise BackendError(f"TensorRT refused shape {shape} for {name}", rebuild_hint(self.root))
        for name, address in self.addresses.items():
            self.context.set_tensor_address(name, address)
        self.bound = (profile, batch, steps)

    def _enqueue(self, batch: int, steps: int) -> None:
        """Upload ids and lengths, run the engine, download logits: all on the stream (capturable)."""
        cuda = self.cuda
        cuda.upload(self.addresses["input_ids"], self.host_ids, batch * steps * INT64)
        cuda.upload(self.addresses["cache_len"], self.host_len, batch * INT64)
        if not self.context.execute_async_v3(cuda.stream_handle):
            raise BackendError(f"TensorRT execute_async_v3 failed for B={batch}, T={steps}", "run with -v")
        cuda.download(self.host_logits, self.addresses["logits"], batch * steps * self.vocab_size * 4)

    def _write_back(self, batch: int, steps: int, cache_len: np.ndarray, slots: np.ndarray) -> None:
        """new_* [L, B, Hkv, T, D] -> past_* [L, B, Hkv, S, D] at [cache_len[b], cache_len[b] + T) for the listed
        slots only, on the device."""
        from specdec.engines.cuda_glue import kv_row_copies

        d = self.entry.dims
        copies = kv_row_copies(d.num_layers, batch, d.num_kv_heads, d.head_dim, self.max_seq_len, steps,
                               cache_len, KV_ITEMSIZE[self.entry.kv_dtype])
        for new, past in (("new_keys", "past_keys"), ("new_values", "past_values")):
            for slot in slots.tolist():
                self.cuda.copy_3d(self.addresses[new], self.addresses[past], copies[slot])
