"""The head's forward: the native kernels' products (Q8_0 blocks) against the fp32 numpy reference, and its KV's
rollback by position."""
from __future__ import annotations

import numpy as np
import pytest

from specdec.head.format import read_head
from specdec.head.kernels import Q8A, Q8A_REF, BlockProducts
from specdec.head.model import FloatProducts, HeadModel, TokenEmbedding, packed
from specdec.manifest import read_manifest
from specdec.native import build
from specdec.runtime.head_drafter import embedding_table

SAME_BLOCKS = 1e-4  # of the largest |logit|: the kernels against numpy on the very same blocks (summation order)
QUANTIZED = 5e-2  # ... against the fp32 weights: each weight rounded to its block's 8-bit grid
ROUNDED = 5e-2  # int8 activations (Q8A) against fp32 ones on the same blocks: each activation on its block's grid
needs_native = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA, F16C")


def _head(bundle, products_of) -> HeadModel:
    manifest = read_manifest(bundle)
    weights = read_head(bundle, manifest.head)
    embed = TokenEmbedding(embedding_table(bundle, manifest.target))
    return HeadModel(weights, manifest.head, embed, products_of(packed(weights)), manifest.target.max_seq_len)


def _run(head: HeadModel, seed: int = 0) -> list:
    """A catch-up of two rows (ragged positions, slots 2 and 0) and three chain steps; -> every call's logits."""
    rng = np.random.default_rng(seed)
    F, H = len(head.feature_layers), head.record.hidden_size
    features = rng.standard_normal((2, 6, F, H)).astype(np.float32)
    tokens = rng.integers(0, head.record.vocab_size, (2, 6))
    positions, slots = np.array([0, 9]), np.array([2, 0])
    logits, hidden = head.forward(tokens, head.fuse(features), positions, slots, last_only=True)
    out = [logits]
    for step in range(3):
        nxt = head.draft_ids[np.argmax(logits[:, -1], axis=-1)][:, None]
        logits, hidden = head.forward(nxt, hidden, positions + 6 + step, slots, last_only=True)
        out.append(logits)
    return out


def _worst(got: list, want: list) -> float:
    return max(float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(got, want))


@needs_native
def test_the_kernels_agree_with_the_numpy_reference(random_head_bundle):
    kernels = build.load_kernels()
    blocks = _head(random_head_bundle, lambda matrices: BlockProducts(matrices, kernels, 2))
    same = _head(random_head_bundle, lambda matrices: blocks.products.dequantized())
    fp32 = _head(random_head_bundle, FloatProducts)
    native, reference, exact = _run(blocks), _run(same), _run(fp32)
    assert _worst(native, reference) <= SAME_BLOCKS
    assert _worst(native, exact) <= QUANTIZED
    assert [np.argmax(a, -1).tolist() for a in native] == [np.argmax(a, -1).tolist() for a in reference]
    full = blocks.to_target(native[0])  # [2, 1, V]: -inf (q = 0) outside the draft vocabulary
    assert np.array_equal(full[..., blocks.draft_ids], native[0])
    assert np.isneginf(full).sum() == 2 * (blocks.record.vocab_size - len(blocks.draft_ids))


@needs_native
def test_int8_activations_give_their_reference_bits_and_stay_near_fp32(random_head_bundle):
    """Beside a target of int8 activations the head's products round its activations too (Q8A): the bits of the
    plain-C reference, whatever the threads, and near the fp32 activations' products of the same blocks."""
    kernels = build.load_kernels()
    q8a = _head(random_head_bundle, lambda matrices: BlockProducts(matrices, kernels, 2, Q8A))
    ref = _head(random_head_bundle, lambda matrices: BlockProducts(matrices, kernels, 1, Q8A_REF))
    fp32 = _head(random_head_bundle, lambda matrices: q8a.products.dequantized())
    got, want, near = _run(q8a), _run(ref), _run(fp32)
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    assert 0 < _worst(got, near) <= ROUNDED


def test_the_whole_sequence_equals_its_last_position_and_rollback_recomputes(random_head_bundle):
    """Logits of every position (last_only off) end in the last-only call's, and positions written again after a
    rollback give what a fresh KV gives."""
    head = _head(random_head_bundle, FloatProducts)
    rng = np.random.default_rng(1)
    F, H = len(head.feature_layers), head.record.hidden_size
    features = head.fuse(rng.standard_normal((1, 8, F, H)).astype(np.float32))
    tokens = rng.integers(0, head.record.vocab_size, (1, 8))
    whole, _ = head.forward(tokens, features, [0], [1])
    last, _ = head.forward(tokens, features, [0], [1], last_only=True)
    assert whole.shape[:2] == (1, 8) and np.allclose(whole[:, -1], last[:, -1], rtol=1e-5, atol=1e-5)
    head.forward(tokens[:, 5:], rng.standard_normal((1, 3, H)).astype(np.float32), [5], [1])  # drafts past 5
    again, _ = head.forward(tokens[:, 5:], features[:, 5:], [5], [1], last_only=True)  # rolled back to 5
    assert np.allclose(again[:, -1], last[:, -1], rtol=1e-5, atol=1e-5)
