"""A frequency-trimmed int4-q41 draft head: same scores on the kept tokens, the fill elsewhere, and still exact."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import specdec
from specdec import GenerationConfig
from specdec.calibration.bundle_io import quantized_bundle
from specdec.calibration.data import DataConfig
from specdec.calibration.q41 import HEAD_FILL
from specdec.calibration.quantize import QuantizeConfig
from specdec.errors import ConfigError
from specdec.manifest import check_bundle_files, read_manifest
from specdec.runtime.ort_backend import OrtBackend
from tests.calibration.test_calibration_quantize import _greedy_equal
from tests.runtime.test_distribution import PROMPT, TOKENS, TOP_K, exact_joint, p_value, sampled

DATA = DataConfig(seq_len=16, num_samples=4)
HEAD_TOKENS = 8


@pytest.fixture(scope="module")
def trimmed(gqa_int4_bundle, tmp_path_factory):
    """(full-head int4-q41 bundle, trimmed-head bundle) of the tiny gqa model."""
    root = tmp_path_factory.mktemp("trim")
    full = quantized_bundle(gqa_int4_bundle, root / "full", QuantizeConfig(method="int4-q41", data=DATA))
    trim = quantized_bundle(gqa_int4_bundle, root / "trim",
                            QuantizeConfig(method="int4-q41", data=DATA, head_tokens=HEAD_TOKENS))
    return full, trim


def _draft_logits(bundle, ids):
    manifest = read_manifest(bundle)
    backend = OrtBackend(bundle, manifest.draft).open()
    backend.reset(1)
    return backend.forward(np.array([ids], dtype=np.int64), np.zeros(1, np.int64))[0]  # [T, V]


def test_trimmed_head_scores_the_kept_tokens_and_fills_the_rest(trimmed):
    full, trim = trimmed
    manifest = read_manifest(trim)
    check_bundle_files(trim, manifest)
    head = manifest.draft.calibration.details["lm_head"]
    vocab = manifest.draft.dims.vocab_size
    assert HEAD_TOKENS <= head["kept_tokens"] < vocab and "probability mass" in head["ranked_by"]
    ids = [5, 17, 42, 99, 7]
    want, got = _draft_logits(full, ids), _draft_logits(trim, ids)
    assert got.shape == want.shape == (len(ids), vocab)  # the graph keeps the vocabulary dimension
    kept = got[0] != HEAD_FILL
    assert kept.sum() == head["kept_tokens"]
    assert all(kept[t] for t in manifest.tokenizer.eos_token_ids)  # the draft can always propose EOS
    # the same rows of the same 8-bit head (a narrower MatMulNBits may sum in another order)
    assert np.abs(got[:, kept] - want[:, kept]).max() <= 1e-5 * np.abs(want).max()
    assert np.all(got[:, ~kept] == HEAD_FILL)
    ops = [n.op_type for n in onnx.load(str(trim / manifest.draft.onnx_path), load_external_data=False).graph.node]
    # the scores go back to [.., V] through Pad + GatherElements (Gather along axis 1 was 5x slower per call)
    assert ops.count("Pad") == 1 and ops.count("GatherElements") == 1


def test_trimmed_head_draft_keeps_greedy_equality(trimmed):
    _greedy_equal(trimmed[1], gammas=(1, 4))


def test_trimmed_head_draft_samples_the_target_distribution(trimmed):
    """q is 0 on the tokens the head does not score; acceptance uses that q, so the output stays exact."""
    config = GenerationConfig(max_new_tokens=TOKENS + 1, gamma=3, drafter="model", **TOP_K)
    with specdec.load(trimmed[1]) as gen:
        prompt_ids = gen.codec.encode(PROMPT)
        expected = exact_joint(gen, prompt_ids, config)
        scored = _draft_logits(trimmed[1], prompt_ids)[-1] != HEAD_FILL
        assert not all(scored[key[0]] for key in expected)  # the target can emit a first token the draft cannot propose
        assert p_value(expected, sampled(gen, prompt_ids, config)[0]) > 1e-3


def test_head_tokens_only_for_int4_q41_drafts():
    with pytest.raises(ConfigError, match="int4-q41 drafts only") as err:
        QuantizeConfig(method="int4-rtn", head_tokens=100)
    assert "Hint:" in str(err.value)
    with pytest.raises(ConfigError, match="int4-q41 drafts only"):
        QuantizeConfig(method="int4-q41", role="target", head_tokens=100)
