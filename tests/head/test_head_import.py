"""Bring your own head: EAGLE-3 checkpoints written here in SpecForge's and vllm-project/speculators' layouts (random
weights through torch) become the bundle's head, whose logits equal a PyTorch EAGLE-3 forward on the same weights
(written from the layout, with transformers' LLaMA rotary, norm and attention helpers), catch-up and a chain step."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb, repeat_kv

from specdec.cli.main import main
from specdec.errors import ExportError
from specdec.export.head_import import attach_checkpoint
from specdec.head.format import read_head
from specdec.head.model import FloatProducts, HeadModel, TokenEmbedding, packed
from specdec.manifest import read_manifest
from specdec.runtime.head_drafter import embedding_table

TOLERANCE = 1e-4  # of the largest |logit|: fp32 in another summation order
HEADS, KV_HEADS, MLP, DRAFT_VOCAB = 4, 2, 96, 200
AUX_IDS = [2, 4, 7]  # vLLM's count: the inputs of layers 2, 4 and 7 = our outputs of layers 1, 3 and 6


def layer_config(hidden: int, vocab: int) -> dict:
    return dict(hidden_size=hidden, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, intermediate_size=MLP,
                rms_norm_eps=1e-5, rope_theta=50000.0, vocab_size=vocab, max_position_embeddings=512,
                hidden_act="silu", num_hidden_layers=1, attention_bias=False)


def write_checkpoint(folder, hidden: int, vocab: int, layout: str, seed: int = 0) -> dict:
    """A random EAGLE-3 head in `layout` ("specforge": midlayer., eagle_config; "speculators": layers.0., a nested
    config, an fc bias); -> its tensors by SpecForge's names (the reference's input)."""
    torch.manual_seed(seed)
    D = hidden // HEADS
    shapes = {"fc.weight": (hidden, 3 * hidden), "midlayer.self_attn.q_proj.weight": (HEADS * D, 2 * hidden),
              "midlayer.self_attn.k_proj.weight": (KV_HEADS * D, 2 * hidden),
              "midlayer.self_attn.v_proj.weight": (KV_HEADS * D, 2 * hidden),
              "midlayer.self_attn.o_proj.weight": (hidden, HEADS * D), "midlayer.mlp.gate_proj.weight": (MLP, hidden),
              "midlayer.mlp.up_proj.weight": (MLP, hidden), "midlayer.mlp.down_proj.weight": (hidden, MLP),
              "lm_head.weight": (DRAFT_VOCAB, hidden)}
    tensors = {name: torch.randn(shape) / shape[1] ** 0.5 for name, shape in shapes.items()}
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        tensors[f"{norm}.weight"] = 1 + 0.1 * torch.randn(hidden)
    used = torch.sort(torch.randperm(vocab)[:DRAFT_VOCAB]).values
    tensors["d2t"], tensors["t2d"] = used - torch.arange(DRAFT_VOCAB), torch.zeros(vocab, dtype=torch.bool)
    tensors["t2d"][used] = True
    tensors["embed_tokens.weight"] = torch.randn(vocab, hidden)  # not read: the target's embedding is shared
    config = layer_config(hidden, vocab)
    saved = dict(tensors)
    if layout == "speculators":
        saved = {name.replace("midlayer.", "layers.0."): value for name, value in tensors.items()}
        saved["fc.bias"] = tensors["fc.bias"] = 0.1 * torch.randn(hidden)
        config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                  "transformer_layer_config": config, "draft_vocab_size": DRAFT_VOCAB, "norm_before_residual": True,
                  "eagle_aux_hidden_state_layer_ids": AUX_IDS}
    else:
        config = {**config, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": DRAFT_VOCAB,
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_IDS, "use_aux_hidden_state": True}}
    folder.mkdir(parents=True)
    save_file({name: value.contiguous() for name, value in saved.items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    return tensors


def rms(x, weight, eps=1e-5):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def torch_eagle3(t: dict, embed, hidden, tokens, norm_before_residual: bool):
    """The EAGLE-3 head over positions 0..T-1 at once. hidden: [T, H] (fc output, or a previous prenorm);
    tokens: [T] (the next token of each position) -> (logits [T, V'], prenorm [T, H])."""
    H = hidden.shape[-1]
    D, steps = H // HEADS, len(tokens)
    normed = rms(hidden, t["midlayer.hidden_norm.weight"])
    residual = normed if norm_before_residual else hidden
    x = torch.cat([rms(embed[tokens], t["midlayer.input_layernorm.weight"]), normed], -1)[None]  # [1, T, 2H]
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(1, steps, HEADS, D).transpose(1, 2)
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(1, steps, KV_HEADS, D).transpose(1, 2)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(1, steps, KV_HEADS, D).transpose(1, 2)
    rotary = LlamaRotaryEmbedding(LlamaConfig(**layer_config(H, len(embed))))
    cos, sin = rotary(v, torch.arange(steps)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = repeat_kv(k, HEADS // KV_HEADS), repeat_kv(v, HEADS // KV_HEADS)
    attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # [1, Hq, T, D]
    h = residual + attended.transpose(1, 2).reshape(steps, H) @ t["midlayer.self_attn.o_proj.weight"].T
    m = rms(h, t["midlayer.post_attention_layernorm.weight"])
    gate, up = m @ t["midlayer.mlp.gate_proj.weight"].T, m @ t["midlayer.mlp.up_proj.weight"].T
    prenorm = h + (torch.nn.functional.silu(gate) * up) @ t["midlayer.mlp.down_proj.weight"].T
    return rms(prenorm, t["norm.weight"]) @ t["lm_head.weight"].T, prenorm


@pytest.fixture()
def bundle(random_head_bundle, tmp_path):
    return shutil.copytree(random_head_bundle, tmp_path / "bundle")


@pytest.mark.parametrize("layout", ["specforge", "speculators"])
def test_an_eagle3_checkpoint_becomes_the_head_and_computes_its_logits(bundle, head_model_dir, tmp_path, layout):
    manifest = read_manifest(bundle)
    dims = manifest.target.dims
    t = write_checkpoint(tmp_path / layout, dims.hidden_size, dims.vocab_size, layout)
    assert main(["calibrate", "head", str(bundle), "--from", str(tmp_path / layout)]) == 0
    manifest = read_manifest(bundle)
    record = manifest.head
    assert record.feature_layers == [1, 3, 6] and record.draft_vocab_size == DRAFT_VOCAB
    weights = read_head(bundle, record)
    assert np.array_equal(weights.draft_ids, np.flatnonzero(t["t2d"].numpy()))
    head = HeadModel(weights, record, TokenEmbedding(embedding_table(bundle, manifest.target)),
                     FloatProducts(packed(weights)), manifest.target.max_seq_len)
    embed = AutoModelForCausalLM.from_pretrained(head_model_dir).get_input_embeddings().weight.detach().float()

    rng = np.random.default_rng(3)
    features = rng.standard_normal((1, 7, 3, dims.hidden_size)).astype(np.float32)
    tokens = rng.integers(0, dims.vocab_size, (1, 8))
    logits, prenorm = head.forward(tokens[:, :7], head.fuse(features), [0], [0])
    chained, _ = head.forward(tokens[:, 7:], prenorm[:, -1:], [7], [0])  # a chain step on the head's own prenorm
    with torch.no_grad():
        fused = torch.from_numpy(features.reshape(7, -1)) @ t["fc.weight"].T + t.get("fc.bias", 0)
        want, want_prenorm = torch_eagle3(t, embed, fused, torch.from_numpy(tokens[0, :7]), layout == "speculators")
        chain_in = torch.cat([fused, want_prenorm[-1:]])
        want_chain, _ = torch_eagle3(t, embed, chain_in, torch.from_numpy(tokens[0]), layout == "speculators")
    for got, expected in ((logits[0], want.numpy()), (chained[0, -1], want_chain[-1].numpy())):
        assert np.abs(got - expected).max() <= TOLERANCE * np.abs(expected).max(), np.abs(got - expected).max()


def test_a_checkpoint_the_head_cannot_run_is_refused(bundle, tmp_path):
    dims = read_manifest(bundle).target.dims
    folder = tmp_path / "biased"
    write_checkpoint(folder, dims.hidden_size, dims.vocab_size, "specforge")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    with pytest.raises(ExportError, match=r"(?s)biases on its attention or MLP products.*Hint"):
        attach_checkpoint(bundle, folder)
    assert main(["calibrate", "head", str(bundle), "--from", str(folder)]) == 1
    assert main(["calibrate", "head", str(bundle), "--steps", "0"]) == 1  # no --from: training, a bad option
    narrow = tmp_path / "narrow"
    write_checkpoint(narrow, 32, dims.vocab_size, "specforge")
    assert main(["calibrate", "head", str(bundle), "--from", str(narrow)]) == 1  # hidden size 32 beside 64
    assert read_manifest(bundle).head.source == "random"  # the bundle's head is untouched


def test_specdec_export_head_exports_the_layers_the_checkpoint_reads_and_attaches_it(head_model_dir, tmp_path):
    from specdec.cli.main import export_main

    dims = AutoModelForCausalLM.from_pretrained(head_model_dir).config
    write_checkpoint(tmp_path / "ckpt", dims.hidden_size, dims.vocab_size, "specforge")
    out = tmp_path / "bundle"
    assert export_main(["--target", str(head_model_dir), "--out", str(out), "--no-draft", "--max-seq-len", "64",
                        "--head", str(tmp_path / "ckpt")]) == 0
    manifest = read_manifest(out)
    assert manifest.target.feature_layers == [1, 3, 6] == manifest.head.feature_layers


def test_a_bundle_with_a_head_gives_it_to_another_bundle_of_the_same_model(random_head_bundle, head_model_dir,
                                                                             tmp_path):
    # the same tiny model exported again (another bundle of it, as a bf16 bundle is of the Q4_1 one) takes the head
    from tests.head.conftest import export_head_bundle

    other = export_head_bundle(tmp_path / "other", head_model_dir)
    assert read_manifest(other).head is None
    assert main(["calibrate", "head", str(other), "--from", str(random_head_bundle)]) == 0
    given, record = read_manifest(other).head, read_manifest(random_head_bundle).head
    assert given.feature_layers == record.feature_layers and given.draft_vocab_size == record.draft_vocab_size
    assert str(random_head_bundle) in given.source
    mine, theirs = read_head(other, given), read_head(random_head_bundle, record)
    for name, value in theirs.arrays().items():
        assert np.array_equal(mine.arrays()[name], value), name
    from specdec.cli.export import _head_layers

    assert _head_layers(str(random_head_bundle)) == tuple(record.feature_layers)


def test_a_bundle_without_a_head_or_of_another_model_gives_none(random_head_bundle, bundle, tmp_path, capsys):
    from tests.head.conftest import export_head_bundle

    headless = export_head_bundle(tmp_path / "headless", save_tiny_llama(tmp_path / "m8", layers=8))
    with pytest.raises(ExportError, match=r"(?s)has no draft head to give.*Hint"):
        attach_checkpoint(bundle, headless)
    shallow = export_head_bundle(tmp_path / "shallow", save_tiny_llama(tmp_path / "m6", layers=6))
    from specdec.head.format import attach_head

    attach_head(shallow, *_random_head_of(shallow))
    capsys.readouterr()
    assert main(["calibrate", "head", str(bundle), "--from", str(shallow)]) == 1
    err = capsys.readouterr().err
    assert "was made for another model" in err and "num_layers 6 against 8" in err and "Traceback" not in err
    damaged = shutil.copytree(random_head_bundle, tmp_path / "damaged")
    path = damaged / read_manifest(damaged).head.path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of its weights flipped
    path.write_bytes(bytes(data))
    assert main(["calibrate", "head", str(bundle), "--from", str(damaged)]) == 1
    assert "has sha256" in capsys.readouterr().err  # its file is checked before it is read
    assert read_manifest(bundle).head.source == "random"  # the bundle's head is untouched


def save_tiny_llama(folder, layers: int):
    from specdec.export.tiny import save_tiny

    return save_tiny(folder, "llama", layers=layers, seed=0, hidden=64, init_range=0.5)


def _random_head_of(bundle):
    from specdec.head.random import random_head
    from specdec.runtime.forward import head_feature_layers

    dims = read_manifest(bundle).target.dims
    return random_head(dims, head_feature_layers(dims.num_layers), np.arange(dims.vocab_size // 2), seed=1)
