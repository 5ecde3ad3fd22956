"""Calibration text: a text file, JSONL (a "text" field), parquet (polars) or the built-in set -> token windows."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.errors import ConfigError, missing_dependency

log = logging.getLogger(__name__)

BUILTIN = "builtin"
SUFFIXES = (".txt", ".md", ".jsonl", ".parquet")


@dataclass(frozen=True)
class DataConfig:
    """Where calibration text comes from and how it is cut into token windows."""

    source: str = BUILTIN  # "builtin" or a .txt/.md, .jsonl or .parquet path
    field: str = "text"  # the text column of JSONL / parquet
    seq_len: int = 64  # tokens per calibration window
    num_samples: int = 16  # windows used for calibration
    held_out: float = 0.25  # fraction of texts kept for perplexity / agreement, never calibrated on

    def __post_init__(self):
        if not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise ConfigError(f"calibration seq_len must be >= 2, got {self.seq_len!r}", "pass --seq-len 64")
        if not isinstance(self.num_samples, int) or self.num_samples < 1:
            raise ConfigError(f"calibration num_samples must be >= 1, got {self.num_samples!r}", "pass --samples 16")
        if not 0.0 <= self.held_out < 1.0:
            raise ConfigError(f"held_out must be in [0, 1), got {self.held_out}", "use 0.25")
        if self.source != BUILTIN and Path(self.source).suffix.lower() not in SUFFIXES:
            raise ConfigError(
                f"calibration data {self.source!r} has an unsupported format",
                f"pass a file ending in {', '.join(SUFFIXES)}, or 'builtin'",
            )


def _empty(source: str) -> ConfigError:
    return ConfigError(
        f"calibration data {source!r} holds no text",
        "pass a file with at least a few paragraphs of text (or --data builtin)",
    )


def _read_text(path: Path) -> str:
    """The file as UTF-8 text (a byte-order mark is dropped); ConfigError that says where it is not UTF-8."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read calibration data {str(path)!r}: {exc.strerror}", "pass a readable file") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"calibration data {str(path)!r} is not UTF-8 text: byte {exc.start} (line {line}) is "
                          f"0x{data[exc.start]:02x}",
                          "save the file as UTF-8, e.g. iconv -f latin1 -t utf-8 IN > OUT") from None


def _read_jsonl(path: Path, field: str) -> list[str]:
    texts = []
    for number, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number} is not valid JSON ({exc.msg})", "write one JSON object per line") from exc
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise ConfigError(f"{path}:{number} has no string field {field!r}", f"give every line a {field!r} field")
        texts.append(record[field])
    return texts


def _read_parquet(path: Path, field: str) -> list[str]:
    try:
        import polars as pl
    except ImportError as exc:
        raise missing_dependency("polars", "bench") from exc
    try:
        frame = pl.scan_parquet(path)
        names = frame.collect_schema().names()
        if field not in names:
            raise ConfigError(f"{path} has no column {field!r}", f"pass --field with one of {names}")
        return [t for t in frame.select(pl.col(field).cast(pl.Utf8)).collect().to_series().to_list() if t]
    except (pl.exceptions.PolarsError, OSError) as exc:  # a cut or corrupt file, a column that is not text
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"calibration data {str(path)!r} cannot be read as parquet text ({first})",
                          f"check that the file is complete and its {field!r} column holds UTF-8 text; "
                          "write it again (polars: DataFrame.write_parquet)") from None


def texts_from_source(source: str = BUILTIN, field: str = "text") -> list[str]:
    """Non-empty paragraphs of a calibration source, in file order."""
    if source == BUILTIN:
        from specdec.calibration.builtin_texts import TEXTS

        return list(TEXTS)
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"calibration data {source!r} does not exist", "pass an existing file, or --data builtin")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        texts = _read_jsonl(path, field)
    elif suffix == ".parquet":
        texts = _read_parquet(path, field)
    else:
        texts = _read_text(path).split("\n\n")
    texts = [t.strip() for t in texts if t and t.strip()]
    if not texts:
        raise _empty(source)
    return texts


def split_texts(texts: list[str], held_out: float) -> tuple[list[str], list[str]]:
    """(calibration texts, held-out texts): every k-th text is held out, so both halves mix the kinds of text."""
    if held_out <= 0 or len(texts) < 2:
        return texts, []
    every = max(2, round(1 / held_out))
    kept = [t for i, t in enumerate(texts) if i % every != every - 1]
    return kept, [t for i, t in enumerate(texts) if i % every == every - 1]


def token_windows(texts: list[str], encode, seq_len: int, count: int, source: str = BUILTIN) -> np.ndarray:
    """Encode each text, join them into one stream and cut `count` windows of `seq_len` tokens (fewer if the
    stream is short, but at least one). -> [N, seq_len] int64"""
    stream = [token for text in texts for token in encode(text)]
    if not stream:
        raise _empty(source)
    if len(stream) < seq_len:
        raise ConfigError(
            f"calibration data {source!r} has {len(stream)} tokens; one window needs {seq_len}",
            f"pass more text (at least {seq_len} tokens), or a smaller --seq-len",
        )
    windows = np.asarray(stream[: (len(stream) // seq_len) * seq_len], dtype=np.int64).reshape(-1, seq_len)
    if len(windows) < count:  # the user's own data falls short: say so; the built-in text's size is known
        (log.info if source == BUILTIN else log.warning)(
            "calibration data %s has %d windows of %d tokens; %d were asked for", source, len(windows), seq_len, count)
    picks = np.linspace(0, len(windows) - 1, num=min(count, len(windows))).round().astype(int)
    return windows[picks]


def describe_source(config: DataConfig, windows: np.ndarray) -> dict:
    """What the manifest records about the calibration data."""
    record = {"source": config.source, "field": config.field, "windows": int(windows.shape[0]),
              "seq_len": int(windows.shape[1])}
    if config.source != BUILTIN:
        from specdec.manifest import sha256_file

        record["sha256"] = sha256_file(config.source)
    return record
