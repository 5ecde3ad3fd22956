"""A CPU stand-in for the parts of the `tensorrt` and cuda-python (`cuda.bindings.runtime`) APIs that
specdec.engines and TrtBackend call. A TEST DOUBLE: it exercises specdec's own glue (signatures, buffers, profile
choice, KV write-back, graph capture) and is never evidence that TensorRT works.

- "Device" memory is host memory (numpy buffers addressed by their real pointers), so copies are memmoves.
- A "plan" is JSON that records the ONNX path, the I/O names, the optimization profiles and the TensorRT version
  and compute capability it was built for; deserializing one under another version or GPU fails, as TensorRT does.
- An execution context runs the ONNX with onnxruntime CPU, reading and writing the bound addresses with the set
  input shapes; a shape outside the selected profile is refused (set_input_shape returns False).
- Async calls on a capturing stream are recorded; a graph launch replays them in order.

Installed only by `install(monkeypatch, device)`, into sys.modules while the monkeypatch lasts (the `device` fixture
of tests/engines/test_trt_standin.py, and the gpu_check.py smoke test of tests/bench/test_entry_points.py).
"""
from __future__ import annotations

import ctypes
import enum
import importlib.machinery
import json
import math
import sys
import types
from dataclasses import dataclass, field

import numpy as np

NUMPY = {"tensor(int64)": np.int64, "tensor(float)": np.float32, "tensor(float16)": np.float16}


@dataclass
class Device:
    """What the stand-in reports and records; tests change it to play another GPU or TensorRT."""

    trt_version: str = "10.13.0.35"
    capability: tuple = (8, 9)
    calls: list = field(default_factory=list)  # names of every async call that ran (or was captured)
    buffers: dict = field(default_factory=dict)  # address -> numpy uint8 array that owns it
    streams: dict = field(default_factory=dict)  # handle -> list of captured ops, or None when not capturing


# --- cuda.bindings.runtime -----------------------------------------------------------------------------------
class cudaError_t(enum.IntEnum):  # noqa: N801 (the API's names)
    cudaSuccess = 0
    cudaErrorInvalidValue = 1


def _cuda_module(device: Device) -> types.ModuleType:
    rt = types.ModuleType("cuda.bindings.runtime")
    ok = cudaError_t.cudaSuccess
    rt.cudaError_t = cudaError_t
    rt.cudaDeviceAttr = types.SimpleNamespace(cudaDevAttrComputeCapabilityMajor=75, cudaDevAttrComputeCapabilityMinor=76)
    rt.cudaMemcpyKind = enum.IntEnum("cudaMemcpyKind", "cudaMemcpyHostToDevice cudaMemcpyDeviceToHost "
                                     "cudaMemcpyDeviceToDevice")
    rt.cudaStreamCaptureMode = types.SimpleNamespace(cudaStreamCaptureModeThreadLocal=1)
    rt.cudaStreamNonBlocking = 1

    def alloc(nbytes):
        buffer = np.zeros(nbytes, np.uint8)
        device.buffers[buffer.ctypes.data] = buffer
        return ok, buffer.ctypes.data

    def run_or_capture(stream, name, op):
        captured = device.streams.get(int(stream))
        if captured is not None:
            captured.append((name, op))
        else:
            device.calls.append(name)
            op()
        return (ok,)

    def memcpy_3d(params):
        src, dst, ext = params.srcPtr, params.dstPtr, params.extent
        for z in range(ext.depth):
            for y in range(ext.height):
                ctypes.memmove(dst.ptr + (z * dst.ysize + y) * dst.pitch, src.ptr + (z * src.ysize + y) * src.pitch,
                               ext.width)

    def end_capture(stream):
        ops = device.streams[int(stream)]
        device.streams[int(stream)] = None
        return ok, types.SimpleNamespace(ops=ops)

    def launch(executable, stream):
        for name, op in executable.ops:
            device.calls.append(f"graph:{name}")
            op()
        return (ok,)

    attributes = {75: device.capability[0], 76: device.capability[1]}
    rt.cudaGetErrorName = lambda err: (ok, cudaError_t(err).name.encode())
    rt.cudaGetDeviceCount = lambda: (ok, 1)
    rt.cudaDeviceGetAttribute = lambda attr, index: (ok, attributes[attr])
    rt.cudaSetDevice = lambda index: (ok,)
    rt.cudaStreamCreateWithFlags = lambda flags: _new_stream(device)
    rt.cudaMalloc = alloc
    rt.cudaMallocHost = alloc
    rt.cudaMemcpyAsync = lambda dst, src, n, kind, s: run_or_capture(s, "memcpy", lambda: ctypes.memmove(dst, src, n))
    rt.cudaMemsetAsync = lambda dst, value, n, s: run_or_capture(s, "memset", lambda: ctypes.memset(dst, value, n))
    rt.cudaMemcpy3DParms = lambda: types.SimpleNamespace(srcPtr=None, dstPtr=None, extent=None, kind=None)
    rt.make_cudaPitchedPtr = lambda ptr, pitch, xsize, ysize: types.SimpleNamespace(ptr=ptr, pitch=pitch, ysize=ysize)
    rt.make_cudaExtent = lambda w, h, d: types.SimpleNamespace(width=w, height=h, depth=d)
    rt.cudaMemcpy3DAsync = lambda params, s: run_or_capture(s, "memcpy3d", lambda: memcpy_3d(params))
    rt.cudaStreamSynchronize = lambda s: (ok,)
    rt.cudaStreamBeginCapture = lambda s, mode: (device.streams.__setitem__(int(s), []), (ok,))[1]
    rt.cudaStreamEndCapture = end_capture
    rt.cudaGraphInstantiate = lambda graph, flags: (ok, graph)
    rt.cudaGraphDestroy = lambda graph: (ok,)
    rt.cudaGraphLaunch = launch
    rt.cudaGraphExecDestroy = lambda executable: (ok,)
    rt.cudaFree = lambda ptr: (device.buffers.pop(int(ptr), None), (ok,))[1]
    rt.cudaFreeHost = rt.cudaFree
    rt.cudaStreamDestroy = lambda s: (device.streams.pop(int(s), None), (ok,))[1]
    return rt


