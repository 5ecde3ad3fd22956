"""The draft head in PyTorch, for training: the function specdec.head.model computes at inference (the same norms,
rotary, grouped attention over [normed embedding ‖ normed feature] and residual convention), over whole sequences,
and the training-time test of EAGLE-3: a chain of simulated draft steps where step k > 0 feeds the head's own output
hidden state (before its final norm) of the step before, as HeadDrafter does.

Step k of origin j sits at position j + k: it takes token t_{j+k+1} and scores t_{j+k+2}. Its query sees the step-0
keys of positions 0..j (those the head computed from the target's own features, as after a catch-up) and the keys of
steps 1..k of the same origin (the chain's own positions j + 1..j + k): the KV the head holds when it drafts.
tests/calibration/test_head_train_parity.py checks both against the numpy forward on the same weights.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from specdec.head.format import HeadWeights
from specdec.manifest import HeadRecord

LAYER = ("q", "k", "v", "o", "gate", "up", "down")  # the products a TorchHead trains (nn.Linear, no bias)
NORMS = ("input_norm", "hidden_norm", "post_norm", "norm")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    # x: [..., H] -> [..., H], as specdec.head.model.rms_norm
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + epsilon) * weight


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """LLaMA's half-split rotary, angles in float64 as specdec.head.model.rotate. x: [B, T, heads, D]; positions:
    [B, T]."""
    angles = positions[..., None].double() * inv_freq.double()  # [B, T, D / 2]
    cos, sin = angles.cos().float()[:, :, None], angles.sin().float()[:, :, None]
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


class TorchHead(nn.Module):
    """The head's weights as trainable parameters (draft_ids and inv_freq fixed buffers). `embedding`: the target's
    token embedding [V, H] (frozen, shared)."""

    def __init__(self, weights: HeadWeights, record: HeadRecord, embedding: np.ndarray):
        super().__init__()
        self.record = record
        self.fc = nn.Parameter(torch.from_numpy(np.array(weights.fc)))
        for name in (*LAYER, *NORMS, "lm_head"):
            setattr(self, name, nn.Parameter(torch.from_numpy(np.array(getattr(weights, name)))))
        self.register_buffer("embedding", torch.from_numpy(np.asarray(embedding, np.float32)), persistent=False)
        self.register_buffer("draft_ids", torch.from_numpy(np.array(weights.draft_ids)))
        self.register_buffer("inv_freq", torch.from_numpy(np.array(weights.inv_freq)))

    def weights(self) -> HeadWeights:
        """The current weights as the bundle's format holds them (float32 numpy)."""
        arrays = {name: getattr(self, name).detach().cpu().numpy().astype(np.float32)
                  for name in ("fc", *LAYER, *NORMS, "lm_head")}
        return HeadWeights(**arrays, draft_ids=self.draft_ids.cpu().numpy().astype(np.int64),
                           inv_freq=self.inv_freq.cpu().numpy().astype(np.float32))

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        # features: [B, T, F, H] -> [B, T, H]
        return features.flatten(-2) @ self.fc.T

    def attention_inputs(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> tuple:
        """tokens [B, T], hidden [B, T, H] (fused features or the head's prenorm), positions [B, T] -> (q [B, T, Hq,
        D], k, v [B, T, Hkv, D], the residual [B, T, H])."""
        r, eps = self.record, self.record.epsilon
        feature = rms_norm(hidden, self.hidden_norm, eps)
        residual = feature if r.norm_before_residual else hidden
        x = torch.cat([rms_norm(self.embedding[tokens], self.input_norm, eps), feature], dim=-1)  # [B, T, 2H]
        shape = (*tokens.shape, -1, r.head_dim)
        q = rotate((x @ self.q.T).reshape(shape), positions, self.inv_freq)
        k = rotate((x @ self.k.T).reshape(shape), positions, self.inv_freq)
        return q, k, (x @ self.v.T).reshape(shape), residual

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> tuple:
        """attended [B, T, Hq D], residual [B, T, H] -> (logits [B, T, V'], prenorm [B, T, H])."""
        eps = self.record.epsilon
        h = residual + attended @ self.o.T
        x = rms_norm(h, self.post_norm, eps)
        prenorm = h + (nn.functional.silu(x @ self.gate.T) * (x @ self.up.T)) @ self.down.T
        return rms_norm(prenorm, self.norm, eps) @ self.lm_head.T, prenorm

    def grouped(self, kv: torch.Tensor) -> torch.Tensor:
        # kv: [B, T, Hkv, D] -> [B, Hq, T, D]: each key-value head serves num_heads / num_kv_heads query heads
        group = self.record.num_heads // self.record.num_kv_heads
        return kv.repeat_interleave(group, dim=2).transpose(1, 2)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple:
        """One causal pass from position 0 (a catch-up): tokens [B, T], hidden [B, T, H] -> (logits [B, T, V'],
        prenorm [B, T, H])."""
        positions = torch.arange(tokens.shape[1]).expand(tokens.shape)
        q, k, v, residual = self.attention_inputs(tokens, hidden, positions)
        attended = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), self.grouped(k), self.grouped(v), is_causal=True)  # [B, Hq, T, D]
        return self.finish(attended.transpose(1, 2).flatten(-2), residual)

    def chain(self, tokens: torch.Tensor, fused: torch.Tensor, steps: int) -> list:
        """The training-time test: tokens [B, T], fused [B, T, H] (the target's features, fused) -> for each step
        k < steps the logits [B, T - 1, V'] of every origin j = 0..T-2 (step k scores token j + k + 2; where that
        passes T - 1 the row holds padding: mask it)."""
        n = tokens.shape[1] - 1
        origins = torch.arange(n).expand(tokens.shape[0], n)
        q, k, v, residual = self.attention_inputs(tokens[:, 1:], fused[:, :-1], origins)
        keys, values = self.grouped(k), self.grouped(v)  # [B, Hq, n, D]: step 0's, at positions 0..n-1
        attended = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), keys, values, is_causal=True)
        logits, prenorm = self.finish(attended.transpose(1, 2).flatten(-2), residual)
        out, own_keys, own_values = [logits], [], []
        for step in range(1, steps):
            ahead = nn.functional.pad(tokens[:, step + 1:], (0, step))  # [B, n]: token j + step + 1, 0 past the end
            q, k, v, residual = self.attention_inputs(ahead, prenorm, origins + step)
            own_keys.append(self.grouped(k))
            own_values.append(self.grouped(v))
            attended = self._chain_attention(q.transpose(1, 2), keys, values, own_keys, own_values)
            logits, prenorm = self.finish(attended, residual)
            out.append(logits)
        return out

    def _chain_attention(self, q, keys, values, own_keys: list, own_values: list) -> torch.Tensor:
        """q [B, Hq, n, D] of origin j over step 0's keys of positions 0..j and its own chain's keys (own_keys: one
        [B, Hq, n, D] a step, row j the key of origin j) -> [B, n, Hq D]."""
        n, scale = q.shape[2], self.record.head_dim ** -0.5
        scores = (q @ keys.transpose(-1, -2)) * scale  # [B, Hq, n, n]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        own = torch.stack([(q * key).sum(-1) for key in own_keys], dim=-1) * scale  # [B, Hq, n, steps]
        weights = torch.softmax(torch.cat([scores, own], dim=-1), dim=-1)
        attended = weights[..., :n] @ values + sum(weights[..., n + i, None] * value
                                                   for i, value in enumerate(own_values))
        return attended.transpose(1, 2).flatten(-2)
