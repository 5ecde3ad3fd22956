"""The backends `specdec.load(backend=...)` can open, by name, and the one place that decides which backend runs a
bundle's target and its draft (no backend imports another).

backend="auto" (the default) opens the cuda backend where the device is a GPU (device="cuda:N", or no device named on a
machine where CuPy sees one) and the bundle carries native weights; on the CPU, the native backend where the bundle
and this machine allow it, else onnxruntime, which runs every CPU bundle; any reason native cannot open (no compiler, no AVX2, no native weights in the bundle, an
unusable cache, a library that will not load) falls back, logged once at WARNING and returned as the note.
SPECDEC_BACKEND=onnxruntime turns the native backend off for the whole process.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

from specdec.errors import BackendError, ConfigError, SpecDecError
from specdec.manifest import Manifest, check_bundle_files
from specdec.native_record import Activations
from specdec.runtime.backend import Backend
from specdec.runtime.config import BackendName, Device
from specdec.runtime.cuda_backend import CudaBackend
from specdec.runtime.native_backend import NativeBackend
from specdec.runtime.ort_backend import OrtBackend
from specdec.runtime.trt_backend import TrtBackend

log = logging.getLogger(__name__)
BACKENDS: dict[str, type[Backend]] = {cls.name: cls for cls in (OrtBackend, NativeBackend, TrtBackend, CudaBackend)}
AUTO = BackendName.AUTO  # cuda on a GPU where it opens; on the CPU native where it opens, else onnxruntime
FALLBACK = OrtBackend  # runs every CPU bundle, and any draft beside any target
BACKEND_ENV = "SPECDEC_BACKEND"  # "onnxruntime": the native backend is off for this process


def backend_class(name: str) -> type[Backend]:
    if name not in BACKENDS:
        raise BackendError(f"backend={name!r} is not available", f"use one of {', '.join(BACKENDS)} or {AUTO}")
    return BACKENDS[name]


def _check_device(cls: type[Backend], device: str) -> None:
    if not device.startswith(cls.devices):
        raise BackendError(f"backend='{cls.name}' does not run on device={device!r}",
                           "use backend='onnxruntime' or 'native' with device='cpu', or backend='cuda' or "
                           "'tensorrt' with device='cuda:N'")


def open_pair(cls: type[Backend], root: Path, manifest: Manifest, device: str, threads: int | None,
              verify: bool = False, target: Backend | None = None) -> tuple:
    """(target, draft or None), opened: the target on `cls`, the draft on `cls` where it runs it beside that target
    (runs_draft), else on onnxruntime. verify: hash the files each backend reads before it opens them. target: an
    unopened target of `cls` built with options of the caller's (else cls.for_target)."""
    _check_device(cls, device)
    if cls is NativeBackend and _native_off():
        raise BackendError(f"the native backend is turned off ({BACKEND_ENV}={os.environ[BACKEND_ENV]})",
                           f"unset {BACKEND_ENV}, or use backend='onnxruntime'")
    if verify:
        cls.check_files(root, manifest.target)
        check_bundle_files(root, manifest, cls.files_read(manifest.target))
    target = (target or cls.for_target(root, manifest.target, device, threads)).open()
    if manifest.draft is None:
        return target, None
    try:
        runner = next(c for c in (cls, FALLBACK) if c.runs_draft(manifest.draft, target))
        if verify:
            runner.check_files(root, manifest.draft)
            check_bundle_files(root, manifest, runner.files_read(manifest.draft))
        return target, runner.for_draft(root, manifest.draft, threads, target).open()
    except BaseException:
        target.close()
        raise


def _native_off() -> bool:
    value = os.environ.get(BACKEND_ENV, "").strip()
    if value and value not in (AUTO, *BACKENDS):
        raise BackendError(f"{BACKEND_ENV}={value!r} names no backend", "set it to onnxruntime, or unset it")
    return bool(value) and BackendName(value) is BackendName.ONNXRUNTIME


def _bf16_runs(isa: str | None) -> bool:
    """Whether the native kernels of `isa` run bf16 activations here (AMX-BF16); False where they cannot load."""
    from specdec.native import build
    from specdec.weight_kinds import Kernel, WeightKind

    try:
        return build.kernel_runs(build.load_kernels(isa), Kernel.BF16A, WeightKind.BF16)
    except (SpecDecError, OSError):
        return False