def _new_stream(device: Device):
    handle = 0x5000 + len(device.streams) + 1
    device.streams[handle] = None
    return cudaError_t.cudaSuccess, handle


# --- tensorrt ------------------------------------------------------------------------------------------------
class ILogger:
    Severity = enum.IntEnum("Severity", "INTERNAL_ERROR ERROR WARNING INFO VERBOSE")

    def __init__(self):
        pass


@dataclass
class Network:
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    onnx: str = ""

    @property
    def num_inputs(self):
        return len(self.inputs)

    @property
    def num_outputs(self):
        return len(self.outputs)

    def get_input(self, i):
        return types.SimpleNamespace(name=self.inputs[i])

    def get_output(self, i):
        return types.SimpleNamespace(name=self.outputs[i])


class OnnxParser:
    """Parses standard ONNX; like TensorRT, it refuses onnxruntime's com.microsoft ops (MatMulNBits, GQA)."""

    def __init__(self, network: Network, logger):
        self.network = network
        self.errors = []

    def parse_from_file(self, path: str) -> bool:
        import onnx

        model = onnx.load(path, load_external_data=False)
        contrib = sorted({n.op_type for n in model.graph.node if n.domain == "com.microsoft"})
        if contrib:
            self.errors = [f"No importer registered for op: {op} (domain com.microsoft)" for op in contrib]
            return False
        self.network.inputs = [i.name for i in model.graph.input]
        self.network.outputs = [o.name for o in model.graph.output]
        self.network.onnx = path
        return True

    @property
    def num_errors(self):
        return len(self.errors)

    def get_error(self, i):
        return self.errors[i]


class BuilderConfig:
    def __init__(self):
        self.profiles, self.flags, self.pools = [], set(), {}
        self.builder_optimization_level = 3
        self.hardware_compatibility_level = None
        self.cache = None

    def set_memory_pool_limit(self, pool, size):
        self.pools[pool] = size

    def set_flag(self, flag):
        self.flags.add(flag)

    def clear_flag(self, flag):
        self.flags.discard(flag)

    def add_optimization_profile(self, profile) -> int:
        self.profiles.append(profile)
        return len(self.profiles) - 1

    def create_timing_cache(self, data: bytes):
        return types.SimpleNamespace(serialize=lambda: bytes(data) or b"timing-cache")

    def set_timing_cache(self, cache, ignore_mismatch: bool) -> bool:
        self.cache = cache
        return True

    def get_timing_cache(self):
        return self.cache


class Profile:
    def __init__(self):
        self.shapes = {}

    def set_shape(self, name, low, opt, high):
        self.shapes[name] = [list(low), list(opt), list(high)]


