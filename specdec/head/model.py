"""A draft head's forward (EAGLE-3 layout, specdec.head.format) over [B rows, T tokens] at per-row positions and KV
slots, with its own one-layer static KV [slots, Hkv, S, D]; rollback is the caller passing an earlier position.

One step at head position j takes the token that follows position j (its embedding: the target's, shared) and a
feature: at a position the target has verified, fc over the target's hidden states there (`fuse`); at a drafted
one, the head's own output hidden state of the position before, before its final norm (`prenorm`). It returns the
logits of the token after that one over the draft vocabulary, and that prenorm. The six products go through a
`products` object: fp32 numpy (FloatProducts, the reference) or the native kernels over Q8_0 blocks (BlockProducts,
specdec.head.kernels); norms, rotary and attention are numpy, or the whole layer is one call of the native kernels
(NativeLayer, beside BlockProducts).
"""
from __future__ import annotations

import numpy as np

from specdec.blocks import float_rows
from specdec.errors import CapacityError
from specdec.head.format import HeadWeights
from specdec.manifest import HeadRecord

PRODUCTS = ("fc", "qkv", "o", "gate_up", "down", "lm_head")  # the head's weights as products take them


def packed(weights: HeadWeights) -> dict:
    """name -> float32 [N, K] of PRODUCTS: q, k, v stacked into one product, gate and up into another."""
    return {"fc": weights.fc, "qkv": np.concatenate([weights.q, weights.k, weights.v]), "o": weights.o,
            "gate_up": np.concatenate([weights.gate, weights.up]), "down": weights.down, "lm_head": weights.lm_head}


class FloatProducts:
    """x @ W.T in fp32 numpy: the reference."""

    def __init__(self, matrices: dict):
        self.matrices = matrices  # name -> [N, K] float32

    def __call__(self, name: str, x: np.ndarray) -> np.ndarray:
        # x: [M, K] -> [M, N]
        return x @ self.matrices[name].T


class TokenEmbedding:
    """The target's token embedding, shared: a table of its native weights (float rows, or blocks such as a tied
    head's Q8_0), whose rows are made float32 at each lookup."""

    def __init__(self, table: np.ndarray):
        self.table = table  # [V, H] rows, or [V, H / 32] blocks

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        # ids: [B, T] -> [B, T, H]
        rows = float_rows(self.table[ids.reshape(-1)])
        return rows.reshape(*ids.shape, rows.shape[-1])


def rms_norm(x: np.ndarray, weight: np.ndarray, epsilon: float) -> np.ndarray:
    # x: [..., H] float32 -> [..., H] float32 (a sum over H in ufunc calls: a head step's rows are few and short)
    mean = np.square(x).sum(axis=-1, keepdims=True) / np.float32(x.shape[-1])
    return x * (np.float32(1) / np.sqrt(mean + np.float32(epsilon))) * weight