@functools.cache
def _warn_once(note: str, fallback: str) -> None:
    log.warning("%s; running on %s", note, fallback)


def native_activations(manifest: Manifest, activations: Activations | None, isa: str | None) -> Activations:
    """The native target's activations: those asked for, else the bundle's default, where that is bf16 and this CPU or
    build cannot run it fp32 (with a warning; asked for by name, the backend refuses instead)."""
    mode = Activations(activations or manifest.defaults.activations)
    if activations is None and mode is Activations.BF16 and not _bf16_runs(isa):  # the bundle's, not the caller's
        _warn_once("the bundle's default activations, bf16, need AMX-BF16 tiles, which this CPU or build lacks",
                   "fp32 activations")
        return Activations.FP32
    return mode


def open_backends(root: Path, manifest: Manifest, backend: str, device: str | None, threads: int | None,
                  verify: bool = False, activations: Activations | None = None, pages: str | None = None,
                  isa: str | None = None) -> tuple:
    """(target, draft, the backend's name, why the backend auto wanted did not open, or None) for `specdec.load`;
    verify: hash each file a backend reads before it opens. device None: a GPU where CuPy sees one, else the CPU.
    activations: the native target's (None: the bundle's defaults.activations). Only the native backend has int8
    and bf16 activations: asked for them, any other backend is a ConfigError, and auto opens native or fails; a bundle whose
    default is int8 runs fp32 on the others (the Generator's `activations` says which ran). pages, isa: the native
    backend's (None: its environment's, else its defaults)."""
    def native_target() -> NativeBackend:
        return NativeBackend(root, manifest.target, threads, activations=native_activations(manifest, activations, isa),
                             pages=pages, isa=isa)

    if backend != AUTO:
        cls = backend_class(backend)
        if activations not in (None, Activations.FP32) and cls is not NativeBackend:
            raise ConfigError(f"activations={str(activations)!r} runs on the native backend, not backend={backend!r}",
                              "pass backend='native' (or 'auto'), or activations='fp32'")
        device = device or ("cuda:0" if cls.devices == (Device.CUDA,) else Device.CPU)
        target = native_target() if cls is NativeBackend else None
        return (*open_pair(cls, root, manifest, device, threads, verify, target), backend, None)
    if activations not in (None, Activations.FP32):  # int8 or bf16 asked for: native, or a failure that says why
        _check_device(NativeBackend, device or Device.CPU)
        return (*open_pair(NativeBackend, root, manifest, Device.CPU, threads, verify, native_target()),
                NativeBackend.name, None)
    note = None
    if device is None and gpu_visible() or device is not None and device.startswith(Device.CUDA):
        try:
            return (*open_pair(CudaBackend, root, manifest, device or "cuda:0", threads, verify), CudaBackend.name,
                    None)
        except (SpecDecError, OSError) as exc:  # no CuPy, no GPU, no native weights, too little memory
            note = f"the cuda backend did not open: {getattr(exc, 'message', None) or exc}"
            if device is not None:
                _warn_once(note, "the CPU")
    elif device is not None and device != Device.CPU:
        raise BackendError(f"backend='auto' runs on the CPU or a CUDA GPU, not on {device!r}",
                           "pass device='cpu' or 'cuda:N', or leave device unset")
    try:
        opened = open_pair(NativeBackend, root, manifest, Device.CPU, threads, verify, native_target())
        rows = manifest.target.native_note  # native, but as rows: a GGUF whose blocks no native block holds
        return (*opened, NativeBackend.name, "; ".join(part for part in (note, rows) if part) or None)
    except (SpecDecError, OSError, AttributeError) as exc:  # not this bundle, this machine, or this cache
        native = f"the native backend did not open: {getattr(exc, 'message', None) or exc}"
        note = native if note is None else f"{note}; {native}"
    if not _native_off():
        _warn_once(native, "onnxruntime")
    return (*open_pair(FALLBACK, root, manifest, Device.CPU, threads, verify), FALLBACK.name, note)


def gpu_visible() -> bool:
    """Whether CuPy is installed and sees a GPU (without importing it where it is absent)."""
    import importlib.util

    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        from specdec.cuda.device import gpu_count, import_cupy

        return gpu_count(import_cupy()) > 0
    except SpecDecError:
        return False
