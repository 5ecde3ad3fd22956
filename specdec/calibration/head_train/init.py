"""Where training starts: the draft vocabulary, and the head's first weights taken from the target's own.

- Draft vocabulary: the V' tokens with the most target probability over the answers' positions (the soft labels'
  mass, so tokens the target finds likely count even where it did not write them), the EOS ids always kept.
- Weights (the target's native weights, read as float32): the LM head is the target's rows of the draft tokens
  (its tied embedding) after the target's final norm; the decoder layer is the target's last layer where shapes
  allow (o, the MLP, the post-attention norm; q, k and v on the feature half of their 2H inputs, small random
  weights on the embedding half); fc passes the highest feature layer through. The head then starts near "the
  target's last layer over a late hidden state", which it only has to learn to shift by one token.
"""
from __future__ import annotations

import numpy as np

from specdec.blocks import float_rows
from specdec.head.format import HeadWeights, record_for
from specdec.head.random import rotary_frequencies
from specdec.manifest import HeadRecord, ModelDims

EMBEDDING_HALF = 0.1  # the embedding half of q, k, v: normal, this times the std of the target's weights there


def label_mass(shards, vocab: int) -> np.ndarray:
    """[V] float64: the target's top-k probability summed over every labelled position of every shard."""
    mass = np.zeros(vocab, np.float64)
    for arrays in shards.arrays:
        ids, probs = arrays.top_ids, arrays.top_probs
        for lo in range(0, len(ids), 65536):  # bounded memory: a slice of the map at a time
            mass += np.bincount(np.asarray(ids[lo : lo + 65536]).ravel(),
                                weights=np.asarray(probs[lo : lo + 65536], np.float64).ravel(), minlength=vocab)
    return mass


def draft_vocabulary(mass: np.ndarray, size: int, keep: tuple = ()) -> np.ndarray:
    """Sorted ids [min(size, V)] of the tokens of most `mass` (ties by id), the ids of `keep` among them."""
    size = min(int(size), len(mass))
    kept = [int(t) for t in keep if 0 <= int(t) < len(mass)]
    order = [int(t) for t in np.argsort(-mass, kind="stable") if int(t) not in set(kept)]
    return np.sort(np.array((kept + order)[:size], np.int64))


def _inv_freq(native, head_dim: int) -> np.ndarray:
    """[D / 2] the target's rotary frequencies, read back from its tables (position 1's angles)."""
    if native.cos is None:
        return rotary_frequencies(head_dim)
    return np.arctan2(native.sin[1], native.cos[1]).astype(np.float32)


def _split_qkv(layer, dims: ModelDims) -> tuple:
    rows = float_rows(layer.qkv)
    if layer.qkv_v is not None:
        rows = np.concatenate([rows, float_rows(layer.qkv_v)])
    q_rows, kv_rows = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    return rows[:q_rows], rows[q_rows : q_rows + kv_rows], rows[q_rows + kv_rows :]


def initial_head(native, dims: ModelDims, feature_layers, draft_ids: np.ndarray,
                 seed: int) -> tuple[HeadWeights, HeadRecord]:
    """The head's first weights from the target's native weights `native` (specdec.native.weights.NativeWeights)
    of a target of `dims`; -> (weights, record without files)."""
    rng = np.random.default_rng(seed)
    H, F = dims.hidden_size, len(feature_layers)
    last = native.layers[-1]

    def beside(weight: np.ndarray) -> np.ndarray:  # [N, H] -> [N, 2H]: small random on the embedding half
        noise = rng.standard_normal(weight.shape) * (EMBEDDING_HALF * weight.std())
        return np.concatenate([noise, weight], axis=1).astype(np.float32)

    q, k, v = _split_qkv(last, dims)
    gate_up = float_rows(last.gate_up)
    fc = np.zeros((H, F * H), np.float32)
    fc[:, (F - 1) * H :] = np.eye(H, dtype=np.float32)
    table = native.head if native.embedding is None or native.head is not None else native.embedding
    weights = HeadWeights(
        fc=fc, input_norm=np.ones(H, np.float32), hidden_norm=np.array(last.input_norm, np.float32),
        q=beside(q), k=beside(k), v=beside(v), o=float_rows(last.o), post_norm=np.array(last.post_norm, np.float32),
        gate=np.ascontiguousarray(gate_up[: len(gate_up) // 2]), up=np.ascontiguousarray(gate_up[len(gate_up) // 2 :]),
        down=float_rows(last.down), norm=np.array(native.final_norm, np.float32),
        lm_head=np.ascontiguousarray(float_rows(table[draft_ids])), draft_ids=np.asarray(draft_ids, np.int64),
        inv_freq=_inv_freq(native, dims.head_dim))
    return weights, record_for(weights, feature_layers, dims.vocab_size, native.epsilon, source="trained")
