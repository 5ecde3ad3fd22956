"""The forward pass on the native kernels: numpy for norms, rotary, attention and SiLU; static KV per slot."""
from __future__ import annotations

import numpy as np

from specdec.lowering import Geometry
from specdec.manifest import ModelDims
from specdec.native.weights import BLOCK, BLOCK4, NativeWeights


class NativeModel:
    """Also a KV source for the gqa driver's copy_kv (a draft taking this target's KV): `geometry` and `buffers`,
    the per-layer keys then values [slots, Hkv, S, D], as GqaDriver holds its own."""

    def __init__(self, weights: NativeWeights, dims: ModelDims, kernels, max_seq_len: int):
        self.weights = weights
        self.dims = dims
        self.kernels = kernels
        self.max_seq_len = max_seq_len
        self.geometry = Geometry(dims, max_seq_len, "float32")
        self.keys = self.values = None  # [L, slots, Hkv, S, D]
        self.buffers = []

    def reset(self, slots: int) -> None:
        d = self.dims
        shape = (d.num_layers, slots, d.num_kv_heads, self.max_seq_len, d.head_dim)
        if self.keys is None or self.keys.shape != shape:
            self.keys, self.values = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
            self.buffers = list(self.keys) + list(self.values)  # views, [slots, Hkv, S, D] each

    def matmul(self, x: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        # x: [M, K] -> [M, N] (blocks: [N, K / 32])
        x = np.ascontiguousarray(x, dtype=np.float32)
        y = np.empty((x.shape[0], blocks.shape[0]), np.float32)
        kernel = self.kernels.q41_gemm if blocks.dtype == BLOCK4 else self.kernels.q8_gemm
        kernel(x.ctypes.data, x.shape[0], blocks.shape[1] * BLOCK, blocks.ctypes.data, y.ctypes.data, blocks.shape[0])
        return y

    def norm(self, x: np.ndarray, gamma: np.ndarray) -> np.ndarray:
        # x: [T, H]
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(self.weights.epsilon)) * gamma

    @staticmethod
    def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        # x: [T, heads, D]; cos, sin: [T, 1, D / 2]; rotate-half, as GroupQueryAttention's non-interleaved rotary
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def attend(self, q: np.ndarray, layer: int, slot: int, pos: int) -> np.ndarray:
        # q: [T, Hq, D] at positions pos.. -> [T, Hq D], causal over the slot's KV [0, pos + T)
        q = np.ascontiguousarray(q, dtype=np.float32)
        out = np.empty(q.shape, np.float32)
        d = self.dims
        keys, values = self.keys[layer, slot], self.values[layer, slot]  # [Hkv, S, D], contiguous
        self.kernels.attention(q.ctypes.data, q.shape[0], d.num_heads, d.num_kv_heads, d.head_dim, keys.ctypes.data,
                               values.ctypes.data, self.max_seq_len, pos, self.weights.scale, out.ctypes.data)
        return out.reshape(q.shape[0], -1)

    def forward(self, tokens: np.ndarray, pos: int, slot: int, last_only: bool = False) -> np.ndarray:
        """tokens [T] at positions pos.. of `slot` -> logits [T, V] ([1, V] with last_only); K/V land at
        [pos, pos + T)."""
        w, d = self.weights, self.dims
        t, heads, kv, size = len(tokens), d.num_heads, d.num_kv_heads, d.head_dim
        end = pos + t
        cos, sin = w.cos[pos:end, None], w.sin[pos:end, None]  # [T, 1, D / 2]
        x = w.embedding[tokens]  # [T, H]
        for i, layer in enumerate(w.layers):
            qkv = self.matmul(self.norm(x, layer.input_norm), layer.qkv)  # [T, (Hq + 2 Hkv) D]
            q = self.rotate(qkv[:, : heads * size].reshape(t, heads, size), cos, sin)
            k = self.rotate(qkv[:, heads * size : (heads + kv) * size].reshape(t, kv, size), cos, sin)
            self.keys[i, slot, :, pos:end] = k.transpose(1, 0, 2)
            self.values[i, slot, :, pos:end] = qkv[:, (heads + kv) * size :].reshape(t, kv, size).transpose(1, 0, 2)
            x = x + self.matmul(self.attend(q, i, slot, pos), layer.o)
            gate, up = np.split(self.matmul(self.norm(x, layer.post_norm), layer.gate_up), 2, axis=-1)
            x = x + self.matmul(gate / (1 + np.exp(-gate)) * up, layer.down)
        if last_only:
            x = x[-1:]
        return self.matmul(self.norm(x, w.final_norm), w.head)
