"""Pick the TensorRT plan of a model entry that runs on this GPU and this TensorRT, or say why none does.

A plan runs where its compute capability and TensorRT version fit (docs/backends.md, TensorRT):
- compute capability: equal, unless built with hardware_compatibility="ampere_plus" (then any GPU >= 8.0);
- TensorRT version: equal, unless built version-compatible (then any later runtime version).
Stdlib only; the GPU facts are passed in, so every rule is testable on a CPU.
"""
from __future__ import annotations

from pathlib import Path

from specdec.engines.trt_config import BACKEND, HardwareCompatibility, capability_text, parse_compute_capability
from specdec.errors import BackendError
from specdec.manifest import EngineRecord, ModelEntry, sha256_file

AMPERE = (8, 0)


def rebuild_hint(bundle) -> str:
    return f"build the plans on this machine: specdec-export --out {bundle} --engine tensorrt"


def version_tuple(version: str) -> tuple:
    return tuple(int(part) for part in str(version).split(".") if part.isdigit())


def capability_mismatch(record: EngineRecord, capability: tuple) -> str | None:
    """Why the plan cannot run on a GPU of `capability`, or None."""
    built = parse_compute_capability(record.compute_capability)
    level = record.hardware_compatibility
    if level == HardwareCompatibility.AMPERE_PLUS and built >= AMPERE and capability >= AMPERE:
        return None
    if built == capability:
        return None
    return f"built for compute capability {capability_text(built)}, this GPU is {capability_text(capability)}"


def version_mismatch(record: EngineRecord, trt_version: str) -> str | None:
    """Why the plan cannot run under TensorRT `trt_version`, or None."""
    built = record.tensorrt_version
    if built == trt_version:
        return None
    if record.version_compatible and version_tuple(trt_version) >= version_tuple(built):
        return None
    kind = "version-compatible, needs" if record.version_compatible else "needs exactly"
    return f"built with TensorRT {built} ({kind} that), installed is TensorRT {trt_version}"


def _preference(record: EngineRecord, capability: tuple, trt_version: str) -> tuple:
    """Exact matches first: they carry no compatibility slowdown."""
    exact_gpu = parse_compute_capability(record.compute_capability) == capability
    return (not exact_gpu, record.tensorrt_version != trt_version)


def select_engine(entry: ModelEntry, capability, trt_version: str, bundle="<bundle>") -> EngineRecord:
    """The record of the plan to load for `entry` on a GPU of `capability` under TensorRT `trt_version`."""
    capability = parse_compute_capability(capability)
    records = [r for r in entry.engines if r.backend == BACKEND]
    if not records:
        raise BackendError(
            f"{entry.role} has no TensorRT engine in {bundle} (this GPU: compute capability "
            f"{capability_text(capability)}, TensorRT {trt_version})",
            rebuild_hint(bundle),
        )
    reasons, fits = [], []
    for record in records:
        why = capability_mismatch(record, capability) or version_mismatch(record, trt_version)
        (reasons if why else fits).append(f"{record.path}: {why}" if why else record)
    if not fits:
        raise BackendError(
            f"no TensorRT engine of {entry.role} runs here: " + "; ".join(reasons),
            rebuild_hint(bundle),
        )
    return min(fits, key=lambda r: _preference(r, capability, trt_version))


def check_plan_file(bundle, record: EngineRecord) -> Path:
    """The plan's path after checking it exists and has the recorded sha256."""
    path = Path(bundle) / record.path
    if not path.is_file():
        raise BackendError(f"TensorRT plan {record.path!r} is missing from {bundle}", rebuild_hint(bundle))
    actual = sha256_file(path)
    if actual != record.sha256:
        raise BackendError(
            f"TensorRT plan {record.path!r} has sha256 {actual[:12]}…, "
            f"the manifest records {record.sha256[:12]}…",
            rebuild_hint(bundle),
        )
    return path
