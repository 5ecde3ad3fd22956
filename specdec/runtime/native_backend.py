"""The native CPU backend: specdec's own kernels (specdec.native) for LLaMA-layout gqa bundles exported from a Q4_1
GGUF (the default model). The kernels read the 4-bit blocks instead of the fp32 weights.

- The target computes its graph's function in another summation order, fp32 activations throughout.
- A draft that is the target's int4-q41 quantization (make demo's) runs on the same blocks, read from its own copy in
  pairs of blocks with fp16 scales (5/6 of the bytes), with activations rounded to two int8 parts per block of 32
  (about 15 bits, where its graph's MatMulNBits at accuracy level 4 rounds to one) and its graph's trimmed head; it
  reads and writes the target's KV: committed positions hold the target's K/V, the draft writes only past them, and
  the target's verify pass overwrites what it wrote. So a native draft's forward must start at or past its target's
  committed length: ModelDrafter, given the target as kv_source, starts it there (takes_kv_from). Any other draft
  runs on onnxruntime and copies the target's committed KV (OrtBackend.takes_kv_from).

Rows of a call run one by one; KV lives in numpy, [L, slots, Hkv, S, D], in the gqa driver's per-layer layout.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specdec.errors import BackendError
from specdec.manifest import Manifest, ModelEntry
from specdec.runtime.backend import Backend, check_device, cpu_count, unwrapped

NATIVE_DRAFT = "int4-q41"  # the derived drafts the native backend runs on the target's blocks


def drafts_natively(draft: ModelEntry, target: ModelEntry) -> bool:
    """Whether `draft` is the target's Q4_1 quantization, which the native backend runs on the target's blocks."""
    return (draft.derived == NATIVE_DRAFT and draft.dims == target.dims and draft.lowering == target.lowering
            and draft.max_seq_len == target.max_seq_len and draft.max_batch <= target.max_batch)


class NativeBackend(Backend):
    name = "native"

    def __init__(self, root: Path, entry: ModelEntry, threads: int | None = None,
                 target: "NativeBackend | None" = None):
        super().__init__(root, entry)
        self.threads = threads
        self.target = target  # a native draft's target: its blocks and its KV
        self.model = self.driver = None

    @classmethod
    def open_models(cls, root: Path, manifest: Manifest, device: str, threads: int | None) -> tuple:
        from specdec.runtime.ort_backend import OrtBackend

        check_device(cls.name, device, ("cpu",))
        target = cls(root, manifest.target, threads).open()
        if manifest.draft is None:
            return target, None
        try:
            if drafts_natively(manifest.draft, manifest.target):
                return target, cls(root, manifest.draft, threads, target=target).open()
            return target, OrtBackend(root, manifest.draft, threads).open()
        except BaseException:
            target.close()
            raise

    def open(self) -> "NativeBackend":
        from specdec.calibration.q41 import HEAD_FILL
        from specdec.native.build import load_kernels
        from specdec.native.model import NativeModel
        from specdec.native.weights import HINT, trimmed_head_rows, weights_from_onnx

        if self.entry.lowering != "gqa" or self.entry.kv_dtype != "float32":
            raise BackendError(f"the {self.entry.role} has lowering {self.entry.lowering!r} and KV dtype "
                               f"{self.entry.kv_dtype}; the native backend reads gqa graphs with fp32 KV",
                               f"re-export with --lowering gqa --dtype fp32, or {HINT}")
        kernels = load_kernels()
        if self.target is None:
            weights = weights_from_onnx(self.root / self.entry.onnx_path, self.entry.dims)
            self.model = NativeModel(weights, self.entry.dims, kernels, self.max_seq_len)
        else:
            if self.target.model is None or not drafts_natively(self.entry, self.target.entry):
                raise BackendError(f"the native backend runs a {NATIVE_DRAFT} draft of an open native target only",
                                   "open the draft on onnxruntime (NativeBackend.open_models chooses)")
            rows = trimmed_head_rows(self.root / self.entry.onnx_path, self.vocab_size)
            self.model = NativeModel(self.target.model.weights, self.entry.dims, kernels, self.max_seq_len,
                                     quant=True, head_rows=rows, fill=HEAD_FILL, kv_owner=self.target.model)
        self.driver = self.model  # what a draft's copy_kv reads (geometry, buffers)
        return self

    def takes_kv_from(self, source) -> bool:
        """A native draft shares its target's KV: copying it is nothing to do."""
        return self.target is not None and unwrapped(source) is self.target

    def copy_kv(self, source, slot: int, start: int, stop: int) -> None:
        if not self.takes_kv_from(source):
            super().copy_kv(source, slot, start, stop)

    def _reset(self, batch: int) -> None:
        if self.model is None:
            raise BackendError(f"the {self.entry.role} backend is closed", "open it again (specdec.load)")
        if self.target is not None and self.target.batch < batch:
            raise BackendError(f"the native draft shares its target's KV, which holds {self.target.batch} slots, "
                               f"not {batch}", "reset the target with as many slots first")
        self.model.reset(batch)

    def _forward(self, input_ids, cache_len, last_only: bool, slots: np.ndarray) -> np.ndarray:
        # input_ids: [B, T] -> logits [B, T or 1, V]
        self.model.kernels.specdec_set_threads(self.threads or cpu_count())  # OpenMP's count is per calling thread
        return np.stack([self.model.forward(ids, int(start), int(slot), last_only)
                         for ids, start, slot in zip(input_ids, cache_len, slots)])

    def close(self) -> None:
        self.model = self.driver = None
        self.batch = 0
