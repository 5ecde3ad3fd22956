"""The numpy references of kernels.cu, behind the same entry points as specdec.cuda.device.CupyKernels: CI runs the
cuda backend's orchestration (slots, rollback, graphs per shape, pinned hand-off, argmax on the "device") on these,
and the device check compares each kernel with its reference on a GPU. Numpy only.

"Device" arrays here are numpy arrays. capture() records the calls a body makes into a tape without running them,
as CUDA stream capture does (arrays held by reference, like device pointers; scalars frozen), and replay() runs the
tape: a body that reads a Python value which changes between calls replays stale values here as it would on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.blocks import float_rows
from specdec.cuda.layouts import layout_of
from specdec.weight_kinds import WeightKind


@dataclass
class DeviceWeight:
    """A weight on the device: `data` in its own layout (the reference keeps it as fp32 rows [N, K])."""

    data: object
    layout: WeightKind  # one the cuda kernels serve (specdec.cuda.layouts)
    n: int  # output columns
    k: int  # inputs

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def dense(array: np.ndarray, k: int | None = None) -> np.ndarray:
    """A native weights array [N, blocks] or [N, K] of a kind the cuda kernels serve -> fp32 rows [N, K] (K: the
    inputs, for pairs that end in a half-empty pair), by the numpy decoders (specdec.blocks.float_rows)."""
    layout_of(array)  # TypeError for a kind kernels.cu does not serve
    rows = float_rows(array)  # [N, elements * per]
    return rows if k is None else rows[:, :k]


ATT_WARPS = 4  # kernels.cu's ATT_WARPS


def attention_shared(size: int, dim: int) -> int:
    """Bytes of dynamic shared memory kernels.cu's attention over `size` slots takes a block."""
    return 4 * (size + ATT_WARPS * dim + 32)


