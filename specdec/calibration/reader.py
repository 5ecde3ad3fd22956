"""A CalibrationDataReader that feeds real token windows through the static-KV contract (DESIGN §4).

For each batch of windows it yields a prefill-shaped feed (cache_len 0, empty KV) and, after running the fp32
graph on that prefill to fill the KV, a verify-shaped feed (T = verify_len) at cache_len = prefill length.
Both lowerings: `plain` (past_keys / past_values [L, B, Hkv, S, D], outputs new_* [L, B, Hkv, T, D]) and `gqa`
(past_key.i / past_value.i [B, Hkv, S, D] per layer, logit_positions [N], outputs present_* [B, Hkv, S, D];
onnxruntime's CPU GroupQueryAttention needs B = 1 there).
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from specdec.errors import ConfigError, missing_dependency
from specdec.manifest import ModelEntry

log = logging.getLogger(__name__)

NUMPY_KV = {"float32": np.float32, "float16": np.float16}

try:
    from onnxruntime.quantization import CalibrationDataReader
except ImportError:  # the reader is only built where onnxruntime is installed; keep the module importable
    CalibrationDataReader = object


class StaticKVReader(CalibrationDataReader):
    """Feeds for `quantize_static`, GPTQ and ModelOpt: dicts of input_ids [B,T], cache_len [B],
    past_keys / past_values [L,B,Hkv,S,D]. The KV of verify feeds is prefilled by the fp32 graph `fp32_path`."""

    def __init__(self, fp32_path: Path, entry: ModelEntry, windows: np.ndarray, verify_len: int = 5,
                 batch: int = 1, kinds: tuple = ("prefill", "verify")):
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
        if self.entry.lowering == "gqa" and self.batch != 1:
            raise ConfigError(f"calibration batch {self.batch} with the gqa lowering", "use batch 1 for gqa graphs")
        if not 1 <= self.batch <= self.entry.max_batch:
            raise ConfigError(f"calibration batch {self.batch} is outside 1..{self.entry.max_batch}", "use batch 1")
        if not set(self.kinds) <= {"prefill", "verify"} or not self.kinds:
            raise ConfigError(f"feed kinds {self.kinds} are unknown", "use ('prefill', 'verify')")

    def __deepcopy__(self, memo):
        # onnxruntime's GPTQ deep-copies the reader; a fresh, rewound copy shares no session
        return StaticKVReader(self.fp32_path, self.entry, self.windows, self.verify_len, self.batch, self.kinds)

    def __len__(self) -> int:
        return -(-len(self.windows) // self.batch) * len(self.kinds)

    def empty_kv(self, batch: int) -> np.ndarray:
        """[L, B, Hkv, S, D] zeros (a gqa layer's buffer is one [B, Hkv, S, D] slice of it)."""
        d = self.entry.dims
        shape = (d.num_layers, batch, d.num_kv_heads, self.entry.max_seq_len, d.head_dim)  # [L, B, Hkv, S, D]
        return np.zeros(shape, NUMPY_KV.get(self.entry.kv_dtype, np.float32))

    def _session(self):
        if self.session is None:
            try:
                import onnxruntime as ort
            except ImportError as exc:
                raise missing_dependency("onnxruntime", "cpu") from exc
            from specdec.runtime.backend import session_options

            self.session = ort.InferenceSession(str(self.fp32_path), session_options(),
                                                providers=["CPUExecutionProvider"])
        return self.session

    def _gqa_feeds(self, rows: np.ndarray, prefill: int) -> list[dict]:
        # rows: [1, W]; KV per layer [1, Hkv, S, D]; present_* come back whole (the buffer updated in place)
        layers = self.entry.dims.num_layers
        names = [f"past_{kind}.{i}" for kind in ("key", "value") for i in range(layers)]
        cache = {name: self.empty_kv(1)[0] for name in names}
        first = {"input_ids": rows[:, :prefill].copy(), "cache_len": np.zeros(1, np.int64),
                 "logit_positions": np.arange(prefill, dtype=np.int64), **cache}
        feeds = [first] if "prefill" in self.kinds else []
        if "verify" in self.kinds:
            outputs = self._session().run(None, {k: (v.copy() if k in cache else v) for k, v in first.items()})
            filled = dict(zip(names, outputs[1:]))  # outputs: logits, present_key.0.., present_value.0..
            feeds.append({"input_ids": rows[:, prefill:].copy(), "cache_len": np.full(1, prefill, np.int64),
                          "logit_positions": np.arange(self.verify_len, dtype=np.int64), **filled})
        return feeds

    def feeds_of(self, rows: np.ndarray) -> list[dict]:
        # rows: [B, W] -> prefill feed (T = W - verify_len, cache 0) and verify feed (T = verify_len)
        batch, width = rows.shape
        if self.entry.lowering == "gqa":
            return self._gqa_feeds(rows, width - self.verify_len)
        prefill = width - self.verify_len
        keys, values = self.empty_kv(batch), self.empty_kv(batch)
        first = {"input_ids": rows[:, :prefill].copy(), "cache_len": np.zeros(batch, np.int64),
                 "past_keys": keys, "past_values": values}
        feeds = [first] if "prefill" in self.kinds else []
        if "verify" in self.kinds:
            _, new_keys, new_values = self._session().run(None, first)  # new_*: [L, B, Hkv, P, D]
            keys, values = keys.copy(), values.copy()
            keys[:, :, :, :prefill], values[:, :, :, :prefill] = new_keys, new_values
            feeds.append({"input_ids": rows[:, prefill:].copy(), "cache_len": np.full(batch, prefill, np.int64),
                          "past_keys": keys, "past_values": values})
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
