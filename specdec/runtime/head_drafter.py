"""`drafter="head"`: chain drafts from a trained draft head (specdec.head) over the target's hidden states.

The loop asks the target for the head's layers (`feature_layers`) on the prefill and verify passes of the rows that
draft with it, and hands every fed token's hidden states to `observe`. Head position j takes the target's features
at position j (fused) and the token that follows (the target's embedding of it), and scores the token after that.
So a row whose tokens t_0..t_n are committed (t_n pending, target_len = n) has features for positions 0..n-1, and:
- catch-up: the head feeds the positions it has not (its `length` up to n - 1), from the target's own features,
  in chunks; the logits of position n - 1 give draft 1 (the token after t_n);
- chain: draft k + 1 comes from position n - 1 + k, fed draft k and the head's own output hidden state (before its
  final norm) of the position before. Those positions are speculative: `length` stays n, so the next round's
  catch-up, from the features of the verified tokens, overwrites them (rollback by committed length).
The head's logits cover its draft vocabulary; q is 0 (logit -inf) for every other token, so a sampled draft's
residual max(0, p - q) is p there and acceptance stays exact. Greedy drafts are argmaxes (point masses).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.errors import BackendError
from specdec.head.format import check_fit, read_head
from specdec.head.model import FloatProducts, HeadModel, TokenEmbedding, packed
from specdec.manifest import Manifest, ModelEntry, check_bundle_files
from specdec.native_record import Activations
from specdec.runtime.backend import unwrapped
from specdec.runtime.config import DrafterName, OptionError
from specdec.runtime.drafters import EMPTY, ModelDrafter, Proposal
from specdec.runtime.forward import Output
from specdec.runtime.native_backend import NativeBackend
from specdec.runtime.state import Row

NO_FEATURES_HINT = ("re-export the bundle with --feature-layers head (its onnxruntime graph then returns them), or "
                    "load it with backend='native'")


@dataclass
class HeadState:
    """A row's head: KV positions 0..length-1 computed from the target's own features, and the target's features
    of positions length.. that it has not fed yet (`pending`), held in a buffer that grows by doubling, so that a pass
    adds its rows in time proportional to them however long the head goes without drafting."""

    length: int = 0
    buffer: np.ndarray | None = None  # [capacity, F, H]: pending is buffer[first : first + count]
    first: int = 0
    count: int = 0

    @property
    def pending(self) -> np.ndarray:
        return self.buffer[self.first : self.first + self.count]

    def put(self, at: int, features: np.ndarray) -> None:
        """features [T, F, H] of positions length + at.. (at <= count): what was held from there on is dropped."""
        need = at + len(features)
        if self.buffer is None or self.buffer.shape[1:] != features.shape[1:] or \
                self.first + need > len(self.buffer):
            grown = np.empty((max(2 * need, 64), *features.shape[1:]), np.float32)
            if at:
                grown[:at] = self.buffer[self.first : self.first + at]
            self.buffer, self.first = grown, 0
        self.buffer[self.first + at : self.first + need] = features
        self.count = need

    def keep(self, n: int) -> None:
        """Drop the pending positions past the first n."""
        self.count = min(self.count, max(n, 0))

    def take(self, n: int) -> None:
        """The first n pending positions were fed: the head's length grows by n."""
        self.first, self.count, self.length = self.first + n, self.count - n, self.length + n
        if not self.count:
            self.first = 0

    def restart(self, length: int) -> None:
        """Back to `length` (a prefill again), nothing pending."""
        self.length, self.first, self.count = length, 0, 0


def open_head(root: Path, manifest: Manifest, target, verify: bool) -> HeadModel | None:
    """The bundle's draft head beside the open `target` backend, or None where the bundle has none. Its layer runs
    on the native kernels (Q8_0 blocks, one call) where the target does, else in fp32 numpy; the token embedding is the
    target's: the native engine's own, else read from the bundle's native weights."""
    record = manifest.head
    if record is None:
        return None
    check_fit(record, manifest.target.dims)
    if verify:
        check_bundle_files(root, manifest, sorted({record.path, *record.files}))
    weights = read_head(root, record)
    matrices = packed(weights)
    backend = unwrapped(target)
    if isinstance(backend, NativeBackend) and backend.model is not None:
        from specdec.head.kernels import Q8A, STEP, BlockProducts, NativeLayer, blocks_fit

        native = backend.model.weights
        table = native.embedding if native.embedding is not None else native.head
        kernel = Q8A if backend.activations is Activations.INT8 else STEP  # the head's activations as the target's
        fits = blocks_fit(matrices)
        products = BlockProducts(matrices, backend.model.kernels, backend.model.threads, kernel) if fits \
            else FloatProducts(matrices)
        layer_of = NativeLayer if fits else None
    else:
        table, products, layer_of = embedding_table(root, manifest.target), FloatProducts(matrices), None
    return HeadModel(weights, record, TokenEmbedding(table), products, manifest.target.max_seq_len, layer_of)