class ReferenceKernels:
    """kernels.cu in numpy. few_rows: products of at most this many rows sum each row alone (the GPU's own product
    kernel); more go through one matrix product (cuBLAS on the GPU)."""

    name = "reference"
    max_shared = 1 << 62  # no limit on a CPU

    def __init__(self, few_rows: int = 64):
        self.few_rows = few_rows
        self._tape = None  # the calls being captured, or None
        self.launches = 0  # kernel calls run (eagerly or replayed)

    # ---- memory ----
    def weight(self, array: np.ndarray, k: int | None = None) -> DeviceWeight:
        rows = dense(array, k)
        return DeviceWeight(rows, layout_of(array), rows.shape[0], rows.shape[1])

    def upload(self, array: np.ndarray) -> np.ndarray:
        return np.array(array, copy=True)

    def empty(self, shape, dtype) -> np.ndarray:
        return np.zeros(shape, dtype)

    def pinned(self, shape, dtype) -> np.ndarray:
        return np.zeros(shape, dtype)

    @staticmethod
    def attention_shared(size: int, dim: int) -> int:
        return attention_shared(size, dim)

    def free_bytes(self) -> int | None:
        """Free device memory (None: not a device)."""
        return None

    def to_device(self, dst: np.ndarray, src: np.ndarray) -> None:
        """dst (device) <- src (pinned host), in stream order."""
        self._run(np.copyto, dst, src)

    def to_host(self, dst: np.ndarray, src: np.ndarray) -> None:
        """dst (pinned host) <- src (device), in stream order."""
        self._run(np.copyto, dst, src)

    def fetch(self, src: np.ndarray) -> np.ndarray:
        """A host copy of a device array, after the work queued before it."""
        return np.array(src, copy=True)

    def copy(self, src: np.ndarray) -> np.ndarray:
        """A device array of its own holding src, in stream order."""
        return np.array(src, copy=True)

    def copy_rows(self, dst: np.ndarray, src: np.ndarray) -> None:
        """dst [R, W] (rows at any pitch) <- src [R, W], on the device, in stream order (a graph captures it)."""
        self._run(np.copyto, dst, src)

    def synchronize(self) -> None:
        """Wait for the queued work (here it ran already)."""

    # ---- graphs ----
    def capture(self, body) -> list:
        """The calls `body` makes, recorded and not run."""
        self._tape = []
        try:
            body()
            return self._tape
        finally:
            self._tape = None

    def replay(self, graph: list) -> None:
        for fn, args in graph:
            fn(*args)
            self.launches += 1

    def _run(self, fn, *args) -> None:
        if self._tape is not None:
            self._tape.append((fn, args))
        else:
            fn(*args)
            self.launches += 1

    # ---- kernels ----
    def embed(self, table: DeviceWeight, ids: np.ndarray, out: np.ndarray) -> None:
        # ids: [M] int32; out: [M, H]
        self._run(_embed, table.data, ids, out)

    def rmsnorm(self, x: np.ndarray, gamma: np.ndarray, eps: float, out: np.ndarray, step: int = 1,
                offset: int = 0) -> None:
        # x: [R * step, H] -> out [R, H] of rows r * step + offset
        self._run(_rmsnorm, x, gamma, np.float32(eps), out, step, offset)

    def linear(self, x: np.ndarray, w: DeviceWeight, out: np.ndarray, accumulate: bool = False) -> None:
        # x: [M, K]; out: [M, N]
        self._run(_linear, x, w.data, out, accumulate, len(x) <= self.few_rows)

    def linear_norm(self, x: np.ndarray, gamma: np.ndarray, eps: float, w: DeviceWeight, out: np.ndarray,
                    accumulate: bool = False) -> None:
        # RMSNorm(x) . W^T in one kernel: (x * gamma) . W^T scaled by each row's rsqrt(mean(x^2) + eps)
        self._run(_linear_norm, x, gamma, np.float32(eps), w.data, out, accumulate, len(x) <= self.few_rows)

    def linear_silu(self, gu: np.ndarray, w: DeviceWeight, out: np.ndarray, accumulate: bool = False) -> None:
        # (SiLU(gate) * up) . W^T of [gate | up] rows [M, 2K] in one kernel
        self._run(_linear_silu, gu, w.data, out, accumulate, len(gu) <= self.few_rows)

    def rope_kv(self, qkv, cos, sin, pos, slots, steps: int, heads: int, kv_heads: int, q, keys, values) -> None:
        # qkv: [M, (Hq + 2 Hkv) D]; q: [M, Hq, D]; keys, values: one layer's [slots, Hkv, S, D]
        self._run(_rope_kv, qkv, cos, sin, pos, slots, steps, heads, kv_heads, q, keys, values)

    def attention(self, q, keys, values, pos, slots, steps: int, scale: float, out) -> None:
        # q: [M, Hq, D] -> out [M, Hq, D]
        self._run(_attention, q, keys, values, pos, slots, steps, np.float32(scale), out)

    def silu_mul(self, gu: np.ndarray, out: np.ndarray) -> None:
        # gu: [M, 2 I] -> out [M, I]
        self._run(_silu_mul, gu, out)

    def argmax(self, logits: np.ndarray, ids: np.ndarray, best: np.ndarray) -> None:
        # logits: [R, V] -> ids [R] int32, best [R] float32 (NaN where a logit is NaN or the largest not finite)
        self._run(_argmax, logits, ids, best)

    def chain_next(self, ids, best, head_rows, mapped: bool, fill: float, fill_token: int, tokens, pos, chain) -> None:
        # after a greedy draft step of B rows: next input tokens [B] (also into chain [B]), positions + 1
        self._run(_chain_next, ids, best, head_rows, mapped, np.float32(fill), fill_token, tokens, pos, chain)

    def close(self) -> None:
        """Nothing to release."""


def _embed(table, ids, out):
    out[...] = table[ids]