def _tensorrt_module(device: Device) -> types.ModuleType:
    trt = types.ModuleType("tensorrt")
    trt.__version__ = device.trt_version
    trt.ILogger = ILogger
    trt.NetworkDefinitionCreationFlag = enum.IntEnum("NetworkDefinitionCreationFlag", {"STRONGLY_TYPED": 5})
    trt.MemoryPoolType = enum.Enum("MemoryPoolType", "WORKSPACE")
    trt.BuilderFlag = enum.Enum("BuilderFlag", "VERSION_COMPATIBLE TF32")
    trt.HardwareCompatibilityLevel = enum.Enum("HardwareCompatibilityLevel", "NONE AMPERE_PLUS SAME_COMPUTE_CAPABILITY")
    trt.OnnxParser = OnnxParser

    class Builder:
        def __init__(self, logger):
            self.logger = logger

        def create_network(self, flags=0):
            return Network()

        def create_builder_config(self):
            return BuilderConfig()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network: Network, config: BuilderConfig):
            plan = {"onnx": network.onnx, "inputs": network.inputs, "outputs": network.outputs,
                    "profiles": [p.shapes for p in config.profiles], "trt_version": device.trt_version,
                    "capability": list(device.capability)}
            return json.dumps(plan).encode()

    class Runtime:
        def __init__(self, logger):
            self.logger = logger
            self.engine_host_code_allowed = False

        def deserialize_cuda_engine(self, data: bytes):
            plan = json.loads(bytes(data))
            if plan["trt_version"] != device.trt_version or tuple(plan["capability"]) != device.capability:
                return None  # TensorRT refuses a plan from another version or GPU
            return Engine(plan, device)

    trt.Builder, trt.Runtime = Builder, Runtime
    return trt


class Engine:
    def __init__(self, plan: dict, device: Device):
        self.plan, self.device = plan, device
        self.names = plan["inputs"] + plan["outputs"]

    @property
    def num_io_tensors(self):
        return len(self.names)

    def get_tensor_name(self, i):
        return self.names[i]

    @property
    def num_optimization_profiles(self):
        return len(self.plan["profiles"])

    def create_execution_context(self):
        return ExecutionContext(self)


class ExecutionContext:
    """Runs the plan's ONNX with onnxruntime CPU on the bound addresses."""

    def __init__(self, engine: Engine):
        import onnxruntime as ort

        self.engine = engine
        self.session = ort.InferenceSession(engine.plan["onnx"], providers=["CPUExecutionProvider"])
        self.types = {t.name: NUMPY[t.type] for t in (*self.session.get_inputs(), *self.session.get_outputs())}
        self.profile, self.shapes, self.addresses = 0, {}, {}

    def set_optimization_profile_async(self, index: int, stream) -> bool:
        if not 0 <= index < self.engine.num_optimization_profiles:
            return False
        self.profile = index
        return True

    def set_input_shape(self, name: str, shape) -> bool:
        low, _, high = self.engine.plan["profiles"][self.profile][name]
        if len(shape) != len(low) or any(not lo <= s <= hi for s, lo, hi in zip(shape, low, high)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, address: int) -> bool:
        self.addresses[name] = int(address)
        return True

    def _array(self, name: str, shape: tuple) -> np.ndarray:
        dtype = np.dtype(self.types[name])
        raw = (ctypes.c_byte * (math.prod(shape) * dtype.itemsize)).from_address(self.addresses[name])
        return np.frombuffer(raw, dtype=dtype).reshape(shape)

    def _run(self) -> None:
        feeds = {name: self._array(name, self.shapes[name]).copy() for name in self.engine.plan["inputs"]}
        for name, value in zip(self.engine.plan["outputs"], self.session.run(None, feeds)):
            self._array(name, value.shape)[...] = value

    def execute_async_v3(self, stream) -> bool:
        captured = self.engine.device.streams.get(int(stream))
        if captured is not None:
            captured.append(("execute", self._run))
        else:
            self.engine.device.calls.append("execute")
            self._run()
        return True


def install(monkeypatch, device: Device) -> Device:
    """Put the stand-in modules into sys.modules for the current test (monkeypatch undoes it)."""
    runtime = _cuda_module(device)
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = runtime
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    for name, module in (("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.runtime", runtime),
                         ("tensorrt", _tensorrt_module(device))):
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec callers see a module
        monkeypatch.setitem(sys.modules, name, module)
    return device
