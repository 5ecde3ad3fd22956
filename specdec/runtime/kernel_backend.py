"""The backends on specdec's own kernels (native on the CPU, cuda on a GPU), in one class: what they read of a bundle
(its native weights, never the ONNX graphs), how they open a target and its int4-q41 draft (which runs on the
target's weights and KV), the family features their kernels do not run (refused by name), and a forward call.

A subclass says only what is its own: `_open_target(record)` and `_open_draft(record, target_model)` make its
models (specdec.native.core.KernelModel), `_check_call(request)` adds checks of a call, `_release()` frees what it
holds, and `unsupported` names the FamilyFeatures its kernels lack.
"""
from __future__ import annotations

import numpy as np

from specdec.errors import BackendError
from specdec.manifest import Method, ModelEntry, Role
from specdec.native.weights import check_file, check_layout, drafts_natively
from specdec.runtime.backend import Backend, check_tokens, unwrapped
from specdec.runtime.forward import ForwardRequest, ForwardResult


class KernelBackend(Backend):
    """native and cuda. `self.target` is a draft's open target (None for a target), `self.model` the open model (None
    when closed)."""

    unsupported = frozenset()  # the FamilyFeatures (specdec.native.core) this engine's kernels do not run
    other_backends = "use backend='onnxruntime'"  # a refusal's hint

    def __init__(self, root, entry: ModelEntry, target: "KernelBackend | None" = None):
        super().__init__(root, entry)
        self.target = target  # a draft's target: its weights and its KV
        self.model = None

    @classmethod
    def files_read(cls, entry: ModelEntry) -> list:
        """Only the native weights: the engine reads no ONNX."""
        return [entry.native.path] if entry.native is not None else []

    @classmethod
    def check_files(cls, root, entry: ModelEntry) -> None:
        check_file(root, entry.native, entry.role)  # native.bin's size against its header's, before it is hashed

    @classmethod
    def runs_draft(cls, draft: ModelEntry, target: Backend) -> bool:
        """Whether this backend runs `draft` beside the open `target` (the pair planner asks)."""
        return isinstance(target, cls) and drafts_natively(draft, target.entry)

    # ---- lifetime ----
    def open(self) -> "KernelBackend":
        role = Role.TARGET if self.target is None else Role.DRAFT
        record = check_layout(self.entry.native, role, self.entry.native_note)  # export writes native weights for
        # gqa graphs only
        if self.target is None:
            self.model = self._open_target(record)
            return self
        if self.target.model is None or not drafts_natively(self.entry, self.target.entry):
            raise BackendError(f"the {self.name} backend runs an {Method.INT4_Q41} draft of an open {self.name} target "
                               "only", "open the draft on onnxruntime (the pair planner chooses)")
        self.model = self._open_draft(record, self.target.model)
        return self

    def _open_target(self, record):
        raise NotImplementedError

    def _open_draft(self, record, target_model):
        raise NotImplementedError

    def check_family(self, weights) -> None:
        """BackendError naming every family feature `weights` need that this engine's kernels do not run."""
        from specdec.native.core import family_features

        missing = sorted(family_features(weights) & self.unsupported)
        if missing:
            raise BackendError(f"the {self.name} kernels do not run {'; '.join(missing)} yet",
                               f"{self.other_backends}")

    def close(self) -> None:
        """Release the model and what it holds; harmless where it never opened, or opened only in part."""
        self._release()
        self.model = None
        self.batch = 0

    def _release(self) -> None:
        """Free what this backend holds beside the model (nothing on the CPU)."""

    # ---- KV: a draft runs on its target's ----
    def takes_kv_from(self, source) -> bool:
        """A draft sharing its target's KV: copying it is nothing to do."""
        return self.target is not None and unwrapped(source) is self.target

    def copy_kv(self, source, slot: int, start: int, stop: int) -> None:
        if not self.takes_kv_from(source):
            super().copy_kv(source, slot, start, stop)

    def _reset(self, batch: int) -> None:
        if self.model is None:
            raise BackendError(f"the {self.entry.role} backend is closed", "open it again (specdec.load)")
        if self.target is not None and self.target.batch < batch:
            raise BackendError(f"the {self.name} draft shares its target's KV, which holds {self.target.batch} "
                               f"slots, not {batch}", "reset the target with as many slots first")
        self.model.reset(batch)

    # ---- a call ----
    def _run(self, request: ForwardRequest, slots: np.ndarray, layers: tuple) -> ForwardResult:
        # input_ids: [B, T] -> logits [B, T or 1, V], features [B, T, F, H] of `layers`
        check_tokens(request.input_ids, self.model.weights.vocab, "the weights' vocabulary")
        self._check_call(request)
        out = self.model.compute(request.input_ids, request.cache_len, slots, request.last_only, layers)  # checked
        return ForwardResult(*out) if layers else ForwardResult(out)

    def _check_call(self, request: ForwardRequest) -> None:
        """Checks of a call this engine adds to Backend.run's and the tokens'."""
