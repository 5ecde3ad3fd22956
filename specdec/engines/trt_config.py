"""TensorRT build options, optimization profiles, plan names, manifest records and engine selection.

No GPU module: the builder (specdec.engines.tensorrt) and the runtime (specdec.runtime.trt_backend) share it, and
every function here is testable without TensorRT or a GPU.

One engine serves one model with two optimization profiles (docs/backends.md), B from 1 to max_batch and S static:
  profile 0 "prefill": T 1..max_prefill_chunk (opt max_prefill_chunk)
  profile 1 "step":    T 1..gamma_max+1 (opt gamma+1 for the target, 1 for the draft, which decodes one token)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import BackendError, ConfigError, EngineBuildError
from specdec.lowering import LOWERINGS
from specdec.manifest import (ROLES, EngineBackend, EngineRecord, HardwareCompatibility, LoweringName, Manifest,
                              ModelEntry, Profile, Role)

BACKEND = EngineBackend.TENSORRT
PROFILE_NAMES = tuple(Profile)  # optimization profile indices 0 and 1, in this order
INPUT_NAMES, OUTPUT_NAMES = (tuple(names) for names in LOWERINGS[LoweringName.PLAIN].io_names(0))  # TensorRT's input


HARDWARE_COMPATIBILITY = tuple(level.value for level in HardwareCompatibility)  # plain strings: argparse prints them


@dataclass(frozen=True)
class BuildConfig:
    """Options of one TensorRT build; checked once here."""

    max_batch: int
    max_prefill_chunk: int
    gamma: int
    gamma_max: int
    max_seq_len: int
    opt_batch: int = 1  # the batch TensorRT tunes kernels for (latency: 1)
    version_compatible: bool = False  # plan runs on later TensorRT versions (lean runtime embedded, slower)
    hardware_compatibility: HardwareCompatibility = HardwareCompatibility.NONE
    timing_cache: Path | None = None  # reused and updated across builds
    workspace_bytes: int | None = None  # None: TensorRT's default (the device's memory)
    builder_optimization_level: int = 3  # 0..5; higher builds longer and may run faster
    allow_tf32: bool = False  # fp32 graphs: TF32 matmuls are faster but no longer match onnxruntime CPU

    def __post_init__(self):
        for name in ("max_batch", "max_prefill_chunk", "gamma", "gamma_max", "max_seq_len", "opt_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"BuildConfig.{name} must be a positive integer, got {value!r}",
                                  f"pass {name}=1 or more")
        if not 1 <= self.gamma <= self.gamma_max:
            raise ConfigError(f"gamma {self.gamma} is outside 1..gamma_max={self.gamma_max}",
                              "lower gamma or raise gamma_max")
        for name, limit in (("gamma_max + 1", self.gamma_max + 1), ("max_prefill_chunk", self.max_prefill_chunk)):
            if limit > self.max_seq_len:
                raise ConfigError(f"{name} = {limit} exceeds max_seq_len {self.max_seq_len}",
                                  f"lower {name.split()[0]} or re-export with a larger --max-seq-len")
        if self.opt_batch > self.max_batch:
            raise ConfigError(f"opt_batch {self.opt_batch} exceeds max_batch {self.max_batch}", "lower opt_batch")
        self._check_options()

    def _check_options(self):
        if self.hardware_compatibility not in HARDWARE_COMPATIBILITY:
            raise ConfigError(
                f"hardware_compatibility {self.hardware_compatibility!r} is unknown",
                f"choose one of {', '.join(HARDWARE_COMPATIBILITY)}",
            )
        object.__setattr__(self, "hardware_compatibility", HardwareCompatibility(self.hardware_compatibility))
        workspace = self.workspace_bytes
        if workspace is not None and (not isinstance(workspace, int) or workspace <= 0):
            raise ConfigError(f"workspace_bytes must be a positive integer, got {workspace!r}",
                              "pass None for TensorRT's default")
        if self.builder_optimization_level not in range(6):
            raise ConfigError(
                f"builder_optimization_level {self.builder_optimization_level!r} is outside 0..5",
                "TensorRT's default is 3"
            )
        if self.timing_cache is not None:
            object.__setattr__(self, "timing_cache", Path(self.timing_cache))


def build_config_for(manifest: Manifest, **overrides) -> BuildConfig:
    """A BuildConfig from the bundle's defaults and target entry; keyword arguments override any field."""
    defaults, target = manifest.defaults, manifest.target
    values = dict(
        max_batch=target.max_batch, max_prefill_chunk=defaults.max_prefill_chunk, gamma=defaults.gamma,
        gamma_max=defaults.gamma_max, max_seq_len=target.max_seq_len,
    )
    values.update(overrides)
    return BuildConfig(**values)


def check_fits(build: BuildConfig, entry: ModelEntry) -> None:
    """The profiles must stay inside what the ONNX graph was exported for."""
    if build.max_seq_len != entry.max_seq_len:
        raise EngineBuildError(
            f"BuildConfig.max_seq_len {build.max_seq_len} differs from {entry.role}'s static S {entry.max_seq_len}",
            "S is static in the graph; build with max_seq_len equal to the bundle's (or re-export with --max-seq-len)",
        )
    if build.max_batch > entry.max_batch:
        raise EngineBuildError(
            f"BuildConfig.max_batch {build.max_batch} exceeds {entry.role}'s exported max_batch {entry.max_batch}",
            "lower max_batch or re-export with a larger --max-batch",
        )


