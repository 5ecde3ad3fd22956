"""A model's layers as the native engine runs them, read from its family's Architecture (specdec.export.architectures):
the same modules and packings the gqa lowering traces into its graph, so the native weights compute that graph's
function, and the family's facts (norm, positions, MLP, biases, q/k norms, window, epsilon, scale) written once into
the bundle's native record, which both engines on specdec's kernels read. Nothing here reads the exported graph.

The engine runs the LLaMA layout (RMSNorm, packed q/k/v with optional biases and per-head q/k norms, rotary over whole
heads of a multiple of 16, o, packed gate/up with SiLU, down, a bias-free LM head) and GPT-2's (LayerNorm, learned
positions, a bias after every product, one up product into GELU). A model outside both raises NativeSkipped.
"""
from __future__ import annotations

import numpy as np
import torch

from specdec.export.architectures import GeluApproximation
from specdec.manifest import Activation, FamilyRecord, NormKind, PositionKind
from specdec.native.weights import LINEARS

GELU_ACTIVATIONS = {GeluApproximation.TANH: Activation.GELU_TANH, GeluApproximation.NONE: Activation.GELU}


class NativeSkipped(Exception):
    """Why a model gets no native weights (a message for the log and the manifest's reader, not an error)."""


def _array(tensor) -> np.ndarray:
    return np.ascontiguousarray(tensor.detach().float().cpu().numpy())


def _norm(module, rms_eps) -> tuple[dict, float]:
    """({"": gamma, "_bias": beta where LayerNorm}, epsilon) of a norm module."""
    if rms_eps is not None:
        return {"": _array(module.weight)}, float(rms_eps)
    if not isinstance(module, torch.nn.LayerNorm) or module.weight is None or module.bias is None:
        raise NativeSkipped(f"a norm is {type(module).__name__}, not RMSNorm or a LayerNorm with scale and bias")
    return {"": _array(module.weight), "_bias": _array(module.bias)}, float(module.eps)


def _rotary(arch, max_seq_len: int) -> dict:
    """{"cos", "sin": [S, D/2]} of rotary over whole heads, or {"positions": [P, H]} of learned ones."""
    dims = arch.dims
    rotary = arch.rotary(torch.zeros(1, max_seq_len, dims.hidden_size), torch.arange(max_seq_len)[None])
    if rotary is None:
        table = arch.position_table()
        if table is None or tuple(table.shape[1:]) != (dims.hidden_size,):
            raise NativeSkipped("its positions are neither rotary nor a learned [positions, H] table")
        return {"positions": _array(table)}
    if rotary[0].shape[-1] != dims.head_dim or dims.head_dim % 16:
        raise NativeSkipped(f"its rotary embedding turns {rotary[0].shape[-1]} of each head's {dims.head_dim} values; "
                            "the native engine rotates whole heads of a multiple of 16 (as the gqa lowering fuses them)")
    half = dims.head_dim // 2
    return {"cos": _array(rotary[0][0, :, :half]), "sin": _array(rotary[1][0, :, :half])}


def _activation(arch, layer) -> str:
    gelu = arch.gelu_mlp(layer)
    if gelu is not None:
        return GELU_ACTIVATIONS[gelu[1]]
    gated = arch.packed_gate_up(layer)
    probe = torch.linspace(-6, 6, 97)
    if gated is None or not torch.equal(gated[1](probe), torch.nn.functional.silu(probe)):
        raise NativeSkipped("its MLP is neither SiLU(gate)·up over bias-free gate and up nor GELU of one product")
    return Activation.SILU_GATED


def _layer(arch, index: int, layer, rms_eps) -> tuple[dict, dict, set]:
    """(linear weights [N, K] by name, the layer's other tensors, the epsilons its norms use)."""
    products = arch.products(layer)
    if products is None:
        raise NativeSkipped("its q/k/v or gate/up do not pack into one product each (as the gqa lowering packs them)")
    linears, tensors, eps = {}, {}, set()
    for name in LINEARS:
        weight, bias = products[name]
        linears[f"layers.{index}.{name}"] = _array(weight)
        if bias is not None:
            tensors[f"layers.{index}.{name}_bias"] = _array(bias)
    for name, module in (("input_norm", arch.attn_norm(layer)), ("post_norm", arch.mlp_norm(layer))):
        parts, epsilon = _norm(module, rms_eps)
        tensors.update({f"layers.{index}.{name}{suffix}": value for suffix, value in parts.items()})
        eps.add(epsilon)
    qk = arch.qk_norms(layer)
    if qk is not None:
        tensors[f"layers.{index}.q_norm"], tensors[f"layers.{index}.k_norm"] = _array(qk[0].weight), _array(qk[1].weight)
        eps.update(float(norm.variance_epsilon) for norm in qk)
    return linears, tensors, eps


def read_family(arch, max_seq_len: int) -> tuple[dict, dict, FamilyRecord]:
    """(linear weights [N, K] by name, every other tensor: norms, biases, tables, the embedding [V, H] and the head
    [V, H], the FamilyRecord) of `arch`'s model; NativeSkipped where it is outside the engine's layouts."""
    if arch.lm_head_bias() is not None:
        raise NativeSkipped("its LM head has a bias")
    rms_eps = arch.rms_eps()
    linears, tensors, eps = {}, {}, set()
    for index, layer in enumerate(arch.layers()):
        found = _layer(arch, index, layer, rms_eps)
        linears.update(found[0])
        tensors.update(found[1])
        eps |= found[2]
    final, epsilon = _norm(arch.final_norm(), rms_eps)
    tensors.update({f"final_norm{suffix}": value for suffix, value in final.items()})
    if len(eps | {epsilon}) > 1:
        raise NativeSkipped(f"its norms have epsilons {sorted(eps | {epsilon})}; the native engine takes one")
    tensors.update(_rotary(arch, max_seq_len))
    tensors["embedding"], tensors["head"] = _array(arch.embed_weight()), _array(arch.lm_head_weight())
    return linears, tensors, family_record(arch, max_seq_len, tensors, epsilon)


def family_record(arch, max_seq_len: int, tensors: dict, epsilon: float) -> FamilyRecord:
    """The family's facts the engines read (FamilyRecord), from `arch` and the tensors read_family found."""
    layers = list(arch.layers())
    window = arch.sliding_window()
    biased = [name for name in LINEARS if "layers.0." + name + "_bias" in tensors]
    if any(sum(f"layers.{i}.{name}_bias" in tensors for i in range(len(layers))) != len(layers) for name in biased):
        raise NativeSkipped("some of its layers' products have biases and others do not")
    return FamilyRecord(
        norm=NormKind.LAYER if "final_norm_bias" in tensors else NormKind.RMS,
        positions=PositionKind.LEARNED if "positions" in tensors else PositionKind.ROTARY,
        activation=_activation(arch, layers[0]), biases=biased, qk_norm="layers.0.q_norm" in tensors,
        window=window if window is not None and window < max_seq_len else 0, epsilon=epsilon,
        scale=float(arch.attn_scale()))
