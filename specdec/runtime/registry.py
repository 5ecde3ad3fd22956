"""The backends `specdec.load(backend=...)` can open, by name."""
from __future__ import annotations

from specdec.errors import BackendError
from specdec.runtime.backend import Backend
from specdec.runtime.native_backend import NativeBackend
from specdec.runtime.ort_backend import OrtBackend
from specdec.runtime.trt_backend import TrtBackend

BACKENDS: dict[str, type[Backend]] = {cls.name: cls for cls in (OrtBackend, NativeBackend, TrtBackend)}


def backend_class(name: str) -> type[Backend]:
    if name not in BACKENDS:
        raise BackendError(f"backend={name!r} is not available", f"use one of {', '.join(BACKENDS)}")
    return BACKENDS[name]