# --- optimization profiles ----------------------------------------------------------------------------------
def _ranges(entry: ModelEntry, batch: tuple, tokens: tuple) -> dict:
    """{input name: {"min": shape, "opt": shape, "max": shape}} for batch=(min, opt, max), tokens=(min, opt, max)."""
    d = entry.dims
    shapes = {
        "input_ids": lambda b, t: (b, t),  # [B, T]
        "cache_len": lambda b, t: (b,),  # [B]
        "past_keys": lambda b, t: (d.num_layers, b, d.num_kv_heads, entry.max_seq_len, d.head_dim),  # [L,B,Hkv,S,D]
        "past_values": lambda b, t: (d.num_layers, b, d.num_kv_heads, entry.max_seq_len, d.head_dim),
    }
    return {
        name: {key: shape(b, t) for key, b, t in zip(("min", "opt", "max"), batch, tokens, strict=True)}
        for name, shape in shapes.items()
    }


def step_opt_tokens(build: BuildConfig, role: str) -> int:
    """The verify pass feeds γ+1 tokens; the draft decodes one token per call."""
    return 1 if role == Role.DRAFT else build.gamma + 1


def optimization_profiles(build: BuildConfig, entry: ModelEntry) -> dict:
    """{"prefill": ranges, "step": ranges} in profile-index order; shapes are tuples."""
    check_fits(build, entry)
    batch = (1, build.opt_batch, build.max_batch)
    prefill = (1, build.max_prefill_chunk, build.max_prefill_chunk)
    step = (1, step_opt_tokens(build, entry.role), build.gamma_max + 1)
    return {Profile.PREFILL: _ranges(entry, batch, prefill), Profile.STEP: _ranges(entry, batch, step)}


def token_limits(profiles: dict) -> dict:
    """{profile name: (min T, max T)} from profiles (tuples or the lists of a manifest record)."""
    return {name: (int(r["input_ids"]["min"][1]), int(r["input_ids"]["max"][1])) for name, r in profiles.items()}


def profile_for(profiles: dict, steps: int) -> int:
    """Index of the profile that runs T=steps: the step profile when it can (its CUDA graphs are reused)."""
    limits = token_limits(profiles)
    for name in (Profile.STEP, Profile.PREFILL):
        low, high = limits[name]
        if low <= steps <= high:
            return PROFILE_NAMES.index(name)
    largest = max(high for _, high in limits.values())
    raise BackendError(
        f"a forward of T={steps} tokens exceeds the engine's profiles (largest T {largest})",
        "feed prompts in chunks of at most max_prefill_chunk, or rebuild the engine with a larger chunk",
    )


# --- plan names and manifest records -------------------------------------------------------------------------
def parse_compute_capability(value) -> tuple:
    """(major, minor) from (9, 0), "9.0" or "sm90"-style input."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return int(value[0]), int(value[1])
    text = str(value)
    if "." in text:
        major, minor = text.split(".", 1)
        if major.isdigit() and minor.isdigit():
            return int(major), int(minor)
    raise ConfigError(f"compute capability {value!r} is not of the form (major, minor) or 'major.minor'", "e.g. (9, 0)")


def capability_text(capability) -> str:
    major, minor = parse_compute_capability(capability)
    return f"{major}.{minor}"


def plan_name(role: str, capability, trt_version: str) -> str:
    """engines/<role>.sm<major><minor>.trt<version>.plan, relative to the bundle."""
    if role not in ROLES:
        raise ConfigError(f"role {role!r} is unknown", f"one of {ROLES}")
    if not trt_version or any(c not in "0123456789." for c in trt_version):
        raise ConfigError(f"TensorRT version {trt_version!r} is not a dotted number", "pass tensorrt.__version__")
    major, minor = parse_compute_capability(capability)
    return f"engines/{role}.sm{major}{minor}.trt{trt_version}.plan"


def _jsonable(value):
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(item) for item in value]
    return value


def engine_record(build: BuildConfig, entry: ModelEntry, capability, trt_version: str, sha256: str) -> EngineRecord:
    """The manifest record of one built plan (its profiles JSON-ready: lists, strings, numbers)."""
    return EngineRecord(
        backend=BACKEND,
        path=plan_name(entry.role, capability, trt_version),
        compute_capability=capability_text(capability),
        tensorrt_version=trt_version,
        sha256=sha256,
        profiles=_jsonable(optimization_profiles(build, entry)),
        profile_order=list(PROFILE_NAMES),
        version_compatible=build.version_compatible,
        hardware_compatibility=build.hardware_compatibility,
        max_batch=build.max_batch,
    )


def with_engine(entry: ModelEntry, record: EngineRecord) -> ModelEntry:
    """The entry with `record` added, replacing any earlier record for the same plan path."""
    kept = [r for r in entry.engines if r.path != record.path]
    return dataclasses.replace(entry, engines=kept + [record])
