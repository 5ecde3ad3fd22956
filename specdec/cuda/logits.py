"""Logits that stay on the device: a forward's result as the loop sees it. Its argmax came back with the call (the
token ids of each row, computed on the device); the logits themselves cross to the host only when something reads
them (a sampled request warps them, a test compares them), through np.asarray.

A view (`logits[b]`, `logits[b, :n]`, `logits[-1]`, `logits[None]`) indexes the rows and positions only; indexing
the vocabulary axis reads the logits to the host first.
"""
from __future__ import annotations

import numpy as np


class DeviceResult:
    """One forward's logits [R, V'] on the device and its argmax: materialize() reads them to the host once, turning
    the rows a trimmed head scores into the whole vocabulary (a draft's head_rows and fill)."""

    def __init__(self, kernels, logits, ids: np.ndarray, best: np.ndarray, shape: tuple, head_rows=None,
                 fill: float = 0.0):
        self.kernels, self.logits = kernels, logits  # [R, V'] on the device
        self._ids, self._best = ids, best  # [R] argmax over the scored rows and its logit
        self.shape = shape  # (B, T or 1, V)
        self.head_rows, self.fill = head_rows, fill
        self.host = None  # [R, V] once read
        self._tokens = None

    def detach(self) -> None:
        """Keep the logits in a device copy of their own: the workspace they lie in is about to be reused."""
        if self.host is None and self.logits is not None:
            self.logits = self.kernels.copy(self.logits)

    def materialize(self) -> np.ndarray:
        if self.host is None:
            scored = self.kernels.fetch(self.logits)  # [R, V']
            if self.head_rows is None:
                self.host = scored
            else:
                self.host = np.full((len(scored), self.shape[-1]), self.fill, np.float32)
                self.host[:, self.head_rows] = scored
            self.kernels = self.logits = None
        return self.host

    def tokens(self) -> np.ndarray:
        """[R] int64: the token id of each row's largest logit (the first of equals, as numpy's argmax)."""
        if self._tokens is None:
            ids = self._ids.astype(np.int64)
            if self.head_rows is not None:
                ids = self.head_rows[ids]
                if (self._best <= self.fill).any():  # an unscored token ties or wins: the first of them decides
                    ids = self.materialize().argmax(axis=-1)
            self._tokens = ids
        return self._tokens


class DeviceLogits:
    """A view of a DeviceResult: `index` holds the flat row of each (b, t) it shows."""

    dtype = np.dtype(np.float32)

    def __init__(self, result: DeviceResult, index: np.ndarray | None = None):
        self.result = result
        rows, steps = result.shape[:2]
        self.index = np.arange(rows * steps).reshape(rows, steps) if index is None else index

    @property
    def shape(self) -> tuple:
        return self.index.shape + (self.result.shape[-1],)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        if not self.index.ndim:
            raise TypeError("len() of a single position's logits")
        return len(self.index)

    def __getitem__(self, key):
        parts = key if isinstance(key, tuple) else (key,)
        if sum(part is not None and part is not Ellipsis for part in parts) > self.index.ndim or Ellipsis in parts:
            return np.asarray(self)[key]  # the vocabulary axis: on the host
        return DeviceLogits(self.result, self.index[key])

    def __array__(self, dtype=None, copy=None):
        out = self.result.materialize()[self.index]
        return out if dtype is None else out.astype(dtype)

    def astype(self, dtype) -> np.ndarray:
        return np.asarray(self).astype(dtype)

    def argmax(self, axis=None, out=None, keepdims=False):
        if out is not None or keepdims or axis not in (None, -1, self.ndim - 1) or (axis is None and self.index.ndim):
            return np.asarray(self).argmax(axis=axis, out=out, keepdims=keepdims)
        found = self.result.tokens()[self.index]
        return int(found) if not self.index.ndim else found

    def __repr__(self) -> str:
        return f"DeviceLogits(shape={self.shape})"

