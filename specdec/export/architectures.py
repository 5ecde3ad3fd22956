"""Architecture quirks, one small registered class per family.

Each class maps a Hugging Face causal LM onto the pieces the static-KV decoder needs: embeddings, per-layer
norms, Q/K/V projections, output projection, MLP, final norm and LM head. Dims come from optimum's
`NormalizedConfigManager`; nothing here inspects attributes by trial.
"""
from __future__ import annotations

import copy
from enum import StrEnum

import torch
from torch import nn

from specdec.errors import ExportError
from specdec.manifest import ModelDims

_REGISTRY: dict[str, type["Architecture"]] = {}


def register(*model_types: str):
    def wrap(cls):
        for name in model_types:
            _REGISTRY[name] = cls
        return cls

    return wrap


def supported_model_types() -> list[str]:
    return sorted(_REGISTRY)


def architecture_for(model: nn.Module) -> "Architecture":
    model_type = model.config.model_type
    cls = _REGISTRY.get(model_type)
    if cls is None:
        raise ExportError(
            f"model type {model_type!r} is not supported",
            f"supported model types: {', '.join(supported_model_types())}",
        )
    return cls(model)


def dims_from_config(config) -> ModelDims:
    """Convert an HF config once into ModelDims through optimum's normalized configs and the family's class."""
    from optimum.utils import NormalizedConfigManager

    normalized = NormalizedConfigManager.get_normalized_config_class(config.model_type)(config)
    family = _REGISTRY.get(config.model_type, Architecture)
    heads = normalized.num_attention_heads
    kv_heads = family.kv_heads(normalized)
    head_dim = getattr(config, "head_dim", None) or normalized.hidden_size // heads
    return ModelDims(
        model_type=config.model_type,
        num_layers=normalized.num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=normalized.hidden_size,
        vocab_size=normalized.vocab_size,
        max_positions=family.max_positions(config),
    )


def _packed_linear(projections: tuple):
    """nn.Linear layers on one input as one (weight [sum N, K], bias or None); None if any is not nn.Linear or only
    some have a bias."""
    if not all(isinstance(p, nn.Linear) for p in projections):
        return None
    biases = [p.bias for p in projections]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    weight = torch.cat([p.weight.detach() for p in projections])
    return weight, None if biases[0] is None else torch.cat([b.detach() for b in biases])


