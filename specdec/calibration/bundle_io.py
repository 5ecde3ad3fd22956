"""Bundles written by calibration: a copy of a bundle with one model replaced by a quantized graph,
and the atomic rewrite of manifest.json (hashes of model files stay valid: those files are not touched)."""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from specdec.calibration.data import DataConfig, describe_source, split_texts, texts_from_source, token_windows
from specdec.calibration.quantize import QuantizeConfig, quantize_onnx
from specdec.calibration.reader import StaticKVReader
from specdec.errors import ConfigError
from specdec.manifest import MANIFEST_NAME, Manifest, json_from_manifest, read_manifest, sha256_file, validate_manifest

log = logging.getLogger(__name__)


def write_manifest(bundle: Path, manifest: Manifest) -> None:
    """Validate and replace bundle/manifest.json atomically (temp file in the same directory, then rename)."""
    validate_manifest(manifest)
    fd, tmp = tempfile.mkstemp(prefix=".manifest.", suffix=".json", dir=bundle)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(json_from_manifest(manifest))
        os.chmod(tmp, 0o644)
        os.replace(tmp, Path(bundle) / MANIFEST_NAME)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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


def _publish(tmp: Path, out: Path) -> None:
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{int(time.time())}")
        out.rename(old)
    tmp.chmod(0o755)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def calibration_windows(bundle: Path, data: DataConfig):
    """(calibration windows [N, W], held-out texts) tokenized with the bundle's tokenizer."""
    from specdec.runtime.text import TextCodec

    codec = TextCodec(bundle).open()
    calibration, held_out = split_texts(texts_from_source(data.source, data.field), data.held_out)
    return token_windows(calibration, codec.encode, data.seq_len, data.num_samples, data.source), held_out


def _entry_for(manifest: Manifest, root: Path, config: QuantizeConfig, record: dict):
    base = manifest.models.get(config.role) or manifest.target
    files = {f"{config.role}/{p.name}": sha256_file(p) for p in sorted((root / config.role).iterdir()) if p.is_file()}
    return dataclasses.replace(
        base, role=config.role, derived=config.method, precision=config.precision, onnx_path=f"{config.role}/model.onnx",
        files=files, size_bytes=sum((root / rel).stat().st_size for rel in files), parity=[],
        parity_note="informational: quantized graph; see `specdec calibrate report`", engines=[], calibration=record,
    )


def quantized_bundle(bundle: Path, out: Path, config: QuantizeConfig, overwrite: bool = False) -> Path:
    """Copy `bundle` to `out` with its `config.role` model replaced by the target quantized with `config`."""
    bundle, out = Path(bundle), Path(out)
    manifest = read_manifest(bundle)
    if manifest.target.precision != "fp32":
        raise ConfigError(f"the target of {bundle} is {manifest.target.precision}",
                          "quantize from a bundle whose target is fp32 (specdec-export --dtype fp32)")
    if out.exists() and not overwrite:
        raise ConfigError(f"output {str(out)!r} already exists", "pass --overwrite, or choose another --out")
    if out.resolve() == bundle.resolve():
        raise ConfigError("--out is the input bundle", "write the quantized bundle to another directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        _copy_tree(bundle, tmp, config.role)
        windows, _ = calibration_windows(bundle, config.data)
        source = bundle / manifest.target.onnx_path
        reader = StaticKVReader(source, manifest.target, windows, config.verify_len) if config.needs_data else None
        details = quantize_onnx(source, tmp / config.role / "model.onnx", config, reader)
        record = {"method": config.method, "precision": config.precision, "backend": config.backend,
                  "from": f"{manifest.target.onnx_path} (fp32)", "details": details,
                  "data": describe_source(config.data, windows) if config.needs_data else None}
        if config.method.startswith("int4"):
            record["accuracy_level"] = config.accuracy_level
        models = {**manifest.models, config.role: _entry_for(manifest, tmp, config, record)}
        write_manifest(tmp, dataclasses.replace(manifest, models=models))
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
