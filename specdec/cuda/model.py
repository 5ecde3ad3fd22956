"""The forward pass on the cuda kernels: a bundle's native weights uploaded once in their own layout, static KV per
slot on the device, workspaces allocated once, and one CUDA graph per call shape (rows B, tokens T, last-only) of
the decode loop, captured at its first use and replayed with the tokens, positions and slots written through a
pinned buffer. Logits stay on the device; each call brings back only every row's argmax (DeviceLogits).

Kernels are an object with the entry points of specdec.cuda.reference.ReferenceKernels: CupyKernels on a GPU, the
numpy references on a CPU (tests).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np

from specdec.cuda.logits import DeviceLogits, DeviceResult
from specdec.errors import BackendError, nonfinite_logits
from specdec.manifest import ModelDims
from specdec.native.core import KernelModel, check_rows
from specdec.native.weights import LINEARS, DraftWeights, NativeWeights

F32, I32 = np.dtype(np.float32), np.dtype(np.int32)
FEATURES = 4  # hidden states one call may return (a trained head reads three)


@dataclass
class DeviceLayer:
    input_norm: object  # [H]
    post_norm: object
    qkv: object  # DeviceWeight [(Hq + 2 Hkv) D, H]
    o: object
    gate_up: object
    down: object


class Workspace:
    """Every buffer one call of up to `rows` rows (B <= `slots`) works in, and its pinned host ends: `host` holds
    tokens [rows], positions [slots] and slots [slots] (int32, one upload), `out` the argmax ids [rows] then their
    logits' bits [rows] (one download). A graph captures these addresses: they never move."""

    def __init__(self, kernels, dims: ModelDims, mlp: int, vocab: int, rows: int, slots: int, logit_rows: int):
        k, H, QD = kernels, dims.hidden_size, dims.num_heads * dims.head_dim
        self.rows, self.slots = rows, slots
        self.host = k.pinned(rows + 2 * slots, I32)
        self.inputs = k.empty(rows + 2 * slots, I32)
        self.x, self.xn = k.empty((rows, H), F32), k.empty((rows, H), F32)
        self.qkv = k.empty((rows, (dims.num_heads + 2 * dims.num_kv_heads) * dims.head_dim), F32)
        self.q = k.empty((rows, dims.num_heads, dims.head_dim), F32)
        self.att = k.empty((rows, dims.num_heads, dims.head_dim), F32)
        self.gu, self.act = k.empty((rows, 2 * mlp), F32), k.empty((rows, mlp), F32)
        self.logits = k.empty((logit_rows, vocab), F32)
        self.result = k.empty(2 * logit_rows, I32)  # argmax ids, then their logits as bits
        self.ids, self.best = self.result[:logit_rows], self.result[logit_rows:].view(F32)
        self.out = k.pinned(2 * logit_rows, I32)
        self.flat_att = self.att.reshape(rows, QD)
        self.chain, self.chain_host = k.empty(rows, I32), k.pinned(rows, I32)  # a draft chain's tokens [steps, B]
        self.features = k.empty((rows, FEATURES, dims.hidden_size), F32)  # hidden states after chosen layers

    @staticmethod
    def nbytes(dims: ModelDims, mlp: int, vocab: int, rows: int, slots: int, logit_rows: int) -> int:
        H, QKV = dims.hidden_size, (dims.num_heads + 2 * dims.num_kv_heads) * dims.head_dim
        per_row = (2 + FEATURES) * H + QKV + 2 * dims.num_heads * dims.head_dim + 3 * mlp + 2
        return 4 * (rows * per_row + 2 * slots + logit_rows * (vocab + 2))

    def write(self, tokens: np.ndarray, pos: np.ndarray, slots: np.ndarray) -> None:
        rows = tokens.size
        self.host[:rows] = tokens.reshape(-1)
        self.host[self.rows : self.rows + len(pos)] = pos
        self.host[self.rows + self.slots : self.rows + self.slots + len(slots)] = slots

    def views(self, batch: int) -> tuple:
        """(positions, slots) of `batch` rows on the device."""
        return (self.inputs[self.rows : self.rows + batch],
                self.inputs[self.rows + self.slots : self.rows + self.slots + batch])


@dataclass
class GraphCache:
    """The captured graph of each call shape; dropped whenever an address it holds changes (KV reallocated)."""

    graphs: dict = field(default_factory=dict, repr=False)
    kv_version: int = -1
    captures: int = 0
    replays: int = 0

    def valid_for(self, kv_version: int) -> None:
        if kv_version != self.kv_version:
            self.graphs.clear()
            self.kv_version = kv_version