def embedding_table(root: Path, entry: ModelEntry) -> np.ndarray:
    """The target's token embedding from the bundle's native weights (memory-mapped): its `embedding` rows, or its
    head's where the weights are tied."""
    from specdec.weights_file import Pages, index_from, read_tensors

    record = entry.native
    if record is None:
        raise BackendError("the draft head shares the target's token embedding, which a bundle holds in the target's "
                           f"native weights, and this target has none ({entry.native_note or 'not written'})",
                           "re-export the bundle with --lowering gqa (the default), whose LLaMA-layout targets carry "
                           "native weights")
    name = "embedding" if record.tensors.get("embedding") is not None else "head"  # tied: the head holds it
    try:
        index = index_from({key: spec for key, spec in record.tensors.items() if spec is not None})
        table = read_tensors(root / record.path, index, Pages.SHARED)[name]  # mapped: the others cost no read
    except (KeyError, TypeError, ValueError, OSError) as exc:
        raise BackendError(f"the target's token embedding cannot be read from {record.path}: {exc}",
                           "re-export the bundle") from None
    if len(table) != entry.dims.vocab_size:
        raise BackendError(f"the target's token embedding {record.path}:{name} has {len(table)} rows, not the "
                           f"vocabulary's {entry.dims.vocab_size}", "re-export the bundle")
    return table


def feature_problem(head: HeadModel, target) -> OptionError | None:
    """Why `target` cannot feed the head (it does not return the hidden states of the head's layers), or None."""
    capabilities, wanted = target.capabilities, list(head.feature_layers)
    held = capabilities.feature_layers
    if Output.FEATURES in capabilities and (held is None or set(wanted) <= set(held)):
        return None
    has = f" (its graph returns layers {list(held)})" if held else ""
    return OptionError(f"drafter 'head' reads the target's hidden states at layers {wanted}, which the target on the "
                       f"{target.name} backend does not return{has}", NO_FEATURES_HINT,
                       "this model's backend cannot run drafter 'head'", "drafter")


