"""Bring your own head: an EAGLE-3 checkpoint, as SpecForge and vllm-project/speculators publish it, made the bundle's
draft head (specdec.head.format). `specdec calibrate head BUNDLE --from DIR` and `specdec-export --head DIR` call
`attach_checkpoint`. DIR may also be another specdec bundle with a head (one trained by `specdec calibrate head` for
the same model, say its Q4_1 bundle's head given to its bf16 bundle): its head is copied as it is.

The checkpoint: safetensors files (or pytorch_model.bin) holding `fc.weight` [H, 3H] (and `fc.bias` in early
speculators heads), the decoder layer under `midlayer.` (SpecForge) or `layers.0.` (speculators): `self_attn.q_proj`,
`k_proj`, `v_proj` [·, 2H], `o_proj`, `mlp.gate_proj`, `up_proj`, `down_proj`, `input_layernorm`, `hidden_norm`,
`post_attention_layernorm`; `norm.weight`, `lm_head.weight` [V', H], `d2t` [V'] (target id = draft id + d2t[draft id])
and `t2d` [V] (unused here); an `embed_tokens.weight` is not read (the target's embedding is shared). Its config.json:
a LLaMA config (flat, or under `transformer_layer_config` in speculators' layout) with `draft_vocab_size`,
`norm_before_residual`, and the target layers it reads as `eagle_aux_hidden_state_layer_ids` (top level, or in
`eagle_config`). vLLM and SGLang count an aux layer id i as the *input* of layer i, which is our output of layer i - 1;
without ids, the layers vLLM picks by default (2, L / 2, L - 3 in its count: head_feature_layers).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from specdec.errors import ExportError
from specdec.head.format import HeadWeights, attach_head, read_head, record_for
from specdec.manifest import MANIFEST_NAME, HeadRecord, ModelDims, check_bundle_files, read_manifest
from specdec.runtime.forward import head_feature_layers

LAYER_PREFIXES = ("midlayer.", "layers.0.")  # SpecForge's, speculators'
LAYER_TENSORS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                 "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
                 "input_norm": "input_layernorm", "hidden_norm": "hidden_norm", "post_norm": "post_attention_layernorm"}
HINT = "pass the directory of an EAGLE-3 checkpoint in SpecForge's or vllm-project/speculators' layout (docs/heads.md)"


def attach_checkpoint(bundle: str | Path, checkpoint: str | Path) -> HeadRecord:
    """Read the EAGLE-3 checkpoint at `checkpoint` (or the head of the specdec bundle there) and make it the draft
    head of the bundle at `bundle` (replacing any); -> the record written."""
    bundle = Path(bundle)
    target = read_manifest(bundle).target.dims
    if _is_bundle(checkpoint):
        weights, record = head_from_bundle(checkpoint, target)
    else:
        weights, record = head_from_checkpoint(checkpoint, target)
    return attach_head(bundle, weights, record)


def _is_bundle(folder: str | Path) -> bool:
    """Whether `folder` is a specdec bundle (its manifest), not a checkpoint."""
    return (Path(folder) / MANIFEST_NAME).is_file()


def head_from_bundle(folder: str | Path, target: ModelDims) -> tuple[HeadWeights, HeadRecord]:
    """(weights, record) of the head of the bundle at `folder`, its file checked against its hash, for a target of
    `target`'s dims: the bundle's own target must have the same dims (a head reads its target's hidden states, so it
    serves that model alone, in whatever precision)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    record = manifest.head
    if record is None:
        raise ExportError(f"the bundle at {folder} has no draft head to give",
                          f"train one there first (specdec calibrate head {folder}), or {HINT}")
    source = manifest.target.dims
    if source != target:
        differ = [f"{name} {getattr(source, name)} against {getattr(target, name)}"
                  for name in type(source).__dataclass_fields__ if getattr(source, name) != getattr(target, name)]
        raise ExportError(f"the head of {folder} was made for another model: its target differs in "
                          f"{', '.join(differ)}", "give a bundle the head of a bundle of the same model")
    check_bundle_files(folder, manifest, sorted({record.path, *record.files}))
    weights = read_head(folder, record)
    return weights, dataclasses.replace(record, source=f"{record.source or 'a head'}, from {folder}")


def head_from_checkpoint(folder: str | Path, target: ModelDims) -> tuple[HeadWeights, HeadRecord]:
    """(weights, record) of the checkpoint at `folder` for a target of `target`'s dims."""
    folder = Path(folder)
    config = _config(folder)
    layer = config.get("transformer_layer_config") or config  # speculators nests the decoder layer's config
    _check_supported(layer, config)
    tensors = _tensors(folder)
    prefix = next((p for p in LAYER_PREFIXES if f"{p}self_attn.q_proj.weight" in tensors), None)
    if prefix is None:
        raise ExportError(f"the checkpoint at {folder} has no decoder layer (no {LAYER_PREFIXES[0]}self_attn.q_proj."
                          f"weight nor {LAYER_PREFIXES[1]}self_attn.q_proj.weight)", HINT)
    get = lambda name: _tensor(tensors, name, folder)  # noqa: E731
    lm_head = get("lm_head.weight")
    fc_bias = tensors.get("fc.bias")
    weights = HeadWeights(fc=get("fc.weight"), **{ours: get(f"{prefix}{theirs}.weight")
                                                  for ours, theirs in LAYER_TENSORS.items()},
                          norm=get("norm.weight"), lm_head=lm_head, draft_ids=_draft_ids(tensors, len(lm_head)),
                          inv_freq=_rotary(layer), fc_bias=None if fc_bias is None else _float(fc_bias))
    vocab = int(layer.get("vocab_size") or target.vocab_size)
    record = record_for(weights, _feature_layers(folder, target.num_layers), vocab,
                        float(layer.get("rms_norm_eps", 1e-6)), bool(config.get("norm_before_residual", False)),
                        source=str(folder))
    return weights, record


