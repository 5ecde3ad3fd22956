"""The native CPU backend: the target on specdec's own Q4_1 / Q8_0 x fp32 kernels (specdec.native), the draft on
onnxruntime. For targets exported from a Q4_1 GGUF (the default model): the kernels read the 4-bit blocks instead
of the fp32 weights and compute the same function, another summation order, fp32 activations throughout.

Rows of a call run one by one (the weights are read once per row and call); KV lives in numpy, [L, slots, Hkv,
S, D], in the gqa driver's per-layer layout, so a derived gqa draft copies this target's committed KV as it does
an onnxruntime target's (OrtBackend.takes_kv_from).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specdec.errors import BackendError
from specdec.manifest import Manifest, ModelEntry
from specdec.runtime.backend import Backend, check_device, cpu_count


class NativeBackend(Backend):
    name = "native"

    def __init__(self, root: Path, entry: ModelEntry, threads: int | None = None):
        super().__init__(root, entry)
        self.threads = threads
        self.model = self.driver = None

    @classmethod
    def open_models(cls, root: Path, manifest: Manifest, device: str, threads: int | None) -> tuple:
        from specdec.runtime.ort_backend import OrtBackend

        check_device(cls.name, device, ("cpu",))
        target = cls(root, manifest.target, threads).open()
        if manifest.draft is None:
            return target, None
        try:
            return target, OrtBackend(root, manifest.draft, threads).open()
        except BaseException:
            target.close()
            raise

    def open(self) -> "NativeBackend":
        from specdec.native.build import load_kernels
        from specdec.native.model import NativeModel
        from specdec.native.weights import HINT, weights_from_onnx

        if self.entry.lowering != "gqa" or self.entry.kv_dtype != "float32":
            raise BackendError(f"the {self.entry.role} has lowering {self.entry.lowering!r} and KV dtype "
                               f"{self.entry.kv_dtype}; the native backend reads gqa graphs with fp32 KV",
                               f"re-export with --lowering gqa --dtype fp32, or {HINT}")
        kernels = load_kernels()
        weights = weights_from_onnx(self.root / self.entry.onnx_path, self.entry.dims)
        self.model = NativeModel(weights, self.entry.dims, kernels, self.max_seq_len)
        self.driver = self.model  # what a draft's copy_kv reads (geometry, buffers)
        return self

    def _reset(self, batch: int) -> None:
        if self.model is None:
            raise BackendError(f"the {self.entry.role} backend is closed", "open it again (specdec.load)")
        self.model.reset(batch)

    def _forward(self, input_ids, cache_len, last_only: bool, slots: np.ndarray) -> np.ndarray:
        # input_ids: [B, T] -> logits [B, T or 1, V]
        self.model.kernels.specdec_set_threads(self.threads or cpu_count())  # OpenMP's count is per calling thread
        return np.stack([self.model.forward(ids, int(start), int(slot), last_only)
                         for ids, start, slot in zip(input_ids, cache_len, slots)])

    def close(self) -> None:
        self.model = self.driver = None
        self.batch = 0
