"""A draft head of random weights: what tests attach to tiny bundles (exactness never depends on a head's quality),
and what a cost measurement runs where no trained head exists yet (a step costs the same whatever the weights)."""
from __future__ import annotations

import numpy as np

from specdec.head.format import HeadWeights, record_for
from specdec.manifest import HeadRecord, ModelDims


def rotary_frequencies(head_dim: int, theta: float = 10000.0) -> np.ndarray:
    """[D / 2] the default rotary frequencies theta^(-2i / D) (a LLaMA config without rope scaling)."""
    return (1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)).astype(np.float32)


def random_head(dims: ModelDims, feature_layers, draft_ids=None, *, heads: int = 4, kv_heads: int = 2,
                head_dim: int | None = None, mlp: int | None = None, scale: float = 0.5, seed: int = 0,
                epsilon: float = 1e-5) -> tuple[HeadWeights, HeadRecord]:
    """A head for a target of `dims` reading `feature_layers`, scoring `draft_ids` (default: the whole vocabulary),
    with normal weights of standard deviation scale / sqrt(K) per product (K its inputs) and norms near 1;
    -> (weights, record without files)."""
    rng = np.random.default_rng(seed)
    H, F = dims.hidden_size, len(feature_layers)
    D = head_dim or H // heads
    I = mlp or 2 * H  # noqa: E741
    ids = np.arange(dims.vocab_size, dtype=np.int64) if draft_ids is None else np.asarray(draft_ids, np.int64)

    def product(rows: int, inputs: int) -> np.ndarray:
        return (rng.standard_normal((rows, inputs)) * scale / np.sqrt(inputs)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(H)).astype(np.float32)

    weights = HeadWeights(fc=product(H, F * H), input_norm=norm(), hidden_norm=norm(), q=product(heads * D, 2 * H),
                          k=product(kv_heads * D, 2 * H), v=product(kv_heads * D, 2 * H), o=product(H, heads * D),
                          post_norm=norm(), gate=product(I, H), up=product(I, H), down=product(H, I), norm=norm(),
                          lm_head=product(len(ids), H) * np.float32(np.sqrt(H)), draft_ids=ids,
                          inv_freq=rotary_frequencies(D))
    return weights, record_for(weights, feature_layers, dims.vocab_size, epsilon, source="random")