class CudaModel(KernelModel):
    """One model on the kernels. draft: an int4-q41 draft's pairs and head, run on `weights` (its target's norms,
    rotary tables and embedding) and on kv_owner's KV (its target's): it writes only past the target's committed
    positions, which the target's verify pass then overwrites, as the native engine's draft does.

    graph_rows: calls of at most this many rows (B * T) run as graphs (every decode step and verify pass); longer
    ones (prefill chunks) run eagerly, their products on cuBLAS."""

    def __init__(self, kernels, weights: NativeWeights, dims: ModelDims, max_seq_len: int, max_batch: int,
                 graph_rows: int, draft: DraftWeights | None = None, kv_owner: "CudaModel | None" = None,
                 graphs: bool = True, fused: bool = True):
        super().__init__(weights, dims, max_seq_len, draft, kv_owner)
        self.kernels = kernels
        self.max_batch = max_batch
        self.graph_rows = graph_rows
        self.use_graphs = graphs
        self.fused = fused  # RMSNorm inside the next product, SiLU inside the down projection (3 launches a layer)
        self.layers = self.embedding = self.head = None
        self.norms = self.tables = None  # per layer (input, post) norms; (final norm, cos, sin) on the device
        self.head_map = None  # (head_rows [V'] on the device, mapped, fill, first unscored token) for chains
        self.keys = self.values = None  # [L, slots, Hkv, S, D] on the device (owner only)
        self.kv_version = 0
        self.graphs = GraphCache()
        self.small = self.large = None
        self._live = weakref.WeakSet()  # results whose logits may still be read

    # ---- opening ----
    @property
    def mlp(self) -> int:
        return self.weights.mlp_width

    @property
    def scored(self) -> int:
        """Rows of the head: the vocabulary, or a draft's trimmed head."""
        return len(self.draft.head) if self.draft is not None else len(self.weights.head)

    def weight_bytes(self) -> int:
        """Bytes this model uploads (a draft: its pairs and head alone)."""
        if self.draft is not None:
            return sum(p.nbytes for pairs in self.draft.pairs for p in pairs) + self.draft.head.nbytes
        w = self.weights
        tables = [w.final_norm, w.head, w.cos, w.sin] + ([w.embedding] if w.embedding is not None else [])
        layers = [getattr(layer, name) for layer in w.layers for name in ("input_norm", "post_norm", *LINEARS)]
        return sum(a.nbytes for a in tables + layers)

    def kv_bytes(self, slots: int) -> int:
        d = self.dims
        return 2 * 4 * d.num_layers * slots * d.num_kv_heads * self.max_seq_len * d.head_dim

    def workspace_bytes(self, chunk_rows: int) -> int:
        small = Workspace.nbytes(self.dims, self.mlp, self.scored, self.graph_rows, self.max_batch, self.graph_rows)
        large = Workspace.nbytes(self.dims, self.mlp, self.scored, chunk_rows, self.max_batch, self.max_batch)
        return small + large

    def open(self, target: "CudaModel | None" = None) -> "CudaModel":
        """Upload the weights (a draft takes its target's norms, tables and embedding)."""
        k, w = self.kernels, self.weights
        if target is not None:
            self.embedding, self.norms, self.tables = target.embedding, target.norms, target.tables
            hidden = self.dims.hidden_size
            width = [hidden, self.dims.num_heads * self.dims.head_dim, hidden, self.mlp]  # each linear's K
            self.layers = [DeviceLayer(*norms, *(k.weight(p, kk) for p, kk in zip(pairs, width)))
                           for norms, pairs in zip(self.norms, self.draft.pairs)]
            self.head = k.weight(self.draft.head)
        else:
            self.norms = [(k.upload(layer.input_norm), k.upload(layer.post_norm)) for layer in w.layers]
            self.layers = [DeviceLayer(*norms, *(k.weight(getattr(layer, name)) for name in LINEARS))
                           for norms, layer in zip(self.norms, w.layers)]
            self.head = k.weight(w.head)
            self.embedding = self.head if w.embedding is None else k.weight(w.embedding)
            self.tables = (k.upload(w.final_norm), k.upload(w.cos), k.upload(w.sin))
        self.small = Workspace(k, self.dims, self.mlp, self.scored, self.graph_rows, self.max_batch, self.graph_rows)
        self.head_map = self._head_map()
        return self

    def _head_map(self) -> tuple:
        rows = None if self.draft is None else self.draft.head_rows
        if rows is None:
            return self.kernels.upload(np.zeros(1, I32)), False, 0.0, 0
        unscored = np.setdiff1d(np.arange(self.dims.vocab_size), rows)
        return (self.kernels.upload(rows.astype(I32)), True, float(self.draft.fill),
                int(unscored[0]) if unscored.size else 0)

    # ---- state ----
    def reset(self, slots: int) -> None:
        """KV for `slots` slots (reallocated only when the count changes; graphs then capture the new buffers)."""
        if self.kv_owner is not None:
            return
        d = self.dims
        shape = (d.num_layers, slots, d.num_kv_heads, self.max_seq_len, d.head_dim)
        if self.keys is None or tuple(self.keys.shape) != shape:
            self.keys = self.values = None
            self.keys, self.values = self.kernels.empty(shape, F32), self.kernels.empty(shape, F32)
            self.kv_version += 1

    def kv(self) -> tuple:
        owner = self.kv_owner or self
        if owner.keys is None:
            raise BackendError("a cuda forward before reset", "call reset(batch) first")
        return owner.keys, owner.values, owner.kv_version

    # ---- the forward pass ----
    def held_slots(self) -> int:
        return int(self.kv()[0].shape[1])  # a call before reset: BackendError

    def compute(self, tokens: np.ndarray, pos: np.ndarray, slots: np.ndarray, last_only: bool = False,
                layers: tuple = ()) -> DeviceLogits | tuple:
        """forward without check_rows: logits [B, T or 1, V] on the device. With `layers` (at most FEATURES of
        0..L-1) -> (logits, features [B, T, len(layers), H] on the host: each fed token's hidden state after each)."""
        batch, steps = tokens.shape
        if batch == 0 or steps == 0:
            raise BackendError(f"a cuda forward of token ids shaped {list(tokens.shape)}", "pass [B, T] token ids with "
                               "B, T >= 1")
        if len(layers) > FEATURES:
            raise BackendError(f"a cuda forward asked for the hidden states of {len(layers)} layers; a call returns at "
                               f"most {FEATURES}", "ask for fewer layers a call")
        keys, values, version = self.kv()
        for result in list(self._live):  # an earlier call's logits someone still holds: copied aside first
            result.detach()
        self._live.clear()
        rows = batch * steps
        ws = self.small if rows <= self.graph_rows else self._large(rows, batch if last_only else rows)
        ws.write(tokens, pos, slots)
        body = lambda: self._pass(ws, batch, steps, last_only, keys, values, layers)  # noqa: E731
        if ws is self.small and self.use_graphs:
            self._run_graph((batch, steps, last_only) + ((layers,) if layers else ()), body, version)
        else:
            body()
        self.kernels.synchronize()
        logits = self._result(ws, batch, steps, last_only, pos)
        if not layers:
            return logits
        features = self.kernels.fetch(ws.features[:rows, : len(layers)])  # [B T, F, H]
        return logits, features.reshape(batch, steps, len(layers), self.dims.hidden_size)

    def _run_graph(self, key: tuple, body, version: int) -> None:
        cache = self.graphs
        cache.valid_for(version)
        graph = cache.graphs.get(key)
        if graph is None:  # first call of this shape: run it (compiles, warms cuBLAS), then capture it
            body()
            self.kernels.synchronize()
            cache.graphs[key] = self.kernels.capture(body)
            cache.captures += 1
            return
        self.kernels.replay(graph)
        cache.replays += 1

    def chain(self, tokens: np.ndarray, pos: np.ndarray, slots: np.ndarray, steps: int) -> np.ndarray:
        """`steps` greedy one-token steps of rows at positions pos[b].. of slots[b], each step's argmax fed to the next
        on the device, in one graph: tokens [B] -> the tokens each step chose [B, steps]. The K/V of tokens and of the
        first steps - 1 choices land at [pos[b], pos[b] + steps). Each step is the one-token forward's own kernels,
        so it chooses what forward and argmax would."""
        batch = len(tokens)
        keys, values, version = self.kv()
        pos, slots = check_rows(batch, steps, pos, slots, keys.shape[1], self.max_seq_len)
        if not 1 <= steps or batch * steps > self.graph_rows or batch > self.max_batch:
            raise BackendError(f"a chain of {steps} steps of {batch} rows exceeds the {self.graph_rows} rows a call "
                               "holds", "draft step by step")
        for result in list(self._live):
            result.detach()
        self._live.clear()
        ws = self.small
        ws.write(np.asarray(tokens).reshape(batch, 1), pos, slots)
        body = lambda: self._chain_pass(ws, batch, steps, keys, values)  # noqa: E731
        if self.use_graphs:
            self._run_graph(("chain", batch, steps), body, version)
        else:
            body()
        self.kernels.synchronize()
        chosen = ws.chain_host[: batch * steps].reshape(steps, batch).T.astype(np.int64)  # [B, steps]
        if (chosen < 0).any():  # a step whose logits were not all finite (chain_next marks it -1)
            raise nonfinite_logits(self.role, (chosen >= 0).tolist(), np.asarray(pos).tolist(), steps, False)
        return chosen

    def _chain_pass(self, ws: Workspace, batch: int, steps: int, keys, values) -> None:
        k = self.kernels
        k.to_device(ws.inputs, ws.host)
        pos, _ = ws.views(batch)
        head_rows, mapped, fill, fill_token = self.head_map
        for step in range(steps):
            self._compute(ws, batch, 1, True, keys, values)
            k.chain_next(ws.ids[:batch], ws.best[:batch], head_rows, mapped, fill, fill_token, ws.inputs[:batch], pos,
                         ws.chain[step * batch : (step + 1) * batch])
        k.to_host(ws.chain_host, ws.chain)

    def _result(self, ws: Workspace, batch: int, steps: int, last_only: bool, pos: np.ndarray) -> DeviceLogits:
        count = batch if last_only else batch * steps
        ids = ws.out[:count].copy()
        best = ws.out[ws.logits.shape[0] : ws.logits.shape[0] + count].view(np.float32).copy()
        if np.isnan(best).any():  # argmax's NaN: a row whose logits are not all finite
            finite = ~np.isnan(best).reshape(batch, -1)
            raise nonfinite_logits(self.role, finite.tolist(), np.asarray(pos).tolist(), steps, last_only)
        draft = self.draft
        result = DeviceResult(self.kernels, ws.logits[:count], ids, best,
                              (batch, 1 if last_only else steps, self.dims.vocab_size),
                              None if draft is None else draft.head_rows, 0.0 if draft is None else draft.fill)
        self._live.add(result)
        return DeviceLogits(result)

    def _large(self, rows: int, logit_rows: int) -> Workspace:
        ws = self.large
        if ws is None or ws.rows < rows or ws.logits.shape[0] < logit_rows:
            self.large = None
            grown = max(rows, ws.rows if ws else 0), max(logit_rows, ws.logits.shape[0] if ws else 0)
            self.large = ws = Workspace(self.kernels, self.dims, self.mlp, self.scored, grown[0], self.max_batch,
                                        grown[1])
        return ws

    def _pass(self, ws: Workspace, batch: int, steps: int, last_only: bool, keys, values, layers: tuple) -> None:
        self.kernels.to_device(ws.inputs, ws.host)
        self._compute(ws, batch, steps, last_only, keys, values, layers)
        self.kernels.to_host(ws.out, ws.result)

    def _compute(self, ws: Workspace, batch: int, steps: int, last_only: bool, keys, values,
                 layers: tuple = ()) -> None:
        """The forward of the inputs on the device: logits, argmax ids and their logits in the workspace, and the
        hidden states after `layers` in ws.features."""
        k, d, w = self.kernels, self.dims, self.weights
        rows = batch * steps
        pos, slots = ws.views(batch)
        x, xn, qkv, q, att, gu, act = (ws.x[:rows], ws.xn[:rows], ws.qkv[:rows], ws.q[:rows], ws.att[:rows],
                                       ws.gu[:rows], ws.act[:rows])
        final_norm, cos, sin = self.tables
        k.embed(self.embedding, ws.inputs[:rows], x)
        for l, layer in enumerate(self.layers):
            self._norm_linear(x, layer.input_norm, layer.qkv, qkv, xn)
            k.rope_kv(qkv, cos, sin, pos, slots, steps, d.num_heads, d.num_kv_heads, q, keys[l], values[l])
            k.attention(q, keys[l], values[l], pos, slots, steps, w.scale, att)
            k.linear(ws.flat_att[:rows], layer.o, x, accumulate=True)
            self._norm_linear(x, layer.post_norm, layer.gate_up, gu, xn)
            if self.fused:  # SiLU(gate) * up read by the down projection itself
                k.linear_silu(gu, layer.down, x, accumulate=True)
            else:
                k.silu_mul(gu, act)
                k.linear(act, layer.down, x, accumulate=True)
            for f in (f for f, wanted in enumerate(layers) if wanted == l):
                k.copy_rows(ws.features[:rows, f], x)
        count = batch if last_only else rows
        k.rmsnorm(x, final_norm, w.epsilon, ws.xn[:count], steps if last_only else 1, steps - 1 if last_only else 0)
        k.linear(ws.xn[:count], self.head, ws.logits[:count])
        k.argmax(ws.logits[:count], ws.ids[:count], ws.best[:count])

    def _norm_linear(self, x, gamma, weight, out, scratch) -> None:
        """out = RMSNorm(x) . W^T: one kernel where fused (each warp normalizes the rows it reads), else two."""
        if self.fused:
            self.kernels.linear_norm(x, gamma, self.weights.epsilon, weight, out)
        else:
            self.kernels.rmsnorm(x, gamma, self.weights.epsilon, scratch)
            self.kernels.linear(scratch, weight, out)

    def close(self) -> None:
        self.kernels.synchronize()
        self.layers = self.embedding = self.head = self.keys = self.values = None
        self.small = self.large = None
        self.graphs = GraphCache()