def _shallow_module_copy(module: nn.Module) -> nn.Module:
    """A copy whose submodule table can change without touching the original; parameters stay shared."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    return clone


class Architecture:
    """Llama-shaped decoder: pre-norm, separate q/k/v projections, gated MLP, rotary positions."""

    decoder_attr = "model"  # model.<decoder_attr>.<layers_attr> holds the blocks
    layers_attr = "layers"
    layer_count_attr = "num_hidden_layers"

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config
        self.dims = dims_from_config(model.config)

    # --- dims (from the config alone: an export checks them before it loads weights) -------------
    @staticmethod
    def kv_heads(normalized) -> int:
        """K/V heads of optimum's normalized config."""
        return getattr(normalized, "num_key_value_heads", normalized.num_attention_heads)

    @staticmethod
    def max_positions(config) -> int:
        return config.max_position_embeddings

    # --- structure -------------------------------------------------------------------------------
    def layers(self) -> nn.ModuleList:
        return getattr(getattr(self.model, self.decoder_attr), self.layers_attr)

    def embed_weight(self) -> nn.Parameter:
        return self.model.model.embed_tokens.weight

    def lm_head_weight(self) -> nn.Parameter:
        return self.model.lm_head.weight

    def lm_head_bias(self) -> torch.Tensor | None:
        return None

    def final_norm(self) -> nn.Module:
        return self.model.model.norm

    def sliding_window(self) -> int | None:
        return None

    def with_layers(self, count: int) -> "Architecture":
        """A model of the first `count` blocks sharing this one's weights (tied weights stay tied)."""
        model = _shallow_module_copy(self.model)
        model.config = copy.deepcopy(self.model.config)
        decoder = _shallow_module_copy(getattr(self.model, self.decoder_attr))
        setattr(decoder, self.layers_attr, self.layers()[:count])
        setattr(model, self.decoder_attr, decoder)
        setattr(model.config, self.layer_count_attr, count)
        return type(self)(model)

    # --- computation -----------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [B, T] -> [B, T, H]
        return nn.functional.embedding(input_ids, self.embed_weight())

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor):
        # positions: [B, T] -> cos, sin: [B, T, rotary_dim]
        return self.model.model.rotary_emb(hidden, positions)

    def attn_norm(self, layer: nn.Module) -> nn.Module:
        return layer.input_layernorm

    def mlp_norm(self, layer: nn.Module) -> nn.Module:
        return layer.post_attention_layernorm

    def rms_eps(self) -> float | None:
        """The epsilon of the RMSNorm this family uses (None: LayerNorm)."""
        return self.config.rms_norm_eps

    def qkv(self, layer: nn.Module, x: torch.Tensor):
        # x: [B, T, H] -> q: [B, T, Hq*D], k, v: [B, T, Hkv*D]
        attn = layer.self_attn
        return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)

    def qk_norm(self, layer: nn.Module, q: torch.Tensor, k: torch.Tensor):
        # q: [B, Hq, T, D], k: [B, Hkv, T, D]
        return q, k

    def out_proj(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layer.self_attn.o_proj(x)

    def mlp(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layer.mlp(x)

    # --- packed weights (the gqa lowering: one MatMul where the model has several on one input) -------------
    def packed_qkv(self, layer: nn.Module):
        """(weight [Hq*D + 2*Hkv*D, H], bias or None) of q, k and v side by side; None where they do not pack."""
        attn = layer.self_attn
        return _packed_linear((attn.q_proj, attn.k_proj, attn.v_proj))

    def qk_norms(self, layer: nn.Module):
        """(q norm, k norm): the RMSNorm modules a family applies to each head of q and k before rotary, or None."""
        return None

    def gelu_mlp(self, layer: nn.Module):
        """(up projection, GELU's approximation: "tanh" or "none", down projection) of an ungated GELU MLP
        (down(GELU(up(x))): GPT-2's), each projection a callable on x; None where the MLP is not one."""
        return None

    def packed_gate_up(self, layer: nn.Module):
        """(gate|up weight [2I, H], activation, down projection) of a gated MLP with bias-free gate and up
        (down(act(x @ gate) * (x @ up))); None where the MLP is not one."""
        mlp = layer.mlp
        packed = _packed_linear((mlp.gate_proj, mlp.up_proj))
        if packed is None or packed[1] is not None:
            return None
        return packed[0], mlp.act_fn, mlp.down_proj

    def attn_scale(self) -> float:
        return self.dims.head_dim**-0.5

    # --- the native engine's weights (specdec.export.native_family) --------------------------------------------------
    def products(self, layer: nn.Module) -> dict | None:
        """{qkv, o, gate_up, down: (weight [N, K], bias [N] or None)}: a layer's four products as the gqa lowering
        packs them; None where they do not pack so."""
        qkv, gated = self.packed_qkv(layer), self.packed_gate_up(layer)
        if qkv is None or gated is None:
            return None
        o, down = _packed_linear((layer.self_attn.o_proj,)), _packed_linear((gated[2],))
        if o is None or down is None:
            return None
        return {"qkv": qkv, "o": o, "gate_up": (gated[0], None), "down": down}

    def position_table(self) -> torch.Tensor | None:
        """[positions, H] of learned positions added to the embedding, or None (rotary)."""
        return None


@register("llama", "qwen2")
class LlamaArchitecture(Architecture):
    """Llama and Qwen2 (Qwen2's q/k/v biases live inside its projections)."""


@register("mistral")
class MistralArchitecture(Architecture):
    def sliding_window(self) -> int | None:
        return getattr(self.config, "sliding_window", None)


@register("qwen3")
class Qwen3Architecture(Architecture):
    """Qwen3 normalizes each head of q and k before rotary embedding."""

    def qk_norm(self, layer, q, k):
        # q: [B, Hq, T, D], k: [B, Hkv, T, D]; the norms act on D
        return layer.self_attn.q_norm(q), layer.self_attn.k_norm(k)

    def qk_norms(self, layer):
        return layer.self_attn.q_norm, layer.self_attn.k_norm  # the gqa lowering applies them to the packed q/k


@register("phi3")
class Phi3Architecture(Architecture):
    """Phi-3 packs q/k/v into one projection (its MLP packs gate/up, handled by its own module)."""

    def qkv(self, layer, x):
        attn = layer.self_attn
        packed = attn.qkv_proj(x)
        q_size = self.dims.num_heads * self.dims.head_dim
        kv_size = self.dims.num_kv_heads * self.dims.head_dim
        return packed.split([q_size, kv_size, kv_size], dim=-1)

    def packed_qkv(self, layer):
        return _packed_linear((layer.self_attn.qkv_proj,))

    def packed_gate_up(self, layer):
        mlp = layer.mlp  # gate_up_proj holds gate then up
        packed = _packed_linear((mlp.gate_up_proj,))
        return None if packed is None or packed[1] is not None else (packed[0], mlp.activation_fn, mlp.down_proj)

    def sliding_window(self) -> int | None:
        return getattr(self.config, "sliding_window", None)


def _conv1d(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A Hugging Face Conv1D (weight [K, N]) on x [..., K] as one MatMul and a bias Add (its own forward reshapes x
    to 2-D around a Gemm)."""
    return torch.matmul(x, conv.weight) + conv.bias


class GeluApproximation(StrEnum):
    """torch's GELU approximations (its `approximate` argument): onnxruntime's FastGelu and Gelu."""

    TANH = "tanh"
    NONE = "none"  # the exact erf form


# Hugging Face activation names of GELU (ACT2FN), by their approximation
GELU_APPROXIMATIONS = {"gelu_new": GeluApproximation.TANH, "gelu_pytorch_tanh": GeluApproximation.TANH,
                       "gelu_fast": GeluApproximation.TANH, "gelu": GeluApproximation.NONE}


@register("gpt2")
class Gpt2Architecture(Architecture):
    """GPT-2: learned absolute positions, LayerNorm, packed Conv1D attention, no rotary."""

    decoder_attr = "transformer"
    layers_attr = "h"
    layer_count_attr = "n_layer"

    @staticmethod
    def kv_heads(normalized) -> int:
        return normalized.num_attention_heads  # multi-head attention: one K/V head per head

    @staticmethod
    def max_positions(config) -> int:
        return config.n_positions

    def embed_weight(self):
        return self.model.transformer.wte.weight

    def final_norm(self):
        return self.model.transformer.ln_f

    def embed(self, input_ids, positions):
        wte = nn.functional.embedding(input_ids, self.embed_weight())
        return wte + nn.functional.embedding(positions, self.model.transformer.wpe.weight)

    def rotary(self, hidden, positions):
        return None

    def attn_norm(self, layer):
        return layer.ln_1

    def mlp_norm(self, layer):
        return layer.ln_2

    def rms_eps(self):
        return None

    def qkv(self, layer, x):
        return layer.attn.c_attn(x).split(self.dims.hidden_size, dim=-1)

    def packed_qkv(self, layer):
        conv = layer.attn.c_attn  # Conv1D: weight [H, 3H], q, k and v side by side
        return conv.weight.detach().t().contiguous(), conv.bias.detach()

    def packed_gate_up(self, layer):
        return None

    def gelu_mlp(self, layer):
        approximate = GELU_APPROXIMATIONS.get(self.config.activation_function)
        if approximate is None:
            return None
        mlp = layer.mlp
        return (lambda x: _conv1d(mlp.c_fc, x)), approximate, (lambda x: _conv1d(mlp.c_proj, x))

    def out_proj(self, layer, x):
        return _conv1d(layer.attn.c_proj, x)

    def products(self, layer):
        conv = lambda c: (c.weight.detach().t().contiguous(), c.bias.detach())  # noqa: E731  Conv1D's [K, N]
        return {"qkv": conv(layer.attn.c_attn), "o": conv(layer.attn.c_proj), "gate_up": conv(layer.mlp.c_fc),
                "down": conv(layer.mlp.c_proj)}

    def position_table(self):
        return self.model.transformer.wpe.weight
