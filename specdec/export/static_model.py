"""A torch module that implements the ONNX contract of docs/export.md on top of an HF model's weights.

forward(input_ids[B,T], cache_len[B], past_keys[L,B,Hkv,S,D], past_values[L,B,Hkv,S,D])
    -> logits[B,T,V], new_keys[L,B,Hkv,T,D], new_values[L,B,Hkv,T,D] (, features[B,T,F,H]: where feature_layers
       names F layers, every token's hidden state after each of them)

Positions are cache_len + arange(T); key slot s < cache_len[b] is visible; new token t' is visible to t iff
t' <= t. The past buffers are read only: the backend writes new_* at [cache_len, cache_len + T).
"""
from __future__ import annotations

import torch
from torch import nn

from specdec.export.architectures import Architecture


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, D]; cos, sin: [B, T, R] with R <= D (partial rotary keeps x[..., R:] as is)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def visibility_mask(cache_len: torch.Tensor, positions: torch.Tensor, max_seq_len: int, window: int | None):
    # cache_len: [B]; positions: [B, T] -> visible: [B, 1, 1, T, S+T] (bool, broadcast over Hkv and groups)
    slots = torch.arange(max_seq_len, device=positions.device, dtype=positions.dtype)
    past_visible = (slots[None, :] < cache_len[:, None])[:, None, :]  # [B, 1, S]
    past_visible = past_visible.expand(-1, positions.shape[1], -1)  # [B, T, S]
    new_visible = positions[:, None, :] <= positions[:, :, None]  # [B, T, T]: t' <= t
    if window is not None:
        past_visible = past_visible & (positions[:, :, None] - slots[None, None, :] < window)
        new_visible = new_visible & (positions[:, :, None] - positions[:, None, :] < window)
    return torch.cat((past_visible, new_visible), dim=-1)[:, None, None]


class StaticKVDecoder(nn.Module):
    """The exported graph: one forward serves prefill chunks, decode steps and verify passes."""

    def __init__(self, arch: Architecture, max_seq_len: int, feature_layers: tuple = ()):
        super().__init__()
        self.arch = arch
        self.model = arch.model  # registers the HF weights as submodule parameters
        self.max_seq_len = max_seq_len
        self.feature_layers = tuple(feature_layers)

    def features(self, hidden_states: list) -> tuple:
        # hidden_states: L x [B, T, H], each layer's output -> (features [B, T, F, H],) or () without feature layers
        if not self.feature_layers:
            return ()
        return (torch.stack([hidden_states[layer] for layer in self.feature_layers], dim=2),)

    def norm(self, module, x):
        # x: [B, T, H]; the HF norm module as it is (the gqa lowering fuses RMSNorm)
        return module(x)

    def project(self, layer, x, cos, sin):
        # x: [B, T, H] -> q: [B, Hq, T, D], k, v: [B, Hkv, T, D] (normalized and rotated)
        dims = self.arch.dims
        batch, steps, _ = x.shape
        q, k, v = self.arch.qkv(layer, x)
        q = q.view(batch, steps, dims.num_heads, dims.head_dim).transpose(1, 2)
        k = k.view(batch, steps, dims.num_kv_heads, dims.head_dim).transpose(1, 2)
        v = v.view(batch, steps, dims.num_kv_heads, dims.head_dim).transpose(1, 2)
        q, k = self.arch.qk_norm(layer, q, k)
        if cos is not None:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, k, v

    def attention(self, layer, x, cos, sin, past_k, past_v, visible):
        # x: [B, T, H]; past_k, past_v: [B, Hkv, S, D]; visible: [B, 1, 1, T, S+T]
        dims = self.arch.dims
        batch, steps, _ = x.shape
        q, k, v = self.project(layer, x, cos, sin)
        groups = dims.num_heads // dims.num_kv_heads
        q = q.reshape(batch, dims.num_kv_heads, groups, steps, dims.head_dim)  # [B, Hkv, G, T, D]
        keys = torch.cat((past_k, k), dim=2)[:, :, None]  # [B, Hkv, 1, S+T, D]
        values = torch.cat((past_v, v), dim=2)[:, :, None]
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.arch.attn_scale()  # [B, Hkv, G, T, S+T]
        scores = scores.float().masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = torch.matmul(probs, values)  # [B, Hkv, G, T, D]
        out = out.reshape(batch, dims.num_heads, steps, dims.head_dim).transpose(1, 2)
        return self.arch.out_proj(layer, out.reshape(batch, steps, dims.num_heads * dims.head_dim)), k, v

    def embed(self, input_ids, cache_len):
        # -> hidden [B, T, H], positions [B, T], (cos, sin) or (None, None)
        steps = input_ids.shape[1]
        positions = cache_len[:, None] + torch.arange(steps, dtype=cache_len.dtype, device=cache_len.device)[None]
        hidden = self.arch.embed(input_ids, positions)
        rotary = self.arch.rotary(hidden, positions)
        return hidden, positions, rotary if rotary is not None else (None, None)

    def head(self, hidden):
        # hidden: [B, N, H] -> logits [B, N, V] (float32)
        return self.lm_logits(self.norm(self.arch.final_norm(), hidden))

    def lm_logits(self, hidden):
        # hidden: [B, N, H], final norm applied -> logits [B, N, V] (float32); tied weights stay one initializer
        # (Gemm transB)
        batch, steps, width = hidden.shape
        logits = nn.functional.linear(hidden.reshape(batch * steps, width), self.arch.lm_head_weight())
        return logits.reshape(batch, steps, -1).float()

    def forward(self, input_ids, cache_len, past_keys, past_values):
        # input_ids: [B, T] int64; cache_len: [B] int64; past_*: [L, B, Hkv, S, D]
        hidden, positions, (cos, sin) = self.embed(input_ids, cache_len)
        visible = visibility_mask(cache_len, positions, self.max_seq_len, self.arch.sliding_window())
        new_keys, new_values, outputs = [], [], []
        for index, layer in enumerate(self.arch.layers()):
            attn_out, k, v = self.attention(
                layer, self.norm(self.arch.attn_norm(layer), hidden), cos, sin, past_keys[index], past_values[index],
                visible,
            )
            hidden = hidden + attn_out
            hidden = hidden + self.arch.mlp(layer, self.norm(self.arch.mlp_norm(layer), hidden))
            new_keys.append(k)
            new_values.append(v)
            outputs.append(hidden)
        # new_keys: [L, B, Hkv, T, D]
        return (self.head(hidden), torch.stack(new_keys), torch.stack(new_values), *self.features(outputs))
