"""Every TensorRT 10-vs-11 difference, in one place (STYLE: version differences are handled once).

TensorRT 10.x: a strongly typed network is asked for with `NetworkDefinitionCreationFlag.STRONGLY_TYPED`.
TensorRT 11.x: strong typing is the only mode (`create_network()` makes a strongly typed network by default)
and the weak-typing builder flags (FP16, INT8, BF16, ...) and INT8 calibrators are gone, so nothing here sets
them: precision comes from the ONNX dtypes and Q/DQ nodes. The rest of the build API used here
(memory pools, builder_optimization_level, VERSION_COMPATIBLE, hardware_compatibility_level, timing caches,
execute_async_v3, set_optimization_profile_async) is documented for both.
Callers import TensorRT only through `import_tensorrt`.
"""
from __future__ import annotations

import logging
from pathlib import Path

from specdec.errors import EngineBuildError, MissingDependencyError, missing_dependency

log = logging.getLogger(__name__)

SUPPORTED_MAJORS = (10, 11)


def import_tensorrt():
    """The `tensorrt` module, or MissingDependencyError naming the extra."""
    try:
        import tensorrt
    except ImportError as exc:
        raise missing_dependency("tensorrt", "tensorrt") from exc
    except OSError as exc:  # the Python package is there but libnvinfer is not loadable
        raise MissingDependencyError(
            f"the 'tensorrt' module is installed but its libraries do not load: {exc}",
            "pip install 'specdec[tensorrt]' in an environment with an NVIDIA driver",
        ) from exc
    major = major_version(tensorrt.__version__)
    if major not in SUPPORTED_MAJORS:
        raise MissingDependencyError(
            f"TensorRT {tensorrt.__version__} is installed; specdec supports TensorRT {SUPPORTED_MAJORS}",
            "pip install 'tensorrt>=10,<12'",
        )
    return tensorrt


def major_version(version: str) -> int:
    head = str(version).split(".")[0]
    return int(head) if head.isdigit() else 0


def create_logger(trt):
    """A TensorRT logger that forwards to Python logging (kept alive by its owner)."""

    class _Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)

        def log(self, severity, msg):
            if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                log.error("TensorRT: %s", msg)
            elif severity == trt.ILogger.Severity.WARNING:
                log.warning("TensorRT: %s", msg)
            else:
                log.debug("TensorRT: %s", msg)

    return _Logger()


def strongly_typed_network(trt, builder):
    """An empty strongly typed network definition."""
    if major_version(trt.__version__) >= 11:
        return builder.create_network(0)  # strongly typed is the only (and default) mode
    flag = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    return builder.create_network(flag)


def apply_builder_options(trt, config, build) -> None:
    """Workspace, optimization level, compatibility options and TF32 from a BuildConfig onto an IBuilderConfig."""
    if build.workspace_bytes is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, build.workspace_bytes)
    config.builder_optimization_level = build.builder_optimization_level
    if build.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    # a HardwareCompatibility member is named as TensorRT names its level
    level = getattr(trt.HardwareCompatibilityLevel, build.hardware_compatibility.name, None)
    if level is None:
        raise EngineBuildError(
            f"hardware compatibility {build.hardware_compatibility.value!r} is not offered by TensorRT "
            f"{trt.__version__}",
            "use hardware_compatibility='none' or 'ampere_plus', or upgrade TensorRT",
        )
    config.hardware_compatibility_level = level
    tf32 = getattr(trt.BuilderFlag, "TF32", None)
    if tf32 is not None and not build.allow_tf32:
        config.clear_flag(tf32)  # fp32 graphs keep fp32 matmuls: greedy output matches onnxruntime CPU


def load_timing_cache(config, path: Path | None):
    """Attach the timing cache at `path` (empty when the file does not exist yet); returns the cache."""
    data = path.read_bytes() if path is not None and path.is_file() else b""
    cache = config.create_timing_cache(data)
    config.set_timing_cache(cache, ignore_mismatch=False)
    return cache


def save_timing_cache(config, path: Path | None) -> None:
    if path is None:
        return
    cache = config.get_timing_cache()
    if cache is None:
        return
    from specdec.publish import write_atomic

    write_atomic(path, bytes(memoryview(cache.serialize())))


def create_runtime(trt, logger, version_compatible: bool):
    """A runtime that may run the lean runtime embedded in a version-compatible plan (trusted plans only)."""
    runtime = trt.Runtime(logger)
    if version_compatible:
        runtime.engine_host_code_allowed = True
    return runtime
