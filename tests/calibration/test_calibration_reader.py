"""The calibration reader feeds the static-KV contract: prefill feeds and verify feeds over a prefilled cache."""
from __future__ import annotations

import copy

import numpy as np
import onnxruntime as ort
import pytest

from specdec.calibration.reader import StaticKVReader
from specdec.errors import ConfigError
from specdec.manifest import read_manifest
from specdec.runtime.backend import session_options

WIDTH, VERIFY = 12, 4


@pytest.fixture(scope="module")
def target(int4_bundle):
    manifest = read_manifest(int4_bundle)
    return int4_bundle / manifest.target.onnx_path, manifest.target


def _windows(vocab, count=3):
    return np.random.default_rng(0).integers(3, vocab, size=(count, WIDTH)).astype(np.int64)


@pytest.mark.parametrize("batch", [1, 2])
def test_reader_feeds_prefill_then_verify_shapes(target, batch):
    path, entry = target
    d = entry.dims
    reader = StaticKVReader(path, entry, _windows(d.vocab_size), VERIFY, batch=batch)
    feeds = list(iter(reader.get_next, None))
    assert len(feeds) == len(reader) == 2 * -(-3 // batch)
    prefill, verify = feeds[0], feeds[1]
    kv_shape = (d.num_layers, batch, d.num_kv_heads, entry.max_seq_len, d.head_dim)  # [L, B, Hkv, S, D]
    assert prefill["input_ids"].shape == (batch, WIDTH - VERIFY) and prefill["cache_len"].tolist() == [0] * batch
    assert verify["input_ids"].shape == (batch, VERIFY)
    assert verify["cache_len"].tolist() == [WIDTH - VERIFY] * batch
    for feed in (prefill, verify):
        assert feed["past_keys"].shape == feed["past_values"].shape == kv_shape
        assert feed["input_ids"].dtype == feed["cache_len"].dtype == np.int64
        assert feed["past_keys"].dtype == np.float32
    assert not prefill["past_keys"].any()
    filled = np.abs(verify["past_keys"][:, :, :, : WIDTH - VERIFY]).sum(axis=(0, 2, 4))  # [B, P]
    assert (filled > 0).all()
    assert not verify["past_keys"][:, :, :, WIDTH - VERIFY :].any()
    reader.rewind()
    assert reader.get_next()["input_ids"].shape == prefill["input_ids"].shape


def test_verify_feed_over_the_prefilled_cache_matches_one_full_pass(target):
    path, entry = target
    windows = _windows(entry.dims.vocab_size, 1)
    reader = StaticKVReader(path, entry, windows, VERIFY)
    _, verify = list(iter(reader.get_next, None))
    session = ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"])
    d = entry.dims
    empty = np.zeros((d.num_layers, 1, d.num_kv_heads, entry.max_seq_len, d.head_dim), np.float32)  # [L,B,Hkv,S,D]
    full = {"input_ids": windows, "cache_len": np.zeros(1, np.int64), "past_keys": empty, "past_values": empty}
    expected = session.run(["logits"], full)[0][:, -VERIFY:]  # [1, T, V]
    got = session.run(["logits"], verify)[0]
    assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()


def test_reader_deep_copies_fresh_and_checks_its_input(target):
    path, entry = target
    reader = StaticKVReader(path, entry, _windows(entry.dims.vocab_size), VERIFY)
    reader.get_next()
    clone = copy.deepcopy(reader)  # onnxruntime's GPTQ deep-copies the reader
    assert clone.session is None and clone.pending is None and len(list(clone)) == len(reader)
    with pytest.raises(ConfigError, match="verify_len"):
        StaticKVReader(path, entry, _windows(entry.dims.vocab_size), WIDTH)
    with pytest.raises(ConfigError, match="batch"):
        StaticKVReader(path, entry, _windows(entry.dims.vocab_size), VERIFY, batch=entry.max_batch + 1)
    with pytest.raises(ConfigError, match="shape"):
        StaticKVReader(path, entry, np.zeros((0, WIDTH), np.int64), VERIFY)


def test_reader_feeds_the_gqa_lowering(gqa_int4_bundle):
    manifest = read_manifest(gqa_int4_bundle)
    entry = manifest.target
    d = entry.dims
    reader = StaticKVReader(gqa_int4_bundle / entry.onnx_path, entry, _windows(d.vocab_size, 2), VERIFY)
    prefill, verify = reader.get_next(), reader.get_next()
    layer = (1, d.num_kv_heads, entry.max_seq_len, d.head_dim)  # [B, Hkv, S, D] per layer
    assert prefill["input_ids"].shape == (1, WIDTH - VERIFY) and prefill["logit_positions"].tolist() == list(range(WIDTH - VERIFY))
    assert verify["input_ids"].shape == (1, VERIFY) and verify["cache_len"].tolist() == [WIDTH - VERIFY]
    for i in range(d.num_layers):
        assert prefill[f"past_key.{i}"].shape == verify[f"past_value.{i}"].shape == layer
        assert not prefill[f"past_key.{i}"].any()
        assert (np.abs(verify[f"past_key.{i}"][0, :, : WIDTH - VERIFY]).sum(axis=(0, 2)) > 0).all()
        assert not verify[f"past_key.{i}"][0, :, WIDTH - VERIFY :].any()
    with pytest.raises(ConfigError, match="batch 1"):
        StaticKVReader(gqa_int4_bundle / entry.onnx_path, entry, _windows(d.vocab_size, 2), VERIFY, batch=2)
