"""TensorRT plans from a bundle's ONNX graphs: `build_engine` (one plan) and `build_bundle_engines` (a bundle).

A plan is a strongly typed network (precision comes from the ONNX dtypes and Q/DQ nodes) with two optimization
profiles (prefill, step; see specdec.engines.trt_config), built with a reused timing cache and the version /
hardware compatibility options of the BuildConfig. Plans are keyed by GPU compute capability and TensorRT
version and recorded in the manifest; they are built on the GPU that will run them.
Needs TensorRT (10.x or 11.x) and cuda-python: `pip install 'specdec[tensorrt]'`.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from specdec.engines.cuda_glue import compute_capability
from specdec.engines.trt_compat import (
    apply_builder_options,
    create_logger,
    import_tensorrt,
    load_timing_cache,
    save_timing_cache,
    strongly_typed_network,
)
from specdec.engines.trt_config import (
    INPUT_NAMES,
    OUTPUT_NAMES,
    PROFILE_NAMES,
    BuildConfig,
    build_config_for,
    engine_record,
    optimization_profiles,
    plan_name,
    with_engine,
)
from specdec.errors import EngineBuildError
from specdec.lowering import lowering_for
from specdec.publish import write_atomic
from specdec.manifest import (
    MANIFEST_NAME,
    ModelEntry,
    Precision,
    check_bundle_files,
    json_from_manifest,
    read_manifest,
    sha256_file,
)

log = logging.getLogger(__name__)

__all__ = ["BuildConfig", "build_engine", "build_bundle_engines", "build_config_for", "optimization_profiles"]


def _parse_onnx(trt, network, logger, onnx_path: Path) -> object:
    """Parse the ONNX file (external weights beside it) into `network`; returns the parser (keep it alive)."""
    if not onnx_path.is_file():
        raise EngineBuildError(f"ONNX graph {str(onnx_path)!r} does not exist", "re-export the bundle")
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        text = "; ".join(errors)[:1500]
        hint = "check the graph with `specdec inspect`; TensorRT parses standard ONNX ops only"
        if "MatMulNBits" in text or "com.microsoft" in text:
            hint = ("onnxruntime's MatMulNBits (the int4 draft) has no TensorRT parser: "
                    "export the draft with --draft-layers K")
        raise EngineBuildError(f"TensorRT cannot parse {onnx_path.name}: {text}", hint)
    return parser


def _check_io(network, entry: ModelEntry) -> None:
    inputs = tuple(network.get_input(i).name for i in range(network.num_inputs))
    outputs = tuple(network.get_output(i).name for i in range(network.num_outputs))
    if inputs != INPUT_NAMES or outputs != OUTPUT_NAMES:
        raise EngineBuildError(
            f"{entry.role} graph has inputs {inputs} and outputs {outputs}; "
            f"the contract is {INPUT_NAMES} -> {OUTPUT_NAMES}",
            "re-export the bundle with this version of specdec-export",
        )


def _add_profiles(builder, config, profiles: dict) -> None:
    """Profiles in PROFILE_NAMES order, so profile index i is PROFILE_NAMES[i]."""
    for index, name in enumerate(PROFILE_NAMES):
        profile = builder.create_optimization_profile()
        for tensor, shapes in profiles[name].items():
            profile.set_shape(tensor, shapes["min"], shapes["opt"], shapes["max"])
        added = config.add_optimization_profile(profile)
        if added != index:
            raise EngineBuildError(f"TensorRT rejected the {name} optimization profile ({added})",
                                   "run with -v for details")


def build_engine(onnx_path, build: BuildConfig, entry: ModelEntry) -> bytes:
    """Serialized TensorRT plan for `entry`'s graph at `onnx_path` (built on the current GPU)."""
    trt = import_tensorrt()
    profiles = optimization_profiles(build, entry)
    logger = create_logger(trt)
    builder = trt.Builder(logger)
    network = strongly_typed_network(trt, builder)
    parser = _parse_onnx(trt, network, logger, Path(onnx_path))
    _check_io(network, entry)
    config = builder.create_builder_config()
    apply_builder_options(trt, config, build)
    _add_profiles(builder, config, profiles)
    load_timing_cache(config, build.timing_cache)
    started = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineBuildError(
            f"TensorRT could not build {entry.role} (see the TensorRT errors logged above)",
            "run with -v; lower max_batch or max_prefill_chunk, or raise workspace_bytes",
        )
    log.info("built %s plan in %.1f s", entry.role, time.perf_counter() - started)
    save_timing_cache(config, build.timing_cache)
    del parser
    return bytes(memoryview(plan))


def check_buildable(entry: ModelEntry) -> None:
    lowering_for(entry.lowering).check_tensorrt(entry.role)
    if entry.precision == Precision.INT4:  # every int4 method (export's, calibrate's RTN/HQQ/GPTQ/Q4_1): MatMulNBits
        raise EngineBuildError(
            f"{entry.role} is an int4 model ({entry.derived}) made of onnxruntime's MatMulNBits, which TensorRT "
            "does not parse",
            "build only the target (roles=('target',)), or export the draft with --draft-layers K",
        )


def build_bundle_engines(bundle, build: BuildConfig | None = None, roles=None, device: int = 0) -> list:
    """Build a plan per role (default: every model) into bundle/engines/, record them in the manifest.

    Returns the new engine records. The default BuildConfig comes from the manifest; the timing cache is
    bundle/engines/timing.cache unless the BuildConfig names one."""
    root = Path(bundle)
    manifest = read_manifest(root)
    check_bundle_files(root, manifest)
    build = build or build_config_for(manifest)
    if build.timing_cache is None:  # reused by every later build of this bundle
        build = dataclasses.replace(build, timing_cache=root / "engines" / "timing.cache")
    trt = import_tensorrt()
    capability = compute_capability(device)
    roles = tuple(roles or manifest.models)
    for role in roles:
        if role not in manifest.models:
            raise EngineBuildError(f"the bundle has no {role} model", f"roles are {sorted(manifest.models)}")
        check_buildable(manifest.models[role])
    models, records = dict(manifest.models), []
    for role in roles:
        entry = models[role]
        plan = root / plan_name(role, capability, trt.__version__)
        write_atomic(plan, build_engine(root / entry.onnx_path, build, entry))
        record = engine_record(build, entry, capability, trt.__version__, sha256_file(plan))
        models[role] = with_engine(entry, record)
        records.append(record)
    updated = dataclasses.replace(manifest, models=models)
    write_atomic(root / MANIFEST_NAME, json_from_manifest(updated).encode("utf-8"))
    return records
