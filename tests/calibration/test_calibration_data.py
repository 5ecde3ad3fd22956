"""Calibration data: sources, windows, and every bad-input error."""
from __future__ import annotations

import json
import logging
import sys

import numpy as np
import pytest

from specdec.calibration.builtin_texts import TEXTS
from specdec.calibration.data import DataConfig, split_texts, texts_from_source, token_windows
from specdec.errors import ConfigError, MissingDependencyError


def encode(text):
    return list(text.encode("utf-8"))


def test_builtin_set_is_varied_and_splits_into_calibration_and_held_out():
    texts = texts_from_source("builtin")
    assert len(texts) >= 30 and texts == list(TEXTS) and all(t.strip() for t in texts)
    kept, held = split_texts(texts, 0.25)
    assert held and kept and not set(kept) & set(held) and len(kept) + len(held) == len(texts)


def test_text_jsonl_and_parquet_sources(tmp_path):
    (tmp_path / "a.txt").write_text("first paragraph\n\nsecond one\n\n\n", encoding="utf-8")
    assert texts_from_source(str(tmp_path / "a.txt")) == ["first paragraph", "second one"]
    lines = [json.dumps({"text": "one"}), "", json.dumps({"text": "two", "id": 3})]
    (tmp_path / "a.jsonl").write_text("\n".join(lines), encoding="utf-8")
    assert texts_from_source(str(tmp_path / "a.jsonl")) == ["one", "two"]
    pl = pytest.importorskip("polars")
    pl.DataFrame({"body": ["x y", "z"]}).write_parquet(tmp_path / "a.parquet")
    assert texts_from_source(str(tmp_path / "a.parquet"), field="body") == ["x y", "z"]


def test_windows_have_the_asked_shape():
    windows = token_windows(["abcdefgh" * 10], encode, seq_len=16, count=3)
    assert windows.shape == (3, 16) and windows.dtype == np.int64


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.mark.parametrize("source, level", [("mine.txt", logging.WARNING), ("builtin", logging.INFO)])
def test_short_data_is_a_warning_only_for_the_users_own_source(source, level):
    logger, handler = logging.getLogger("specdec.calibration.data"), _Records()
    logger.addHandler(handler)
    old_level, logger.level = logger.level, logging.DEBUG
    try:
        windows = token_windows(["abcdefgh" * 4], encode, seq_len=16, count=5, source=source)  # 32 bytes: 2 windows
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert windows.shape == (2, 16)
    assert [(r.levelno, r.getMessage()) for r in handler.records] == [
        (level, f"calibration data {source} has 2 windows of 16 tokens; 5 were asked for")]


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_text_file_is_refused_with_a_hint(tmp_path, content):
    path = tmp_path / "empty.txt"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match="holds no text") as err:
        texts_from_source(str(path))
    assert "Hint:" in str(err.value)


def test_too_little_data_is_refused_with_a_hint():
    with pytest.raises(ConfigError, match="one window needs 64") as err:
        token_windows(["tiny"], encode, seq_len=64, count=4, source="tiny.txt")
    assert "Hint:" in str(err.value) and "--seq-len" in str(err.value)


def test_bad_jsonl_missing_file_and_unknown_format(tmp_path):
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "no text field"}), encoding="utf-8")
    with pytest.raises(ConfigError, match="no string field 'text'"):
        texts_from_source(str(tmp_path / "b.jsonl"))
    (tmp_path / "c.jsonl").write_text("{not json", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid JSON"):
        texts_from_source(str(tmp_path / "c.jsonl"))
    with pytest.raises(ConfigError, match="does not exist"):
        texts_from_source(str(tmp_path / "missing.txt"))
    with pytest.raises(ConfigError, match="unsupported format"):
        DataConfig(source=str(tmp_path / "data.csv"))
    with pytest.raises(ConfigError, match="seq_len"):
        DataConfig(seq_len=1)


def test_parquet_without_polars_names_the_bench_extra(tmp_path, monkeypatch):
    path = tmp_path / "a.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "polars", None)  # `import polars` raises ImportError
    with pytest.raises(MissingDependencyError) as err:
        texts_from_source(str(path))
    assert "pip install 'specdec[bench]'" in str(err.value)