def _norm_scale(x, eps):
    # x: [M, K] -> 1 / sqrt(mean(x^2) + eps) [M], NaN where the mean square overflowed (kernels.cu's norm_scale)
    with np.errstate(over="ignore"):
        square = np.mean(x * x, axis=-1, dtype=np.float32)
    return np.where(np.isinf(square), np.float32(np.nan), np.float32(1.0) / np.sqrt(square + eps)).astype(np.float32)


def _rmsnorm(x, gamma, eps, out, step, offset):
    rows = x[offset::step][: len(out)]
    scale = _norm_scale(rows, eps)
    out[...] = rows * scale[:, None] * gamma


def _linear(x, w, out, accumulate, by_row):
    # w: [N, K] fp32
    if by_row:  # each row alone: its sum never depends on the call's other rows
        product = np.stack([w @ row for row in x]) if len(x) else np.zeros(out.shape, np.float32)
    else:
        product = x @ w.T
    if accumulate:
        out += product
    else:
        out[...] = product


def _linear_norm(x, gamma, eps, w, out, accumulate, by_row):
    scale = _norm_scale(x, eps)  # [M]
    product = np.zeros(out.shape, np.float32)
    _linear(x * gamma, w, product, False, by_row)
    product *= scale[:, None]
    if accumulate:
        out += product
    else:
        out[...] = product


def _linear_silu(gu, w, out, accumulate, by_row):
    width = gu.shape[-1] // 2
    act = np.empty((len(gu), width), np.float32)
    _silu_mul(gu, act)
    _linear(act, w, out, accumulate, by_row)


def _rotate(x, cs, sn):
    # x: [M, heads, D]; cs, sn: [M, D / 2]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cs[:, None], sn[:, None]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _rope_kv(qkv, cos, sin, pos, slots, steps, heads, kv_heads, q, keys, values):
    rows, dim = len(q), q.shape[-1]
    where = np.repeat(pos[: rows // steps], steps) + np.tile(np.arange(steps), rows // steps)  # [M]
    split = qkv.reshape(rows, heads + 2 * kv_heads, dim)
    q[...] = _rotate(split[:, :heads], cos[where], sin[where])
    k = _rotate(split[:, heads : heads + kv_heads], cos[where], sin[where])
    for m in range(rows):
        slot = slots[m // steps]
        keys[slot, :, where[m]] = k[m]
        values[slot, :, where[m]] = split[m, heads + kv_heads :]


def _attention(q, keys, values, pos, slots, steps, scale, out):
    rows, heads, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    for m in range(rows):
        b = m // steps
        n = int(pos[b]) + m % steps + 1
        k, v = keys[slots[b], :, :n], values[slots[b], :, :n]  # [Hkv, n, D]
        qm = q[m].reshape(kv_heads, group, dim)
        scores = np.einsum("kgd,knd->kgn", qm, k) * scale
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[m] = (np.einsum("kgn,knd->kgd", weights, v) / weights.sum(axis=-1, keepdims=True)).reshape(heads, dim)


def _silu_mul(gu, out):
    width = out.shape[-1]
    g, u = gu[:, :width], gu[:, width:]
    with np.errstate(over="ignore"):  # exp(-g) of a large negative g is inf, and g / inf the 0 the kernel gives
        out[...] = g / (np.float32(1.0) + np.exp(-g)) * u


def _chain_next(ids, best, head_rows, mapped, fill, fill_token, tokens, pos, chain):
    token = head_rows[ids] if mapped else ids.copy()
    if mapped:
        token = np.where((best < fill) | ((best == fill) & (fill_token < token)), fill_token, token)
    tokens[...] = token
    chain[...] = np.where(np.isnan(best), -1, token)  # a row whose logits were not all finite
    pos += 1


def _argmax(logits, ids, best):
    ids[...] = logits.argmax(axis=-1)
    top = logits.max(axis=-1)  # NaN where a logit is NaN; +inf, or -inf where all are
    best[...] = np.where(np.isfinite(top), logits[np.arange(len(logits)), ids], np.nan)

