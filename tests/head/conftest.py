"""Bundles with a draft head: tiny targets exported with the features an EAGLE-3 head reads (`--feature-layers
head`), each with a head attached: one of random weights over a trimmed vocabulary (built to be rejected), and a
"mirror" head on a model that repeats its last token (built to be accepted)."""
from __future__ import annotations

import numpy as np
import pytest

from specdec.export.bundle import export_bundle
from specdec.export.config import ExportConfig
from specdec.export.tiny import save_tiny
from specdec.head.format import HeadWeights, attach_head, record_for
from specdec.head.random import random_head, rotary_frequencies
from specdec.manifest import read_manifest
from specdec.runtime.forward import head_feature_layers
from specdec.native_record import Activations

GAMMA_MAX = 8  # greedy equality runs γ = 1..7


def export_head_bundle(out, model_dir, feature_layers=None, **options):
    """A target-only bundle whose graph returns the hidden states `feature_layers` names (None: the head's three)."""
    config = ExportConfig(out=str(out), target=str(model_dir), max_seq_len=96, gamma=3, gamma_max=GAMMA_MAX,
                          max_batch=4, max_prefill_chunk=16, progress=False, no_draft=True,
                          feature_layers=feature_layers, **{"activations": Activations.FP32, **options})
    return export_bundle(config)


def trimmed_vocabulary(vocab: int, keep: float = 2 / 3, seed: int = 0) -> np.ndarray:
    """A sorted random part of the vocabulary: the draft vocabulary of a trimmed head."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(vocab, size=int(vocab * keep), replace=False)).astype(np.int64)


def attach_random_head(bundle, seed: int = 1, keep: float = 2 / 3):
    dims = read_manifest(bundle).target.dims
    weights, record = random_head(dims, head_feature_layers(dims.num_layers),
                                  trimmed_vocabulary(dims.vocab_size, keep), seed=seed)
    return attach_head(bundle, weights, record)


def mirror_head(model_dir, dims, draft_ids) -> tuple:
    """A head of a one-layer target that scores, at position j, the target's own next-token logits of position j:
    fc the identity on the layer's output, attention and MLP off (zero products), the target's final norm and tied
    embedding as its norm and LM head. The target repeats its last token, so in a run of repeats the token after next
    is that token too: drafts are mostly accepted."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        final_norm = model.model.norm.weight.float().numpy()
        table = model.get_output_embeddings().weight.float().numpy()
    H, D, heads = dims.hidden_size, 16, 4
    zeros = lambda rows, cols: np.zeros((rows, cols), np.float32)  # noqa: E731
    ones = np.ones(H, np.float32)
    weights = HeadWeights(fc=np.eye(H, dtype=np.float32), input_norm=ones, hidden_norm=ones, q=zeros(heads * D, 2 * H),
                          k=zeros(2 * D, 2 * H), v=zeros(2 * D, 2 * H), o=zeros(H, heads * D), post_norm=ones,
                          gate=zeros(2 * H, H), up=zeros(2 * H, H), down=zeros(H, 2 * H), norm=final_norm,
                          lm_head=np.ascontiguousarray(table[draft_ids]), draft_ids=draft_ids,
                          inv_freq=rotary_frequencies(D))
    return weights, record_for(weights, head_feature_layers(dims.num_layers), dims.vocab_size,
                               model.config.rms_norm_eps, source="mirror")


@pytest.fixture(scope="session")
def head_model_dir(tmp_path_factory):
    """Eight layers, so the head reads three distinct ones (1, 3, 4)."""
    return save_tiny(tmp_path_factory.mktemp("head_llama"), "llama", layers=8, seed=0, hidden=64, init_range=0.5)


@pytest.fixture(scope="session")
def random_head_bundle(tmp_path_factory, head_model_dir):
    bundle = export_head_bundle(tmp_path_factory.mktemp("hb") / "random", head_model_dir)
    attach_random_head(bundle)
    return bundle


@pytest.fixture(scope="session")
def repeating_model_dir(tmp_path_factory):
    """One layer of small weights: it mostly repeats its last token (tests/conftest.py's copy_llama, with a head dim
    of 16, which the native engine's rotary takes)."""
    return save_tiny(tmp_path_factory.mktemp("repeat"), "llama", layers=1, seed=0, hidden=64, init_range=0.02)


@pytest.fixture(scope="session")
def mirror_head_bundle(tmp_path_factory, repeating_model_dir):
    bundle = export_head_bundle(tmp_path_factory.mktemp("hb") / "mirror", repeating_model_dir)
    dims = read_manifest(bundle).target.dims
    attach_head(bundle, *mirror_head(repeating_model_dir, dims, trimmed_vocabulary(dims.vocab_size, keep=0.75, seed=0)))
    return bundle
