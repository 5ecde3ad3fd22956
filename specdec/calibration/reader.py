"""A CalibrationDataReader that feeds real token windows through the static-KV contract (docs/export.md).

For each batch of windows it yields a prefill-shaped feed (cache_len 0, empty KV) and, after running the fp32
graph on that prefill to fill the KV, a verify-shaped feed (T = verify_len) at cache_len = prefill length. The
feeds and the prefill run come from the model's lowering driver (specdec.lowering), the one the backends use.
"""
from __future__ import annotations

import logging
from enum import StrEnum
from pathlib import Path

import numpy as np

from specdec.errors import ConfigError, missing_dependency
from specdec.lowering import lowering_for
from specdec.manifest import ModelEntry

log = logging.getLogger(__name__)

try:
    from onnxruntime.quantization import CalibrationDataReader
except ImportError:  # the reader is only built where onnxruntime is installed; keep the module importable
    CalibrationDataReader = object


class FeedKind(StrEnum):
    """The feeds a reader yields for each batch of windows."""

    PREFILL = "prefill"  # cache_len 0, empty KV
    VERIFY = "verify"  # T = verify_len after the prefill


class StaticKVReader(CalibrationDataReader):
    """Feeds for `quantize_static`, GPTQ and ModelOpt: dicts of input_ids [B,T], cache_len [B],
    past_keys / past_values [L,B,Hkv,S,D]. The KV of verify feeds is prefilled by the fp32 graph `fp32_path`."""

    def __init__(self, fp32_path: Path, entry: ModelEntry, windows: np.ndarray, verify_len: int = 5,
                 batch: int = 1, kinds: tuple = tuple(FeedKind)):
        # windows: [N, W] int64 token windows; each splits into a prefill of W - verify_len and a verify chunk
        self.fp32_path = Path(fp32_path)
        self.entry = entry
        self.windows = np.asarray(windows, dtype=np.int64)
        self.verify_len = verify_len
        self.batch = batch
        self.kinds = tuple(kinds)
        self.session = None
        self.pending = None
        self._check()

    def _check(self) -> None:
        width = self.windows.shape[1] if self.windows.ndim == 2 else 0
        if self.windows.ndim != 2 or len(self.windows) == 0:
            raise ConfigError(f"calibration windows have shape {self.windows.shape}", "pass [N, W] token windows, N >= 1")
        if not 1 <= self.verify_len < width:
            raise ConfigError(f"verify_len {self.verify_len} does not fit windows of {width} tokens",
                              "use windows longer than verify_len + 1")
        if width > self.entry.max_seq_len:
            raise ConfigError(f"windows of {width} tokens exceed the model's max_seq_len {self.entry.max_seq_len}",
                              "pass a smaller --seq-len")
        lowering_for(self.entry.lowering).calibration_batch(self.batch)
        if not 1 <= self.batch <= self.entry.max_batch:
            raise ConfigError(f"calibration batch {self.batch} is outside 1..{self.entry.max_batch}", "use batch 1")
        if not set(self.kinds) <= set(FeedKind) or not self.kinds:
            raise ConfigError(f"feed kinds {self.kinds} are unknown", "use ('prefill', 'verify')")

    def __deepcopy__(self, memo):
        # onnxruntime's GPTQ deep-copies the reader; a fresh, rewound copy shares no session
        return StaticKVReader(self.fp32_path, self.entry, self.windows, self.verify_len, self.batch, self.kinds)

    def __len__(self) -> int:
        return -(-len(self.windows) // self.batch) * len(self.kinds)

    def _driver(self, batch: int):
        if self.session is None:
            try:
                import onnxruntime as ort
            except ImportError as exc:
                raise missing_dependency("onnxruntime", "cpu") from exc
            from specdec.runtime.backend import session_options

            self.session = ort.InferenceSession(str(self.fp32_path), session_options(),
                                                providers=["CPUExecutionProvider"])
        entry = self.entry
        driver = lowering_for(entry.lowering).driver(self.session, entry.dims, entry.max_seq_len, entry.kv_dtype)
        driver.reset(batch)
        return driver

    def feeds_of(self, rows: np.ndarray) -> list[dict]:
        # rows: [B, W] -> prefill feed (T = W - verify_len, cache 0) and verify feed (T = verify_len)
        batch, width = rows.shape
        prefill = width - self.verify_len
        driver = self._driver(batch)
        first_ids, first_len = rows[:, :prefill].copy(), np.zeros(batch, np.int64)
        feeds = [driver.feeds(first_ids, first_len)] if FeedKind.PREFILL in self.kinds else []
        if FeedKind.VERIFY in self.kinds:
            driver.run(first_ids, first_len, last_only=True)  # fills the KV of the prefill
            feeds.append(driver.feeds(rows[:, prefill:].copy(), np.full(batch, prefill, np.int64)))
        return feeds

    def _batches(self):
        for start in range(0, len(self.windows), self.batch):
            yield from self.feeds_of(self.windows[start : start + self.batch])

    def get_next(self) -> dict | None:
        if self.pending is None:
            self.pending = self._batches()
        return next(self.pending, None)

    def get_first(self) -> dict:
        """The first feed, without moving the reader (ModelOpt's reader interface)."""
        return next(self._batches())

    def rewind(self) -> None:
        self.pending = None

    def close(self) -> None:
        self.session = None
        self.pending = None
