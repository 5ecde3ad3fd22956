"""onnxruntime backend for the `gqa` lowering: GroupQueryAttention updates one shared KV buffer in place.

Per row and layer one numpy buffer [1, Hkv, S, D] is bound through IO binding as both past_key.i and
present_key.i (likewise values), so nothing is copied back after a step and attention reads only the valid
length. onnxruntime's CPU GroupQueryAttention needs B = 1 when T > 1 with a past, so rows run one at a time.
Logits come only for the positions the caller asks for (all T, or the last).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specdec.errors import CapacityError
from specdec.manifest import ModelEntry
from specdec.runtime.backend import NUMPY_DTYPES, OrtBackend, check_capacity


class OrtGqaBackend(OrtBackend):
    def __init__(self, root: Path, entry: ModelEntry, threads: int | None = None):
        super().__init__(root, entry, threads)
        self.rows = []  # per row: (IO binding with its KV bound, [buffers])

    def reset(self, batch: int) -> None:
        import onnxruntime as ort

        if not 1 <= batch <= self.max_batch:
            raise CapacityError(
                f"batch {batch} is outside 1..max_batch={self.max_batch}", "re-export with a larger --max-batch"
            )
        d = self.entry.dims
        dtype = NUMPY_DTYPES[self.entry.kv_dtype]
        while len(self.rows) < batch:
            buffers = [np.zeros((1, d.num_kv_heads, self.max_seq_len, d.head_dim), dtype) for _ in range(2 * d.num_layers)]
            binding = self.session.io_binding()
            binding.bind_output("logits", "cpu")  # first, so get_outputs()[0] is the logits
            for index, buffer in enumerate(buffers):
                kind, layer = ("key", index) if index < d.num_layers else ("value", index - d.num_layers)
                value = ort.OrtValue.ortvalue_from_numpy(buffer)
                binding.bind_ortvalue_input(f"past_{kind}.{layer}", value)
                binding.bind_ortvalue_output(f"present_{kind}.{layer}", value)
            self.rows.append((binding, buffers))
        self.batch = batch

    def _run_row(self, row: int, ids: np.ndarray, start: int, positions: np.ndarray) -> np.ndarray:
        # ids: [T] -> logits [N, V] for `positions` of this row
        binding, _ = self.rows[row]
        binding.bind_cpu_input("input_ids", ids[None])
        binding.bind_cpu_input("cache_len", np.array([start], dtype=np.int64))
        binding.bind_cpu_input("logit_positions", positions)
        binding.bind_output("logits", "cpu")  # re-bound: its shape changes with N; it keeps output slot 0
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()[0]

    def forward(self, input_ids: np.ndarray, cache_len: np.ndarray, last_only: bool = False) -> np.ndarray:
        # input_ids: [B, T]; cache_len: [B] -> logits [B, T, V], or [B, 1, V] for the last position
        steps = input_ids.shape[1]
        check_capacity(cache_len, steps, self.max_seq_len)
        positions = np.array([steps - 1] if last_only else np.arange(steps), dtype=np.int64)
        return np.stack([self._run_row(b, input_ids[b], int(cache_len[b]), positions)
                         for b in range(input_ids.shape[0])])

    def close(self) -> None:
        self.rows = []
        super().close()