def rotary_table(inv_freq: np.ndarray, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [positions, D / 2] float32 of the angles p · inv_freq (computed in float64)."""
    angles = np.arange(positions, dtype=np.float64)[:, None] * inv_freq
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rotate(x: np.ndarray, positions: np.ndarray, table: tuple) -> np.ndarray:
    """Rotary embedding, the half-split layout of LLaMA in transformers. x: [B, T, heads, D]; positions: [B, T];
    table: rotary_table's (cos, sin), covering the positions."""
    cos, sin = table[0][positions][:, :, None], table[1][positions][:, :, None]  # [B, T, 1, D / 2]
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class HeadModel:
    """The head's weights, products and KV. `embed(ids [B, T]) -> [B, T, H]`: the target's token embedding."""

    def __init__(self, weights: HeadWeights, record: HeadRecord, embed, products, max_seq_len: int,
                 layer_of=None):
        """layer_of: None (the layer in numpy), or a function of (weights, record, products, rotary table) giving
        the layer in one call (specdec.head.kernels.NativeLayer)."""
        self.weights = weights
        self.record = record
        self.embed = embed
        self.products = products
        self.max_seq_len = max_seq_len
        self.keys = self.values = None  # [slots, Hkv, S, D]
        self.rotary = rotary_table(weights.inv_freq, max_seq_len)  # cos, sin [S, D / 2]
        self.layer = None if layer_of is None else layer_of(weights, record, products, self.rotary)

    @property
    def feature_layers(self) -> tuple:
        """The target layers whose hidden states `fuse` takes, in its order."""
        return tuple(self.record.feature_layers)

    @property
    def draft_ids(self) -> np.ndarray:
        """[V'] the target token id of each draft-vocabulary row."""
        return self.weights.draft_ids

    def to_target(self, logits: np.ndarray) -> np.ndarray:
        """logits [..., V'] over the draft vocabulary -> [..., V] over the target's, -inf (q = 0) where the head scores
        no token."""
        full = np.full((*logits.shape[:-1], self.record.vocab_size), -np.inf, np.float32)
        full[..., self.draft_ids] = logits
        return full

    def reserve(self, slots: int) -> None:
        """KV for at least `slots` slots; the slots it held keep their contents."""
        held = 0 if self.keys is None else len(self.keys)
        if slots <= held:
            return
        r = self.record
        shape = (slots, r.num_kv_heads, self.max_seq_len, r.head_dim)
        keys, values = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        if held:
            keys[:held], values[:held] = self.keys, self.values
        self.keys, self.values = keys, values

    def fuse(self, features: np.ndarray) -> np.ndarray:
        """features: [B, T, F, H] of the target's layers (feature_layers' order) -> the fused feature [B, T, H]."""
        fused = self._product("fc", features.reshape(*features.shape[:2], -1))
        return fused if self.weights.fc_bias is None else fused + self.weights.fc_bias

    def forward(self, tokens: np.ndarray, hidden: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                last_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """tokens: [B, T] int64 at positions[b].. of slots[b]; hidden: [B, T, H] (fused features, or the head's own
        prenorm) -> (logits [B, T or 1, V'] over the draft vocabulary, prenorm [B, T or 1, H]). K/V land at
        [positions[b], positions[b] + T) of each slot."""
        rows, steps = tokens.shape
        positions, slots = np.asarray(positions, np.int64), np.asarray(slots, np.int64)
        if rows and int(positions.max()) + steps > self.max_seq_len:
            raise CapacityError(f"a head step of {steps} tokens at positions {positions.tolist()} passes S = "
                                f"{self.max_seq_len}", "the caller must end the row with reason 'length' first")
        self.reserve(int(slots.max()) + 1)
        if self.layer is not None:
            return self.layer(self.embed(tokens), hidden, positions, slots, self.keys, self.values, last_only)
        w, eps = self.weights, self.record.epsilon
        feature = rms_norm(hidden, w.hidden_norm, eps)
        residual = feature if self.record.norm_before_residual else hidden
        x = np.concatenate([rms_norm(self.embed(tokens), w.input_norm, eps), feature], axis=-1)  # [B, T, 2H]
        queries = self._attention_inputs(x, positions, slots)  # [B, T, Hq, D]
        keep = slice(steps - 1, steps) if last_only else slice(0, steps)
        attended = self._attend(queries[:, keep], positions + steps, slots)  # [B, T', Hq D]
        h = residual[:, keep] + self._product("o", attended)
        gate, up = np.split(self._product("gate_up", rms_norm(h, w.post_norm, eps)), 2, axis=-1)
        prenorm = h + self._product("down", silu(gate) * up)
        return self._product("lm_head", rms_norm(prenorm, w.norm, eps)), prenorm

    def _product(self, name: str, x: np.ndarray) -> np.ndarray:
        # x: [..., K] -> [..., N]
        flat = np.ascontiguousarray(x.reshape(-1, x.shape[-1]), dtype=np.float32)
        out = self.products(name, flat)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _attention_inputs(self, x: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """q, k, v of x [B, T, 2H], rotated at their positions; k and v written into the slots -> q [B, T, Hq, D]."""
        r = self.record
        rows, steps = x.shape[:2]
        qkv = self._product("qkv", x).reshape(rows, steps, r.num_heads + 2 * r.num_kv_heads, r.head_dim)
        at = positions[:, None] + np.arange(steps)  # [B, T]
        qk = rotate(qkv[:, :, : r.num_heads + r.num_kv_heads], at, self.rotary)
        q, k, v = qk[:, :, : r.num_heads], qk[:, :, r.num_heads :], qkv[:, :, r.num_heads + r.num_kv_heads :]
        for b in range(rows):
            start = int(positions[b])
            self.keys[slots[b], :, start : start + steps] = k[b].transpose(1, 0, 2)
            self.values[slots[b], :, start : start + steps] = v[b].transpose(1, 0, 2)
        return q

    def _attend(self, q: np.ndarray, ends: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Causal attention of the queries q [B, T', Hq, D] (the last T' positions before ends[b]) over each slot's
        keys 0..ends[b]-1 -> [B, T', Hq D]."""
        r = self.record
        rows, steps = q.shape[:2]
        group, scale = r.num_heads // r.num_kv_heads, np.float32(1.0 / np.sqrt(r.head_dim))
        out = np.empty((rows, steps, r.num_heads * r.head_dim), np.float32)
        for b in range(rows):
            end = int(ends[b])
            keys, values = self.keys[slots[b], :, :end], self.values[slots[b], :, :end]  # [Hkv, end, D]
            query = q[b].reshape(steps, r.num_kv_heads, group, r.head_dim).transpose(1, 2, 0, 3)  # [Hkv, G, T', D]
            scores = query @ keys[:, None].transpose(0, 1, 3, 2) * scale  # [Hkv, G, T', end]
            seen = np.arange(end)[None, :] <= (end - steps + np.arange(steps))[:, None]  # [T', end]
            scores = np.where(seen, scores, -np.inf)
            weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
            weights /= weights.sum(axis=-1, keepdims=True)
            out[b] = (weights @ values[:, None]).transpose(2, 0, 1, 3).reshape(steps, -1)  # [T', Hq D]
        return out
