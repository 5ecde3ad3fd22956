"""The exported graph against PyTorch: every supported family, every T and B, rollback, tied weights."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.manifest import read_manifest
from specdec.export.architectures import supported_model_types
from specdec.export.tiny import save_tiny
from tests.conftest import GAMMA_MAX, MAX_SEQ_LEN

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gpt2"]
TOLERANCE = 1e-4  # relative to max |logit|, the fp32 export tolerance


@pytest.fixture(scope="module", params=FAMILIES)
def family_bundle(request, tmp_path_factory, export_tiny):
    folder = save_tiny(tmp_path_factory.mktemp(request.param), request.param, init_range=0.2)
    bundle = export_tiny(tmp_path_factory.mktemp("b") / request.param, folder, no_draft=True, lowering="plain")
    return request.param, folder, bundle


@pytest.mark.parametrize("family,hidden", [(f, 32) for f in FAMILIES] + [("llama", 64), ("qwen2", 64)])
def test_gqa_lowering_parity(family, hidden, tmp_path, export_tiny):
    """The GroupQueryAttention graph passes the same parity plan (run row by row, B = 1). Head size 16
    (hidden 64) takes the fused-rotary path; head size 8 keeps rotary outside the attention op."""
    folder = save_tiny(tmp_path / family, family, init_range=0.2, hidden=hidden)
    bundle = export_tiny(tmp_path / "b", folder, no_draft=True, lowering="gqa")
    manifest = read_manifest(bundle)
    assert manifest.target.lowering == "gqa"
    steps = manifest.target.parity
    assert len(steps) == 7 and all(s.enforced and s.max_abs_diff <= s.tolerance for s in steps), steps
    assert [t.name for t in manifest.target.inputs][:3] == ["input_ids", "cache_len", "logit_positions"]
    graph = onnx.load(str(bundle / manifest.target.onnx_path), load_external_data=False).graph
    attention = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attention) == manifest.target.dims.num_layers and attention[0].domain == "com.microsoft"
    rotary = {a.name: a.i for a in attention[0].attribute}.get("do_rotary")
    assert rotary == int(hidden == 64 and family != "gpt2")
    layers = manifest.target.dims.num_layers
    ops = [n.op_type for n in graph.node]
    # RMSNorm families: the first norm alone, every later one fused with the residual Add before it
    assert ops.count("SimplifiedLayerNormalization") == (0 if family == "gpt2" else 1)
    assert ops.count("SkipSimplifiedLayerNormalization") == (0 if family == "gpt2" else 2 * layers)
    # q/k/v packed into one MatMul where the attention op rotates (not Qwen3: it normalizes q and k first),
    # gate/up into one: 4 MatMuls a layer (qkv, o, gate|up, down)
    if rotary == 1 and family != "qwen3":
        assert ops.count("MatMul") == 4 * layers and ops.count("Split") == layers, ops


def test_export_parity_is_recorded_and_within_tolerance(family_bundle):
    family, _, bundle = family_bundle
    manifest = read_manifest(bundle)
    steps = manifest.target.parity
    assert [s.name for s in steps] == ["prefill", "decode1", "decode2", "decode3", "verify",
                                       "rollback_decode1", "rollback_decode2"]
    assert steps[4].tokens == GAMMA_MAX + 1
    assert all(s.enforced and 0 <= s.max_abs_diff <= s.tolerance for s in steps), steps
    assert manifest.target.dims.model_type == family


def _run(session, ids, cache_len, keys, values):
    logits, new_k, new_v = session.run(None, {"input_ids": ids, "cache_len": cache_len,
                                              "past_keys": keys, "past_values": values})
    for row, start in enumerate(cache_len):
        keys[:, row, :, start : start + ids.shape[1]] = new_k[:, row]
        values[:, row, :, start : start + ids.shape[1]] = new_v[:, row]
    return logits


def _reference(model, rows):
    with torch.no_grad():
        return [model(torch.tensor([r])).logits[0].numpy() for r in rows]


@pytest.mark.parametrize("batch", [1, 3])
def test_graph_serves_every_t_and_batch_with_rollback(family_bundle, batch):
    family, folder, bundle = family_bundle
    manifest = read_manifest(bundle)
    dims = manifest.target.dims
    session = ort.InferenceSession(str(bundle / manifest.target.onnx_path), providers=["CPUExecutionProvider"])
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    shape = (dims.num_layers, batch, dims.num_kv_heads, MAX_SEQ_LEN, dims.head_dim)
    keys, values = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    rng = np.random.default_rng(1)
    rows = [[] for _ in range(batch)]
    # T = prefill chunk, 1, 2, γ+1, then a rollback by a different amount per row, then T = 1
    for steps, rollback in [(16, 0), (1, 0), (2, 0), (4, 0), (1, None), (1, 0)]:
        if rollback is None:
            for b in range(batch):
                del rows[b][len(rows[b]) - (b + 1) :]
        ids = rng.integers(0, dims.vocab_size, (batch, steps))
        cache_len = np.array([len(r) for r in rows], dtype=np.int64)
        logits = _run(session, ids, cache_len, keys, values)
        for b in range(batch):
            rows[b].extend(ids[b].tolist())
        for b, ref in enumerate(_reference(model, rows)):
            got, want = logits[b], ref[-steps:]
            assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max(), (family, steps, b)


def test_tied_embeddings_are_stored_once(family_bundle):
    family, folder, bundle = family_bundle
    manifest = read_manifest(bundle)
    graph = onnx.load(str(bundle / manifest.target.onnx_path), load_external_data=False).graph
    dims = manifest.target.dims
    big = [init.name for init in graph.initializer if dims.vocab_size in init.dims and dims.hidden_size in init.dims]
    tied = AutoModelForCausalLM.from_pretrained(folder).config.tie_word_embeddings
    assert len(big) == (1 if tied else 2), big
