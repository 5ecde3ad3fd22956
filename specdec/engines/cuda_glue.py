"""Thin cuda-python glue: device and pinned buffers, one non-default stream, copies and CUDA graphs.

Every call goes through the documented runtime API of cuda-python (`cuda.bindings.runtime`, or `cuda.cudart`
before cuda-python 12.6), which returns `(error, *values)`. `CudaSession` owns everything it allocates;
`close()` frees it. The offsets of the KV write-back (`kv_row_copies`) are plain arithmetic, tested on CPU.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import numpy as np

from specdec.errors import BackendError, missing_dependency

NO_GPU_HINT = "run on a machine with an NVIDIA GPU and driver, or use backend='onnxruntime', device='cpu'"


def import_cudart():
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError as exc:
            raise missing_dependency("cuda-python", "tensorrt") from exc
    return cudart


def check(cudart, result, what: str = "CUDA call"):
    """Unpack a cuda-python result tuple; raise BackendError on an error code."""
    err, values = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    if err != cudart.cudaError_t.cudaSuccess:
        name = cudart.cudaGetErrorName(err)[1]
        name = name.decode() if isinstance(name, bytes) else str(name)
        raise BackendError(f"{what} failed with {name}", NO_GPU_HINT if "Device" in name or "Driver" in name else
                           "run with CUDA_LAUNCH_BLOCKING=1 and -v to locate the failing call")
    return values[0] if len(values) == 1 else (values or None)


def compute_capability(device: int = 0) -> tuple:
    """(major, minor) of `device`; BackendError with a hint when no GPU is visible."""
    cudart = import_cudart()
    count = check(cudart, cudart.cudaGetDeviceCount(), "cudaGetDeviceCount (is a GPU visible?)")
    if not 0 <= device < count:
        raise BackendError(f"CUDA device {device} does not exist; {count} visible", NO_GPU_HINT)
    attr = cudart.cudaDeviceAttr
    major = check(cudart, cudart.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMajor, device))
    minor = check(cudart, cudart.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMinor, device))
    return int(major), int(minor)


@dataclass(frozen=True)
class Copy3D:
    """One cudaMemcpy3D between linear buffers: element (x, y, z) lives at offset + z*pitch*ysize + y*pitch + x."""

    src_offset: int
    src_pitch: int
    src_ysize: int
    dst_offset: int
    dst_pitch: int
    dst_ysize: int
    width: int  # bytes per row
    height: int
    depth: int


def kv_row_copies(layers: int, batch: int, kv_heads: int, head_dim: int, seq_len: int, steps: int,
                  cache_len, itemsize: int) -> list:
    """Copies that write new [L, B, Hkv, T, D] into past [L, B, Hkv, S, D] at [cache_len[b], cache_len[b]+T).

    One copy per row b: x = (t, d) bytes, y = kv head, z = layer."""
    row_new = steps * head_dim * itemsize  # bytes of one (l, b, h) slab in new_*
    row_past = seq_len * head_dim * itemsize  # bytes of one (l, b, h) slab in past_*
    copies = []
    for b, start in enumerate(int(c) for c in cache_len):
        copies.append(Copy3D(
            src_offset=b * kv_heads * row_new, src_pitch=row_new, src_ysize=batch * kv_heads,
            dst_offset=b * kv_heads * row_past + start * head_dim * itemsize, dst_pitch=row_past,
            dst_ysize=batch * kv_heads, width=row_new, height=kv_heads, depth=layers,
        ))
    return copies


class CudaSession:
    """A device, one non-blocking stream, and every buffer and graph made through it."""

    def __init__(self, device: int = 0):
        self.device = device
        self.cudart = None
        self.stream = None
        self._device_ptrs, self._host_ptrs, self._graphs = [], [], []

    def open(self) -> "CudaSession":
        self.cudart = cudart = import_cudart()
        compute_capability(self.device)  # a clear error when no GPU is visible
        check(cudart, cudart.cudaSetDevice(self.device), "cudaSetDevice")
        self.stream = check(cudart, cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking), "cudaStreamCreate")
        return self

    @property
    def stream_handle(self) -> int:
        return int(self.stream)

    def malloc(self, nbytes: int) -> int:
        ptr = check(self.cudart, self.cudart.cudaMalloc(max(1, nbytes)), f"cudaMalloc({nbytes})")
        self._device_ptrs.append(ptr)
        return int(ptr)

    def pinned(self, shape: tuple, dtype) -> np.ndarray:
        """A numpy array in page-locked host memory (valid until close())."""
        dtype = np.dtype(dtype)
        nbytes = max(1, math.prod(shape) * dtype.itemsize)
        ptr = int(check(self.cudart, self.cudart.cudaMallocHost(nbytes), f"cudaMallocHost({nbytes})"))
        self._host_ptrs.append(ptr)
        raw = (ctypes.c_byte * nbytes).from_address(ptr)
        return np.frombuffer(raw, dtype=dtype, count=math.prod(shape)).reshape(shape)

    def upload(self, dst: int, host: np.ndarray, nbytes: int) -> None:
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        check(self.cudart, self.cudart.cudaMemcpyAsync(dst, host.ctypes.data, nbytes, kind, self.stream), "upload")

    def download(self, host: np.ndarray, src: int, nbytes: int) -> None:
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        check(self.cudart, self.cudart.cudaMemcpyAsync(host.ctypes.data, src, nbytes, kind, self.stream), "download")

    def memset(self, dst: int, nbytes: int) -> None:
        check(self.cudart, self.cudart.cudaMemsetAsync(dst, 0, nbytes, self.stream), "cudaMemsetAsync")

    def copy_3d(self, src: int, dst: int, copy: Copy3D) -> None:
        """A device-to-device cudaMemcpy3DAsync described by `copy`, on the stream."""
        rt = self.cudart
        params = rt.cudaMemcpy3DParms()
        params.srcPtr = rt.make_cudaPitchedPtr(src + copy.src_offset, copy.src_pitch, copy.width, copy.src_ysize)
        params.dstPtr = rt.make_cudaPitchedPtr(dst + copy.dst_offset, copy.dst_pitch, copy.width, copy.dst_ysize)
        params.extent = rt.make_cudaExtent(copy.width, copy.height, copy.depth)
        params.kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        check(rt, rt.cudaMemcpy3DAsync(params, self.stream), "cudaMemcpy3DAsync (KV write-back)")

    def synchronize(self) -> None:
        check(self.cudart, self.cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    def capture(self, enqueue) -> object:
        """Record what `enqueue()` puts on the stream into an instantiated CUDA graph (nothing runs now)."""
        rt = self.cudart
        mode = rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        check(rt, rt.cudaStreamBeginCapture(self.stream, mode), "cudaStreamBeginCapture")
        try:
            enqueue()
        finally:
            graph = check(rt, rt.cudaStreamEndCapture(self.stream), "cudaStreamEndCapture")
        try:
            executable = check(rt, rt.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
        finally:
            check(rt, rt.cudaGraphDestroy(graph), "cudaGraphDestroy")
        self._graphs.append(executable)
        return executable

    def launch(self, executable) -> None:
        check(self.cudart, self.cudart.cudaGraphLaunch(executable, self.stream), "cudaGraphLaunch")

    def close(self) -> None:
        """Free graphs, buffers and the stream (after the stream's work is done)."""
        rt = self.cudart
        if rt is None:
            return
        if self.stream is not None:
            rt.cudaStreamSynchronize(self.stream)
        for executable in self._graphs:
            rt.cudaGraphExecDestroy(executable)
        for ptr in self._device_ptrs:
            rt.cudaFree(ptr)
        for ptr in self._host_ptrs:
            rt.cudaFreeHost(ptr)
        if self.stream is not None:
            rt.cudaStreamDestroy(self.stream)
        self._graphs, self._device_ptrs, self._host_ptrs = [], [], []
        self.stream = None
        self.cudart = None

    def __enter__(self):
        return self.open()

    def __exit__(self, *exc):
        self.close()