def _config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read the head's config {path}: {exc}", HINT) from None


def _check_supported(layer: dict, config: dict) -> None:
    """ExportError where the checkpoint uses a part this head does not run."""
    unsupported = [(layer.get("attention_bias") or layer.get("mlp_bias"), "biases on its attention or MLP products"),
                   (layer.get("hidden_act", "silu") != "silu", f"the activation {layer.get('hidden_act')!r}"),
                   (int(layer.get("num_hidden_layers", 1)) != 1, f"{layer.get('num_hidden_layers')} decoder layers"),
                   (config.get("target_hidden_size") not in (None, layer.get("hidden_size")),
                    f"a target hidden size {config.get('target_hidden_size')} apart from its own")]
    for found, what in unsupported:
        if found:
            raise ExportError(f"the EAGLE-3 checkpoint has {what}, which specdec's head does not run",
                              "use a one-layer LLaMA-layout EAGLE-3 head without biases")


def _tensors(folder: Path) -> dict:
    """name -> torch tensor of every safetensors file of `folder`, else of its pytorch_model.bin."""
    import torch

    files = sorted(folder.glob("*.safetensors"))
    try:
        if files:
            from safetensors.torch import load_file

            return {name: value for path in files for name, value in load_file(path).items()}
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise ExportError(f"cannot read the head's weights in {folder}: {exc}", HINT) from None


def _float(tensor) -> np.ndarray:
    return np.ascontiguousarray(tensor.float().numpy(), dtype=np.float32)


def _tensor(tensors: dict, name: str, folder: Path) -> np.ndarray:
    for key in (name, f"model.{name}"):
        if key in tensors:
            return _float(tensors[key])
    raise ExportError(f"the checkpoint at {folder} has no tensor {name}", HINT)


def _draft_ids(tensors: dict, rows: int) -> np.ndarray:
    """[V'] target ids of the LM head's rows: arange(V') + d2t, or arange(V') where the head scores every token;
    ExportError where the checkpoint's t2d marks other target tokens than those."""
    offsets = tensors.get("d2t")
    ids = np.arange(rows, dtype=np.int64)
    if offsets is not None:
        ids = ids + offsets.long().numpy().astype(np.int64)
    marks = tensors.get("t2d")
    if marks is not None and not np.array_equal(np.flatnonzero(marks.bool().numpy()), np.sort(ids)):
        raise ExportError("the checkpoint's t2d marks other target tokens than arange(V') + d2t names",
                          "check that d2t holds offsets (target id = draft id + d2t[draft id]), as EAGLE-3 stores it")
    return ids


def _rotary(layer: dict) -> np.ndarray:
    """[D / 2] the rotary frequencies transformers computes for this config (its rope scaling included)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    fields = dict(layer)
    for key in ("architectures", "model_type"):  # another model's names; the rotary needs LLaMA's fields alone
        fields.pop(key, None)
    rotary = LlamaRotaryEmbedding(LlamaConfig(**fields))
    if float(rotary.attention_scaling) != 1.0:
        raise ExportError(f"the head's rope scaling scales attention by {float(rotary.attention_scaling)}, which "
                          "specdec's head does not run", "use a head with default or llama3 rope scaling")
    return _float(rotary.inv_freq)


def pinned_layers(folder: str | Path) -> tuple | None:
    """The target layers (outputs of layer l) the checkpoint at `folder` reads, where its config pins them; None
    where it does not (then it reads head_feature_layers of the target). A bundle's head pins its own."""
    if _is_bundle(folder):
        head = read_manifest(Path(folder)).head
        return None if head is None else tuple(head.feature_layers)  # (none: head_from_bundle says so)
    config = _config(Path(folder))
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if not ids:
        return None
    if any(int(i) < 1 for i in ids):  # vLLM's aux id i is the input of layer i: our output of layer i - 1
        raise ExportError(f"the head reads aux hidden states {list(ids)}; id 0 (the embedding's output) is no layer's "
                          "output", "use a head that reads the outputs of decoder layers")
    return tuple(int(i) - 1 for i in ids)


def _feature_layers(folder: Path, num_layers: int) -> list:
    """Our feature layers of the checkpoint: its pinned ones, else the default three of a target of `num_layers`."""
    pinned = pinned_layers(folder)
    return list(head_feature_layers(num_layers) if pinned is None else pinned)