class HeadDrafter:
    """Chain drafts from `head` for the rows whose drafter is `head`; `chunk`: the most positions of one catch-up
    call (the bundle's prefill chunk)."""

    name = DrafterName.HEAD

    def __init__(self, head: HeadModel, chunk: int, step_timer=None):
        self.head = head
        self.chunk = chunk
        self.step_timer = step_timer  # told, per round, its draft time over the drafts of its longest chain (or None)
        # draft rows in the order of their target ids: a greedy draft is then the argmax over the draft vocabulary,
        # the first of ties as over the target's, with no [V] array built (to_target) a draft
        self.ascending = bool(np.all(np.diff(head.draft_ids) > 0))

    def reads(self, row: Row) -> bool:
        """Whether it reads the target's hidden states of `row`: a row of drafter head, or of auto where auto weighs
        the head for it (the row has a head gate)."""
        return row.drafter.name == self.name or (row.drafter.name == DrafterName.AUTO and row.head_gate is not None)

    def feature_tap(self, row: Row):
        """The drafter `row`'s hidden states go to: this one, where it reads them; else None."""
        return self if self.reads(row) else None

    @staticmethod
    def ready(row: Row) -> bool:
        """Whether it can draft for `row` (it holds the features of the row's verified positions)."""
        return _ready(row)

    @property
    def feature_layers(self) -> tuple:
        """The target layers the loop asks for (ForwardRequest.feature_layers)."""
        return self.head.feature_layers

    def observe(self, row: Row, start: int, features: np.ndarray) -> None:
        """The target's hidden states of the tokens a pass fed to `row` at positions start.. (features: [T, F, H]).
        A pass from below the head's length (a prefill again) drops what the head held past `start`."""
        if not self.reads(row):
            return
        state = row.head if row.head is not None else HeadState()
        row.head = state
        if start < state.length:
            state.restart(start)
        held = state.length + state.count
        if start > held:
            raise BackendError(f"the head holds the features of positions below {held}, and a pass fed position "
                               f"{start}", "this is a bug in specdec's loop; report it")
        state.put(start - state.length, features)

    def propose(self, rows: list, limits: list) -> list:
        ready = [b for b, (row, limit) in enumerate(zip(rows, limits)) if row.active and limit > 0 and _ready(row)]
        if not ready:
            return [EMPTY] * len(rows)
        started = time.perf_counter()
        last = self._catch_up(rows, ready)  # b -> (logits [V'], prenorm [H]) of the row's last verified position
        drafts, dists = {b: [] for b in ready}, {b: [] for b in ready}
        for step in range(max(limits[b] for b in ready)):
            for b in ready:
                if step < limits[b]:
                    token, q = self._choose(last[b][0], rows[b], step)
                    drafts[b].append(token)
                    dists[b].append(q)
            feeding = [b for b in ready if step + 1 < limits[b]]
            if not feeding:
                break
            last.update(self._step(rows, feeding, drafts, last, step))
        if self.step_timer is not None:  # the round's whole draft, catch-up and host work included, a draft's share
            positions = max(limits[b] for b in ready)
            for _ in range(positions):
                self.step_timer((time.perf_counter() - started) / positions)
        return [self._proposal(rows[b], drafts[b], dists[b]) if b in drafts else EMPTY for b in range(len(rows))]

    def _choose(self, logits: np.ndarray, row: Row, step: int):
        """logits [V'] over the draft vocabulary -> (token, q or None), as ModelDrafter._choose over the target's."""
        if row.config.greedy and self.ascending:
            return int(self.head.draft_ids[np.argmax(logits)]), None
        return ModelDrafter._choose(self.head.to_target(logits), row, step)

    def _catch_up(self, rows: list, ready: list) -> dict:
        """Feed each ready row's unfed verified positions, in chunks, rows with pieces of one length together;
        -> b -> (logits [V'], prenorm [H]) of its last position."""
        last = {}
        while True:
            pieces = {}
            for b in ready:
                if rows[b].head.count:
                    pieces.setdefault(min(self.chunk, rows[b].head.count), []).append(b)
            if not pieces:
                return last
            for size, group in sorted(pieces.items()):
                states = [rows[b].head for b in group]
                tokens = np.array([rows[b].tokens[s.length + 1 : s.length + 1 + size] for b, s in zip(group, states)],
                                  np.int64)  # [G, size]: the token after each position
                features = np.stack([s.pending[:size] for s in states])  # [G, size, F, H]
                logits, prenorm = self.head.forward(tokens, self.head.fuse(features), [s.length for s in states],
                                                    [rows[b].slot for b in group], last_only=True)
                for i, (b, state) in enumerate(zip(group, states)):
                    last[b] = (logits[i, -1], prenorm[i, -1])
                    state.take(size)

    def _step(self, rows: list, feeding: list, drafts: dict, last: dict, step: int) -> dict:
        """One chain step of the feeding rows: the latest draft at position length + step, on the head's own prenorm
        of the position before; -> b -> (logits [V'], prenorm [H])."""
        tokens = np.array([[drafts[b][-1]] for b in feeding], np.int64)  # [G, 1]
        hidden = np.stack([last[b][1] for b in feeding])[:, None]  # [G, 1, H]
        logits, prenorm = self.head.forward(tokens, hidden, [rows[b].head.length + step for b in feeding],
                                            [rows[b].slot for b in feeding], last_only=True)
        return {b: (logits[i, -1], prenorm[i, -1]) for i, b in enumerate(feeding)}

    @staticmethod
    def _proposal(row: Row, drafts: list, dists: list) -> Proposal:
        q = None if row.config.greedy or row.config.gumbel else np.stack(dists)
        return Proposal(np.asarray(drafts, dtype=np.int64), q, DrafterName.HEAD)


def _ready(row: Row) -> bool:
    """Whether the head holds the target's features of every verified position past its length (dropping those of
    rejected drafts a verify pass fed), at least one: then it can draft for `row`."""
    state = row.head
    if state is None:
        return False
    unfed = row.target_len - state.length
    state.keep(unfed)
    return unfed >= 1 and state.count == unfed
