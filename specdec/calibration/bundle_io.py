"""Bundles written by calibration: a copy of a bundle with one model replaced by a quantized graph,
and the atomic rewrite of manifest.json (hashes of model files stay valid: those files are not touched)."""
from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

from specdec.calibration.data import DataConfig, describe_source, split_texts, texts_from_source, token_windows
from specdec.calibration.quantize import Method, QuantizeConfig, check_lowering, quantize_onnx
from specdec.calibration.reader import StaticKVReader
from specdec.errors import ConfigError
from specdec.publish import check_destination, staged_bundle, write_atomic
from specdec.manifest import (
    MANIFEST_NAME,
    CalibrationRecord,
    Manifest,
    ModelEntry,
    Precision,
    Role,
    json_from_manifest,
    read_manifest,
    sha256_file,
    validate_manifest,
)

log = logging.getLogger(__name__)

SOURCES = (Role.TARGET.value, Role.DRAFT.value)  # the fp32 model of the input bundle that is quantized


def write_manifest(bundle: Path, manifest: Manifest) -> None:
    """Validate and replace bundle/manifest.json atomically."""
    validate_manifest(manifest)
    write_atomic(Path(bundle) / MANIFEST_NAME, json_from_manifest(manifest))


def _copy_tree(src: Path, dest: Path, skip: str) -> None:
    """Copy every file of src into dest, except the folder `skip`. Not hard links: onnx refuses to load external
    data from a file with several links (its hard-link attack check)."""
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        if rel.parts[0] == skip or rel.name == MANIFEST_NAME or path.is_dir():
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)


def calibration_windows(bundle: Path, data: DataConfig):
    """(calibration windows [N, W], held-out texts) tokenized with the bundle's tokenizer."""
    from specdec.runtime.text import TextCodec

    codec = TextCodec(bundle).open()
    calibration, held_out = split_texts(texts_from_source(data.source, data.field), data.held_out)
    return token_windows(calibration, codec.encode, data.seq_len, data.num_samples, data.source), held_out


def _head_tokens(bundle: Path, manifest: Manifest, entry: ModelEntry, config: QuantizeConfig):
    """Token ids of a trimmed draft head, ranked by `entry` over the calibration (not held-out) texts."""
    from specdec.calibration.head_trim import kept_tokens
    from specdec.runtime.text import TextCodec

    codec = TextCodec(bundle).open()
    texts, _ = split_texts(texts_from_source(config.data.source, config.data.field), config.data.held_out)
    return kept_tokens(bundle, manifest, entry, [codec.encode(text) for text in texts], config.head_tokens)


def _entry_for(source: ModelEntry, root: Path, config: QuantizeConfig, record: CalibrationRecord) -> ModelEntry:
    """The quantized model's entry: the source's dims, sizes and lowering, with new files, precision and record."""
    files = {f"{config.role}/{p.name}": sha256_file(p) for p in sorted((root / config.role).iterdir()) if p.is_file()}
    derived = f"{source.derived}+{config.method}" if source.derived else config.method
    return dataclasses.replace(
        source, role=config.role, derived=derived, precision=config.precision, onnx_path=f"{config.role}/model.onnx",
        files=files, size_bytes=sum((root / rel).stat().st_size for rel in files), parity=[],
        parity_note="informational: quantized graph; see `specdec calibrate report`", engines=[], calibration=record,
        sizes={rel: (root / rel).stat().st_size for rel in files},
    )


def _native_draft(root: Path, manifest: Manifest, source: ModelEntry, config: QuantizeConfig, keep):
    """The native weights of an int4-q41 draft of a target that has native weights (written into root/draft/), or
    None: the native engine runs such a draft on its target's Q4_1 blocks (fitted where the target keeps rows), in
    pairs, with the draft's trimmed head."""
    target = manifest.target.native
    if config.method != Method.INT4_Q41 or config.role != Role.DRAFT or source.role != Role.TARGET or target is None:
        return None
    from specdec.weights_file import TensorEntry, read_tensors
    from specdec.calibration.q41 import HEAD_FILL
    from specdec.export.native_pack import write_draft

    index = {name: TensorEntry(spec["kind"], tuple(spec["shape"]), spec["offset"]) for name, spec in target.tensors.items()}
    return write_draft(root, config.role, target.layout, read_tensors(root / target.path, index), keep, HEAD_FILL)


def source_entry(manifest: Manifest, bundle: Path, config: QuantizeConfig, source: str) -> ModelEntry:
    """The fp32 model of `bundle` that `config` quantizes: its target, or (source='draft') its draft."""
    if source not in SOURCES:
        raise ConfigError(f"quantization source {source!r} is unknown", "use --source target or --source draft")
    if source == Role.DRAFT and config.role != Role.DRAFT:
        raise ConfigError(f"--source draft with --role {config.role}", "a quantized draft can only replace the draft: "
                          "use --role draft, or --source target to quantize the target")
    entry = manifest.models.get(source)
    if entry is None:
        raise ConfigError(f"{bundle} has no {source} to quantize",
                          "export one first (specdec-export --draft-layers K), or use --source target")
    if entry.precision != Precision.FP32:
        how = ("export it with --draft-layers K or --draft MODEL" if source == Role.DRAFT
               else "specdec-export --dtype fp32")
        raise ConfigError(f"the {source} of {bundle} is {entry.precision} ({entry.derived or 'exported'})",
                          f"quantize from a bundle whose {source} is fp32 ({how})")
    return entry


def quantized_bundle(bundle: Path, out: Path, config: QuantizeConfig, overwrite: bool = False,
                     source: Role = Role.TARGET) -> Path:
    """Copy `bundle` to `out` with its `config.role` model replaced by its fp32 `source` model (target or draft)
    quantized with `config`."""
    bundle, out = Path(bundle), Path(out)
    manifest = read_manifest(bundle)
    entry = source_entry(manifest, bundle, config, source)
    check_lowering(config, entry.lowering)
    check_destination(out, overwrite, sources=[bundle])
    with staged_bundle(out) as tmp:
        _copy_tree(bundle, tmp, config.role)
        windows, _ = calibration_windows(bundle, config.data)
        graph = bundle / entry.onnx_path
        reader = StaticKVReader(graph, entry, windows, config.verify_len) if config.needs_data else None
        keep = _head_tokens(bundle, manifest, entry, config) if config.head_tokens else None
        details = quantize_onnx(graph, tmp / config.role / "model.onnx", config, reader, keep)
        if keep is not None:
            details["lm_head"]["ranked_by"] = (f"{entry.role}'s probability mass over the calibration texts "
                                               f"({config.data.source}; held-out texts excluded)")
        origin = f"fp32 {source}" + (f", {entry.derived}" if entry.derived else "")
        record = CalibrationRecord(
            method=config.method, precision=config.precision, backend=config.backend,
            origin=f"{entry.onnx_path} ({origin})", details=details,
            data=describe_source(config.data, windows) if config.needs_data else None,
            accuracy_level=config.accuracy_level if config.precision == Precision.INT4 else None)
        native = _native_draft(tmp, manifest, entry, config, keep)
        models = {**manifest.models, config.role: dataclasses.replace(_entry_for(entry, tmp, config, record),
                                                                      native=native)}
        write_manifest(tmp, dataclasses.replace(manifest, models=models))
    return out
