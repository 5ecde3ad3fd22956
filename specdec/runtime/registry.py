"""The backends `specdec.load(backend=...)` can open, by name, and the one place that decides which backend runs a
bundle's target and its draft (no backend imports another).

backend="auto" (the default) opens the native backend where the bundle and this machine allow it, else onnxruntime,
which runs every CPU bundle; any reason native cannot open (no compiler, no AVX2, no native weights in the bundle, an
unusable cache, a library that will not load) falls back, logged once at WARNING and returned as the note.
SPECDEC_BACKEND=onnxruntime turns the native backend off for the whole process.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

from specdec.errors import BackendError, SpecDecError
from specdec.manifest import Manifest, check_bundle_files
from specdec.runtime.backend import Backend
from specdec.runtime.native_backend import NativeBackend
from specdec.runtime.ort_backend import OrtBackend
from specdec.runtime.trt_backend import TrtBackend

log = logging.getLogger(__name__)
BACKENDS: dict[str, type[Backend]] = {cls.name: cls for cls in (OrtBackend, NativeBackend, TrtBackend)}
AUTO = "auto"  # native where it opens, else onnxruntime
FALLBACK = OrtBackend  # runs every CPU bundle, and any draft beside any target
BACKEND_ENV = "SPECDEC_BACKEND"  # "onnxruntime": the native backend is off for this process


def backend_class(name: str) -> type[Backend]:
    if name not in BACKENDS:
        raise BackendError(f"backend={name!r} is not available", f"use one of {', '.join(BACKENDS)} or {AUTO}")
    return BACKENDS[name]


def _check_device(cls: type[Backend], device: str) -> None:
    if not device.startswith(cls.devices):
        raise BackendError(f"backend={cls.name!r} does not run on device={device!r}",
                           "use backend='onnxruntime' or 'native' with device='cpu', or backend='tensorrt' with "
                           "device='cuda:N'")


def open_pair(cls: type[Backend], root: Path, manifest: Manifest, device: str, threads: int | None,
              verify: bool = False) -> tuple:
    """(target, draft or None), opened: the target on `cls`, the draft on `cls` where it runs it beside that target
    (runs_draft), else on onnxruntime. verify: hash the files each backend reads before it opens them."""
    _check_device(cls, device)
    if cls is NativeBackend and _native_off():
        raise BackendError(f"the native backend is turned off ({BACKEND_ENV}={os.environ[BACKEND_ENV]})",
                           f"unset {BACKEND_ENV}, or use backend='onnxruntime'")
    if verify:
        check_bundle_files(root, manifest, cls.files_read(manifest.target))
    target = cls.for_target(root, manifest.target, device, threads).open()
    if manifest.draft is None:
        return target, None
    try:
        runner = next(c for c in (cls, FALLBACK) if c.runs_draft(manifest.draft, target))
        if verify:
            check_bundle_files(root, manifest, runner.files_read(manifest.draft))
        return target, runner.for_draft(root, manifest.draft, threads, target).open()
    except BaseException:
        target.close()
        raise


def _native_off() -> bool:
    value = os.environ.get(BACKEND_ENV, "").strip()
    if value and value not in (AUTO, *BACKENDS):
        raise BackendError(f"{BACKEND_ENV}={value!r} names no backend", "set it to onnxruntime, or unset it")
    return value == OrtBackend.name


@functools.cache
def _warn_once(note: str) -> None:
    log.warning("%s; running on onnxruntime", note)


def open_backends(root: Path, manifest: Manifest, backend: str, device: str, threads: int | None,
                  verify: bool = False) -> tuple:
    """(target, draft, the backend's name, why native did not open or None) for `specdec.load`; verify: hash each
    file a backend reads before it opens."""
    if backend != AUTO:
        return (*open_pair(backend_class(backend), root, manifest, device, threads, verify), backend, None)
    if device != "cpu":
        raise BackendError(f"backend='auto' runs on the CPU, not on {device!r}",
                           "pass backend='tensorrt' for a GPU, or leave device unset")
    try:
        return (*open_pair(NativeBackend, root, manifest, device, threads, verify), NativeBackend.name, None)
    except (SpecDecError, OSError, AttributeError) as exc:  # not this bundle, this machine, or this cache
        note = f"the native backend did not open: {getattr(exc, 'message', None) or exc}"
    if not _native_off():
        _warn_once(note)
    return (*open_pair(FALLBACK, root, manifest, device, threads, verify), FALLBACK.name, note)
