"""The onnxruntime CPU backend: one session per model, driven by its lowering's driver (specdec.lowering)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from specdec.errors import BackendError, ConfigError, missing_dependency
from specdec.files import check_regular
from specdec.lowering import kv_numpy_dtype, lowering_for
from specdec.manifest import ModelEntry, Role
from specdec.runtime.backend import Backend, check_logits, session_options, steady_malloc, unwrapped
from specdec.runtime.config import BackendName
from specdec.runtime.forward import LOGITS_ONLY, Capabilities, ForwardRequest, ForwardResult, Output


class OrtBackend(Backend):
    """onnxruntime on the CPU execution provider; KV buffers in numpy, written by the lowering's driver."""

    name = BackendName.ONNXRUNTIME

    def __init__(self, root: Path, entry: ModelEntry, threads: int | None = None):
        super().__init__(root, entry)
        self.threads = threads
        self.session = None
        self.driver = None

    @classmethod
    def runs_draft(cls, draft: ModelEntry, target: Backend) -> bool:
        """onnxruntime runs any draft on the CPU, beside any target (the planner's last resort)."""
        return True

    @property
    def kv_layout(self) -> str | None:
        return self.entry.lowering

    @property
    def capabilities(self) -> Capabilities:
        """Logits, and the hidden states of the layers the graph's features output holds (the manifest says which)."""
        layers = tuple(self.entry.feature_layers)
        return Capabilities(frozenset({Output.LOGITS, Output.FEATURES}), layers) if layers else LOGITS_ONLY

    def open(self) -> "OrtBackend":
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise missing_dependency("onnxruntime", "cpu") from exc
        try:
            kv_numpy_dtype(self.entry.kv_dtype)
        except ConfigError as exc:
            raise BackendError(f"{self.entry.role} has KV dtype {self.entry.kv_dtype}, which the CPU backend does "
                               "not run", exc.hint) from exc
        path = self.root / self.entry.onnx_path
        for rel in self.files_read(self.entry):  # onnxruntime opens them itself: never a FIFO or a device
            if os.path.exists(self.root / rel):  # a missing one: onnxruntime's own message
                check_regular(self.root / rel)
        steady_malloc()
        try:
            self.session = ort.InferenceSession(str(path), session_options(self.threads), providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types from C++
            raise BackendError(f"onnxruntime cannot load {path}: {exc}", "re-export the bundle") from exc
        lowering = lowering_for(self.entry.lowering)
        lowering.check_session(self.session, self.entry.dims, self.max_seq_len, self.entry.kv_dtype, self.entry.role,
                               self.entry.feature_layers)
        self.driver = lowering.driver(self.session, self.entry.dims, self.max_seq_len, self.entry.kv_dtype)
        return self

    def takes_kv_from(self, source) -> bool:
        """A draft derived from the target (quantized, or its first layers) computes nearly or exactly the
        target's KV for the same tokens, so the target's committed KV may stand in for its own: its prefill and
        catch-ups then cost a copy, not a forward. The target may run on onnxruntime or on the native backend,
        whose KV has the gqa driver's layout (both name it as kv_layout). Same lowering, KV dtype, heads, head size
        and S, no more layers. Exactness never depends on it: acceptance uses the q the draft proposed."""
        source = unwrapped(source)
        mine, theirs = self.entry, getattr(source, "entry", None)
        return (getattr(source, "kv_layout", None) == mine.lowering and theirs is not None
                and theirs.role == Role.TARGET and mine.role == Role.DRAFT and bool(mine.derived)
                and mine.lowering == theirs.lowering
                and mine.kv_dtype == theirs.kv_dtype and mine.max_seq_len == theirs.max_seq_len
                and (mine.dims.num_kv_heads, mine.dims.head_dim) == (theirs.dims.num_kv_heads, theirs.dims.head_dim)
                and mine.dims.num_layers <= theirs.dims.num_layers)

    def copy_kv(self, source, slot: int, start: int, stop: int) -> None:
        source = unwrapped(source)
        if not self.takes_kv_from(source):
            super().copy_kv(source, slot, start, stop)
        self.driver.copy_kv(source.driver, slot, start, stop)

    def _reset(self, batch: int) -> None:
        if self.driver is None:
            raise BackendError(f"the {self.entry.role} backend is closed", "open it again (specdec.load)")
        self.driver.reset(batch)

    def _run(self, request: ForwardRequest, slots: np.ndarray, layers: tuple) -> ForwardResult:
        ids, cache_len, last_only = request.input_ids, request.cache_len, request.last_only
        if not layers:
            logits = self.driver.run(ids, cache_len, last_only, slots)
            return ForwardResult(check_logits(logits, self.entry.role, cache_len, ids.shape[1], last_only))
        logits, features = self.driver.run(ids, cache_len, last_only, slots, True)
        order = [list(self.entry.feature_layers).index(layer) for layer in layers]  # the request's, of the graph's
        return ForwardResult(check_logits(logits, self.entry.role, cache_len, ids.shape[1], last_only),
                             features[:, :, order])

    def close(self) -> None:
        self.session = self.driver = None
        self.batch = 0
