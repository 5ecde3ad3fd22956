"""A text prompt too long for S by its byte count is refused before it is tokenized (RequestLayer.prompt_text), with
a bound that is sound: no text of more bytes than the bound encodes to S tokens or fewer."""
from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

import specdec
from specdec.runtime.config import RequestCapacityError
from specdec.runtime.text import token_bytes


@pytest.fixture(scope="module")
def gen(int4_bundle):
    with specdec.load(int4_bundle, backend="onnxruntime") as generator:
        yield generator


def _texts(codec, seed: int = 0):
    """Texts built from the vocabulary's own tokens (the longest among them), whitespace runs and multi-byte text."""
    rng = np.random.default_rng(seed)
    vocab = sorted(codec.tokenizer.get_vocab(), key=len)[-200:]
    for _ in range(20):
        pieces = [codec.decode([codec.tokenizer.token_to_id(t)]) for t in rng.choice(vocab, 50)]
        yield "".join(pieces)
    yield " " * 5000
    yield "\n" * 3000 + "é漢字🙂" * 500


def test_the_byte_bound_is_sound(gen):
    codec = gen.codec
    assert codec.token_bytes is not None  # a byte-level BPE: bounded
    for text in _texts(codec):
        ids = codec.encode(text)
        assert len(text.encode("utf-8")) <= len(ids) * codec.token_bytes


def test_a_prompt_over_the_bound_is_refused_untokenized(gen, monkeypatch):
    layer = gen.requests
    bound = layer.max_text_bytes
    assert bound == gen.manifest.target.max_seq_len * gen.codec.token_bytes

    def tokenized(*args, **kwargs):
        raise AssertionError("a prompt over the byte bound was tokenized")

    monkeypatch.setattr(gen.codec, "encode", tokenized)
    for prompt in ("a" * (bound + 1), "é" * (bound // 2 + 1)):  # by bytes, not characters
        with pytest.raises(RequestCapacityError, match="bytes of text") as caught:
            layer.prompt_ids(prompt)
        assert caught.value.public.startswith("the prompt is longer than this model's context")
        assert caught.value.hint


def test_a_chat_over_the_bound_stops_rendering(gen):
    layer = gen.requests
    with pytest.raises(RequestCapacityError, match="grew past"):
        layer.chat_ids([{"role": "user", "content": "x" * (layer.max_text_bytes + 1)}])


def test_a_prompt_under_the_bound_is_still_counted_in_tokens(gen):
    size = gen.manifest.target.max_seq_len
    with pytest.raises(RequestCapacityError, match=f"max_seq_len is {size}"):
        gen.requests.prompt_ids(" hello" * (size + 1))  # ~1 token per word: over S, under the byte bound


@pytest.mark.parametrize("build", [
    lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Whitespace()),  # drops whitespace
    lambda t: setattr(t, "normalizer", normalizers.Replace("  ", "")),  # deletes text
    lambda t: setattr(t, "normalizer", normalizers.Sequence([normalizers.NFC(), normalizers.Strip()])),
])
def test_tokenizers_that_drop_text_have_no_bound(build):
    tokenizer = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert token_bytes(tokenizer) == 2
    build(tokenizer)
    assert token_bytes(tokenizer) is None


def test_composition_widens_the_bound():
    tokenizer = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    tokenizer.normalizer = normalizers.NFC()  # three code points can compose into one
    assert token_bytes(tokenizer) == 2 * 3


def test_a_prompt_worker_leaves_out_only_the_sanitizers_preloaded_runtimes():
    """make test-sanitize preloads ASan and UBSan for the native kernels; a worker, which never loads them, starts
    without them (ASan's shadow mappings break its RLIMIT_DATA), and keeps any other preloaded library."""
    from specdec.runtime.prompt_worker import _without_sanitizers

    preload = "/usr/lib/gcc/x86_64-linux-gnu/12/libasan.so /opt/libjemalloc.so.2:/usr/lib/libubsan.so.1"
    assert _without_sanitizers(preload) == "/opt/libjemalloc.so.2"
    assert _without_sanitizers("") == ""
