"""What a bundle records of a model's native weights (its manifest's `native`): the weights file and its tensors, and
for a target its family's facts, which both engines on specdec's kernels read (stdlib only)."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Activation(StrEnum):
    """A native target's MLP: SiLU(gate)·up (the LLaMA layout), or GELU of one up product (GPT-2's; tanh: the
    approximation of onnxruntime's FastGelu, gelu: the exact erf form of its Gelu)."""

    SILU_GATED = "silu-gated"
    GELU_TANH = "gelu-tanh"
    GELU = "gelu"


class Activations(StrEnum):
    """What a native target's activations are in its products with blocked weights (load(activations=...), the
    bundle's Defaults.activations); not Activation, the MLP's nonlinearity."""

    FP32 = "fp32"  # fp32: the target's graph's function, in another summation order
    INT8 = "int8"  # each row's rounded per block of 32 to int8 (a Q8 block): integer dot products (docs/backends.md)
    BF16 = "bf16"  # each row's rounded to bf16 before products with bf16 rows: AMX-BF16 tiles (docs/backends.md)


ACTIVATIONS = tuple(mode.value for mode in Activations)
ACTIVATIONS_HELP = ("the native target's activations: fp32; int8 (each row's rounded per block of 32 before every "
                    "product with blk4, blk8 or blk6 weights: integer dot products, faster prompts); or bf16 (rounded "
                    "to bf16 before every product with bf16 rows, on AMX-BF16 tiles: faster prompts and verify "
                    "passes; CPUs with AMX); docs/backends.md; default: the bundle's defaults.activations, fp32 where "
                    "it has none; int8 and bf16 need the native backend")


class NormKind(StrEnum):
    """A native target's norms: RMSNorm (the LLaMA layout), or LayerNorm with a bias (GPT-2's)."""

    RMS = "rms"
    LAYER = "layer"


class PositionKind(StrEnum):
    """How a native target encodes positions: rotary (rotate-half, over whole heads), or a learned table added to the
    embedding (GPT-2's)."""

    ROTARY = "rotary"
    LEARNED = "learned"


@dataclass(frozen=True)
class FamilyRecord:
    """What a native target's layers do, written at export from its family's Architecture and read by both engines on
    specdec's kernels (specdec.export.native_family); the weights file's tensors must agree with it."""

    norm: str = NormKind.RMS  # a NormKind
    positions: str = PositionKind.ROTARY  # a PositionKind
    activation: str = Activation.SILU_GATED  # the MLP's (an Activation)
    biases: list = field(default_factory=list)  # the products with a bias, of qkv, o, gate_up, down
    qk_norm: bool = False  # each head of q and k RMS-normalized before rotary (Qwen3's)
    window: int = 0  # keys a query sees, its own included (a sliding window shorter than S), or 0: every earlier one
    epsilon: float = 0.0  # the norms' epsilon
    scale: float = 0.0  # attention scores' scale


@dataclass(frozen=True)
class NativeRecord:
    """A model's weights as the native engine reads them: a file of blocks it memory-maps (specdec.blocks)."""

    layout: str  # a specdec.blocks layout name: "q41" (a target on the GGUF grids), "q41-draft" (its int4-q41 draft)
    abi: int  # the weights' format version of the writer (specdec.weights_file.FORMAT_VERSION)
    path: str  # relative to the bundle; also in the entry's files, with its sha256
    tensors: dict  # name -> {"kind", "shape", "offset"}
    epsilon: float = 0.0  # the norms' epsilon (RMSNorm's, or LayerNorm's where the tensors hold norm biases)
    scale: float = 0.0  # attention scores' scale
    fill: float = 0.0  # the logit of a token a trimmed head does not score
    window: int = 0  # keys a query sees, its own included (a sliding window shorter than S), or 0: every earlier one
    activation: str = Activation.SILU_GATED  # the MLP's (an Activation)
    family: FamilyRecord | None = None  # a target's family facts (export writes them here, and leaves epsilon, scale,
    # window and activation above at their defaults); None in bundles written before it, whose facts are the fields
    # above and which tensors the file holds (specdec.native.weights.family_of)
