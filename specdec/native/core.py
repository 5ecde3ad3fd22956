"""What the two engines on specdec's own kernels share (NativeModel on the CPU, specdec.cuda's CudaModel on a GPU).

A model is its weights (a target's; or an int4-q41 draft's pairs and trimmed head, run on its target's norms and
tables), its dims and static sizes, and the model whose KV it reads and writes (a draft's target, else its own). Its
forward checks the call's positions and slots, then computes; a trimmed head's logits are widened onto the whole
vocabulary. The family features a model's weights need are named here too, so an engine that lacks some refuses
them by name (specdec.runtime.kernel_backend).
"""
from __future__ import annotations

from enum import StrEnum

import numpy as np

from specdec.weight_kinds import WEIGHT_LAYOUTS
from specdec.errors import BackendError
from specdec.manifest import Activation, ModelDims, NormKind, PositionKind, Role
from specdec.native.weights import DraftWeights, NativeWeights


class FamilyFeature(StrEnum):
    """What a family's layers do beyond a plain LLaMA layer (RMSNorm, rotary, SiLU-gated MLP, no biases), as an
    engine's kernels need to know it (NativeWeights.family_features says which a model's weights need)."""

    GPT2_LAYOUT = "GPT-2's layout (LayerNorm, learned positions, a GELU MLP)"
    PRODUCT_BIASES = "biases added to products (Qwen2's q/k/v, GPT-2's)"
    SLIDING_WINDOW = "attention within a sliding window (Mistral's, Phi-3's)"
    QK_NORM = "q/k heads normalized (Qwen3's)"
    MIXED_BLOCKS = "a K-quant GGUF's mixed blocks (layout 'mixed')"


def family_features(weights: NativeWeights) -> frozenset:
    """The FamilyFeatures `weights` need of the kernels that run them (from its family record, and its layout)."""
    family = weights.family
    found = {
        FamilyFeature.GPT2_LAYOUT: family.norm == NormKind.LAYER or family.positions == PositionKind.LEARNED
        or family.activation != Activation.SILU_GATED,
        FamilyFeature.PRODUCT_BIASES: bool(family.biases),
        FamilyFeature.SLIDING_WINDOW: bool(family.window),
        FamilyFeature.QK_NORM: family.qk_norm,
        FamilyFeature.MIXED_BLOCKS: WEIGHT_LAYOUTS[weights.layout].mixed,
    }
    return frozenset(feature for feature, needed in found.items() if needed)


def check_rows(rows: int, steps: int, pos, slots, held: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions int32 [rows], slots int64 [rows]) of a forward of `rows` x `steps` tokens over `held` KV slots of
    `size` positions; BackendError where either is not one integer per row, a position or its last token falls
    outside 0..size - 1 (never wrapped to 32 bits), or the slots are not distinct held slots."""
    pos, slots = np.asarray(pos), np.asarray(slots)
    if pos.shape != (rows,) or slots.shape != (rows,) or pos.dtype.kind not in "iu" or slots.dtype.kind not in "iu":
        raise BackendError(f"a forward of {rows} rows got positions {pos.dtype} {list(pos.shape)} and slots "
                           f"{slots.dtype} {list(slots.shape)}", "pass one integer position and one slot per row")
    at, into = pos.tolist(), slots.tolist()
    if any(p < 0 or p + steps > size for p in at):
        raise BackendError(f"positions {at} with {steps} tokens fall outside the {size} positions of the KV",
                           "end the row first (finish reason 'length'), or re-export with a larger --max-seq-len")
    if any(s < 0 or s >= held for s in into) or len(set(into)) != rows:
        raise BackendError(f"slots {into} are not distinct slots of 0..{held - 1}", "call reset with enough slots")
    return pos.astype(np.int32), slots.astype(np.int64)


class KernelModel:
    """One model on specdec's kernels; subclasses hold the KV (`held_slots`) and compute (`compute`).

    draft: the paired weights and head of an int4-q41 draft, run on `weights` (its target's norms and tables).
    kv_owner: the model whose KV this one reads and writes (a draft beside its target), else None: its own."""

    def __init__(self, weights: NativeWeights, dims: ModelDims, max_seq_len: int, draft: DraftWeights | None = None,
                 kv_owner: "KernelModel | None" = None):
        self.weights = weights
        self.dims = dims
        self.max_seq_len = max_seq_len
        self.draft = draft
        self.kv_owner = kv_owner

    @property
    def role(self) -> Role:
        return Role.TARGET if self.draft is None else Role.DRAFT

    def held_slots(self) -> int:
        """KV slots of the latest reset (the owner's), 0 before any."""
        raise NotImplementedError

    def forward(self, tokens: np.ndarray, pos: np.ndarray, slots: np.ndarray, last_only: bool = False,
                layers: tuple = ()):
        """tokens [B, T] of rows at positions pos[b].. of slots[b] -> logits [B, T or 1, V] (and, with `layers`, the
        features [B, T, F, H] of those layers); K/V land at [pos[b], pos[b] + T) of each slot. Checks its positions
        and slots (check_rows); a backend, whose run has checked them, calls compute."""
        tokens = np.asarray(tokens)
        rows, steps = tokens.shape if tokens.ndim == 2 else (0, 0)
        held = self.held_slots()
        if rows and steps and held:  # else compute says what is wrong
            pos, slots = check_rows(rows, steps, pos, slots, held, self.max_seq_len)
        return self.compute(tokens, pos, slots, last_only, layers)

    def compute(self, tokens: np.ndarray, pos: np.ndarray, slots: np.ndarray, last_only: bool = False,
                layers: tuple = ()):
        """forward without check_rows: positions and slots already checked."""
        raise NotImplementedError

    def widen(self, scored: np.ndarray) -> np.ndarray:
        """A trimmed draft head's logits [..., V'] onto the vocabulary [..., V] (the draft's fill elsewhere); any other
        model's as they are."""
        if self.draft is None or self.draft.head_rows is None:
            return scored
        logits = np.full(scored.shape[:-1] + (self.dims.vocab_size,), self.draft.fill, np.float32)
        logits[..., self.draft.head_rows] = scored
        return logits
