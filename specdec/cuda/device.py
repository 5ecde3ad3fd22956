"""kernels.cu on a GPU through CuPy: NVRTC-compiled at first use (CuPy caches the binary per architecture), launched
on one non-blocking stream, captured into CUDA graphs, with pinned host buffers for the inputs and the results.
The entry points are ReferenceKernels' (specdec/cuda/reference.py), which CI runs in their place. No PyTorch.

CuPy is imported in CupyKernels.__init__ only: without it, or without a GPU, opening says which and how to fix it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specdec.cuda.layouts import inputs, layout_of
from specdec.cuda.reference import ATT_WARPS, DeviceWeight, attention_shared
from specdec.errors import BackendError, MissingDependencyError
from specdec.weight_kinds import BLOCK
from specdec.weight_kinds import HEADER as KINDS_HEADER

SOURCE = Path(__file__).with_name("kernels.cu")
INCLUDE = f'#include "{KINDS_HEADER.name}"\n'  # the one header kernels.cu includes: the weight kinds'
LINEAR_WARPS = 4  # kernels.cu's LINEAR_WARPS: columns per block of a product
THREADS = 256
STATIC_SHARED = 48 * 1024  # dynamic shared memory a kernel gets without opting in
CUDA_HINT = "pip install 'specdec[cuda]' (CuPy for CUDA 12: cupy-cuda12x; for CUDA 13: cupy-cuda13x)"


def source() -> str:
    """kernels.cu with specdec_kinds.h in place of its #include: the text NVRTC compiles, whole, so CuPy's cache (keyed
    by the text) sees a change of either file."""
    text = SOURCE.read_text(encoding="utf-8")
    if text.count(INCLUDE) != 1:
        raise BackendError(f"{SOURCE} does not include {KINDS_HEADER.name} once", "reinstall specdec")
    return text.replace(INCLUDE, KINDS_HEADER.read_text(encoding="utf-8") + "\n")


def import_cupy():
    try:
        import cupy
    except ImportError as exc:
        raise MissingDependencyError(f"the cuda backend needs CuPy, which did not import ({exc})", CUDA_HINT) from exc
    return cupy


def gpu_count(cupy) -> int:
    """GPUs the CUDA runtime sees (0 where there is no driver)."""
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - CUDARuntimeError without a driver; its class moves between CuPy versions
        return 0


class CupyKernels:
    """kernels.cu on GPU `index`. few_rows: products of at most this many rows run on kernels.cu's own product (the
    same per-row sums at any row count); more are dequantized to fp32 and multiplied by cuBLAS (prefill chunks)."""

    name = "cuda"

    def __init__(self, index: int = 0, few_rows: int = 64):
        cp = import_cupy()
        count = gpu_count(cp)
        if count == 0:
            raise BackendError("the cuda backend found no CUDA GPU (or no NVIDIA driver) on this machine",
                               "run on a machine with an NVIDIA GPU, or use backend='native' or 'onnxruntime' on "
                               "the CPU (backend='auto' picks one)")
        if not 0 <= index < count:
            raise BackendError(f"device cuda:{index} does not exist; this machine has {count} GPU(s)",
                               f"pass device='cuda:0' .. 'cuda:{count - 1}'")
        self.cp, self.index, self.few_rows = cp, index, few_rows
        self.device = cp.cuda.Device(index)
        self.device.use()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.module = cp.RawModule(code=source(), options=("-std=c++17",))
        self.functions = {}
        self.wide = None  # fp32 rows of one weight for cuBLAS (grown)
        self.launches = 0

    # ---- facts ----
    @property
    def capability(self) -> str:
        return str(self.device.compute_capability)

    @property
    def max_shared(self) -> int:
        """Dynamic shared memory one block may opt in to."""
        return int(self.device.attributes.get("MaxSharedMemoryPerBlockOptin", STATIC_SHARED))

    def free_bytes(self) -> int | None:
        free, _ = self.cp.cuda.runtime.memGetInfo()
        return int(free)

    # ---- memory ----
    def weight(self, array: np.ndarray, k: int | None = None) -> DeviceWeight:
        layout = layout_of(array)
        data = self.cp.asarray(np.ascontiguousarray(array).view(np.uint8).reshape(-1))
        return DeviceWeight(data, layout, len(array), k if k is not None else inputs(layout, array))

    def upload(self, array: np.ndarray):
        return self.cp.asarray(np.ascontiguousarray(array))

    def empty(self, shape, dtype):
        return self.cp.zeros(shape, dtype)

    def pinned(self, shape, dtype) -> np.ndarray:
        import cupyx

        return cupyx.empty_pinned(shape, dtype)

    def to_device(self, dst, src: np.ndarray) -> None:
        runtime = self.cp.cuda.runtime
        runtime.memcpyAsync(dst.data.ptr, src.ctypes.data, src.nbytes, runtime.memcpyHostToDevice, self.stream.ptr)

    def to_host(self, dst: np.ndarray, src) -> None:
        runtime = self.cp.cuda.runtime
        runtime.memcpyAsync(dst.ctypes.data, src.data.ptr, dst.nbytes, runtime.memcpyDeviceToHost, self.stream.ptr)

    def fetch(self, src) -> np.ndarray:
        with self.device, self.stream:
            out = src.get(stream=self.stream)
        self.stream.synchronize()
        return out

    def copy(self, src):
        with self.device, self.stream:
            return src.copy()

    def copy_rows(self, dst, src) -> None:
        """dst [R, W] (rows at any pitch) <- src [R, W], float32, one 2D copy on the stream (a graph captures it)."""
        runtime = self.cp.cuda.runtime
        rows, width = src.shape
        with self.device:
            runtime.memcpy2DAsync(dst.data.ptr, dst.strides[0], src.data.ptr, src.strides[0], width * src.itemsize,
                                  rows, runtime.memcpyDeviceToDevice, self.stream.ptr)
        self.launches += 1

    def synchronize(self) -> None:
        self.stream.synchronize()

    # ---- graphs ----
    def capture(self, body):
        with self.device, self.stream:
            self.stream.begin_capture()
            try:
                body()
            finally:
                graph = self.stream.end_capture()
        graph.upload(self.stream)
        return graph

    def replay(self, graph) -> None:
        graph.launch(self.stream)

    def _launch(self, name: str, grid: tuple, block: int, args: tuple, shared: int = 0) -> None:
        fn = self.functions.get(name)
        if fn is None:
            fn = self.functions[name] = self.module.get_function(name)
        if shared > STATIC_SHARED and fn.max_dynamic_shared_size_bytes < shared:
            fn.max_dynamic_shared_size_bytes = shared
        with self.device, self.stream:
            fn(grid, (block,), args, shared_mem=shared)
        self.launches += 1

    # ---- kernels ----
    def embed(self, table: DeviceWeight, ids, out) -> None:
        rows, width = out.shape
        self._launch("embed", (rows,), THREADS, (table.data, np.int32(table.layout), ids, np.int32(width), out))

    def rmsnorm(self, x, gamma, eps: float, out, step: int = 1, offset: int = 0) -> None:
        rows, width = out.shape
        self._launch("rmsnorm", (rows,), THREADS, (x, gamma, np.float32(eps), np.int32(width), np.int32(step),
                                                   np.int32(offset), out))

    def linear(self, x, w: DeviceWeight, out, accumulate: bool = False) -> None:
        rows = len(x)
        if rows > self.few_rows:
            self._cublas(x, w, out, accumulate)
            return
        grid = (-(-w.n // LINEAR_WARPS),)
        self._launch(f"linear_{w.layout.label}", grid, LINEAR_WARPS * 32,
                     (x, np.int32(rows), np.int32(w.k), w.data, np.int32(w.n), out, np.int32(accumulate)))

    def linear_norm(self, x, gamma, eps: float, w: DeviceWeight, out, accumulate: bool = False) -> None:
        rows = len(x)
        if rows > self.few_rows:
            with self.device, self.stream:
                scale = 1 / self.cp.sqrt((x * x).mean(axis=-1, keepdims=True) + self.cp.float32(eps))
                self._cublas(x * gamma * scale, w, out, accumulate)
            return
        self._launch(f"linear_norm_{w.layout.label}", (-(-w.n // LINEAR_WARPS),), LINEAR_WARPS * 32,
                     (x, gamma, np.float32(eps), np.int32(rows), np.int32(w.k), w.data, np.int32(w.n), out,
                      np.int32(accumulate)))

    def linear_silu(self, gu, w: DeviceWeight, out, accumulate: bool = False) -> None:
        rows, width = len(gu), gu.shape[1] // 2
        if rows > self.few_rows:
            with self.device, self.stream:
                gate, up = gu[:, :width], gu[:, width:]
                self._cublas(gate / (1 + self.cp.exp(-gate)) * up, w, out, accumulate)
            return
        self._launch(f"linear_silu_{w.layout.label}", (-(-w.n // LINEAR_WARPS),), LINEAR_WARPS * 32,
                     (gu, np.int32(rows), np.int32(w.k), w.data, np.int32(w.n), out, np.int32(accumulate)))

    def _cublas(self, x, w: DeviceWeight, out, accumulate: bool) -> None:
        size = w.n * w.k
        if self.wide is None or self.wide.size < size:
            self.wide = self.cp.empty(size, np.float32)
        dense = self.wide[:size].reshape(w.n, w.k)
        groups = w.n * (w.k // BLOCK)
        self._launch(f"dequant_{w.layout.label}", (-(-groups // THREADS),), THREADS,
                     (w.data, np.int32(w.n), np.int32(w.k), dense))
        with self.device, self.stream:
            product = x @ dense.T
            if accumulate:
                out += product
            else:
                out[...] = product

    def rope_kv(self, qkv, cos, sin, pos, slots, steps: int, heads: int, kv_heads: int, q, keys, values) -> None:
        rows, dim, size = len(q), q.shape[-1], keys.shape[2]
        self._launch("rope_kv", (rows, heads + kv_heads), min(128, max(32, dim // 2)),
                     (qkv, cos, sin, pos, slots, np.int32(steps), np.int32(heads), np.int32(kv_heads), np.int32(dim),
                      np.int32(size), q, keys, values))

    @staticmethod
    def attention_shared(size: int, dim: int) -> int:
        return attention_shared(size, dim)

    def attention(self, q, keys, values, pos, slots, steps: int, scale: float, out) -> None:
        rows, heads, dim = q.shape
        kv_heads, size = keys.shape[1], keys.shape[2]
        self._launch("attention", (rows, heads), ATT_WARPS * 32,
                     (q, keys, values, pos, slots, np.int32(steps), np.int32(heads), np.int32(kv_heads),
                      np.int32(dim), np.int32(size), np.float32(scale), out), self.attention_shared(size, dim))

    def silu_mul(self, gu, out) -> None:
        rows, width = out.shape
        self._launch("silu_mul", (-(-rows * width // THREADS),), THREADS, (gu, np.int32(rows), np.int32(width), out))

    def argmax(self, logits, ids, best) -> None:
        rows, vocab = logits.shape
        self._launch("argmax", (rows,), THREADS, (logits, np.int32(vocab), ids, best))

    def chain_next(self, ids, best, head_rows, mapped: bool, fill: float, fill_token: int, tokens, pos, chain) -> None:
        rows = len(ids)
        self._launch("chain_next", (-(-rows // 32),), 32, (ids, best, head_rows, np.int32(mapped), np.float32(fill),
                                                           np.int32(fill_token), np.int32(rows), tokens, pos, chain))

    def close(self) -> None:
        self.synchronize()
        self.wide = None
        self.functions.clear()
