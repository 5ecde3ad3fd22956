"""The quality report: one row per model of each bundle against a reference bundle's fp32 target."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from specdec.calibration.bundle_io import calibration_windows
from specdec.calibration.data import DataConfig, token_windows
from specdec.calibration.quality import (
    DEFAULT_PROMPTS,
    QualityRow,
    acceptance,
    model_size_mb,
    step_ms,
    teacher_forced,
)
from specdec.errors import ConfigError
from specdec.manifest import Precision, Role, read_manifest
from specdec.runtime.ort_backend import OrtBackend

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReportConfig:
    reference: Path  # the bundle whose fp32 target is the reference
    data: DataConfig = DataConfig(seq_len=32, num_samples=16)  # held-out text: agreement and perplexity
    prompts: tuple = DEFAULT_PROMPTS
    max_new_tokens: int = 64
    include_reference: bool = True
    progress: bool = False

    def __post_init__(self):
        object.__setattr__(self, "reference", Path(self.reference))
        object.__setattr__(self, "prompts", tuple(self.prompts))
        if not self.prompts:
            raise ConfigError("the report needs at least one prompt", "pass --prompt TEXT")


def _held_out_windows(config: ReportConfig):
    from specdec.runtime.text import TextCodec

    _, held_out = calibration_windows(config.reference, config.data)
    if not held_out:
        raise ConfigError("no held-out text is left for perplexity", "use more calibration text or --held-out 0.25")
    codec = TextCodec(config.reference).open()
    return token_windows(held_out, codec.encode, config.data.seq_len, config.data.num_samples, config.data.source)


def _row(name, root, entry, reference, windows, config, as_draft: bool) -> QualityRow:
    candidate = OrtBackend(root, entry).open()
    try:
        quality = teacher_forced(reference, candidate, windows, config.progress)
        ms = step_ms(candidate)
    finally:
        candidate.close()
    accept = acceptance(root, list(config.prompts), None, config.max_new_tokens) if as_draft else {}
    method = entry.derived or entry.calibration.method or "export"  # e.g. layers:16+int4-q41
    return QualityRow(name, entry.precision, method, model_size_mb(root, entry), ms, quality["top1_agreement"],
                      quality["perplexity"], accept.get("acceptance_rate"), accept.get("mean_acceptance_length"),
                      accept.get("speedup"))


def quality_report(bundles: list, config: ReportConfig) -> list[QualityRow]:
    """Rows for the reference's fp32 target and every non-fp32 model (and every draft) of `bundles`."""
    ref_manifest = read_manifest(config.reference)
    if ref_manifest.target.precision != Precision.FP32:
        raise ConfigError(f"the reference target is {ref_manifest.target.precision}", "pass a bundle with an fp32 target")
    windows = _held_out_windows(config)
    rows = []
    reference = OrtBackend(config.reference, ref_manifest.target).open()
    try:
        if config.include_reference:
            rows.append(_row(f"{config.reference.name}/target", config.reference, ref_manifest.target, reference,
                             windows, config, False))
        for bundle in map(Path, bundles):
            manifest = read_manifest(bundle)
            for role, entry in manifest.models.items():
                if role == Role.TARGET and entry.precision == Precision.FP32:
                    continue
                rows.append(_row(f"{bundle.name}/{role}", bundle, entry, reference, windows, config,
                                 role == Role.DRAFT))
    finally:
        reference.close()
    return rows
