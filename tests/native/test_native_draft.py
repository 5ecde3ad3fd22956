"""The native backend's draft: an int4-q41 draft runs on its target's Q4_1 blocks with int8 activations and its
graph's trimmed head, and shares the target's KV. Its logits stay near its onnxruntime graph's and the target's,
the tokens its head does not score get the fill, it writes KV only past the committed positions (which the verify
pass then overwrites), and speculative decoding stays exact: greedy equal to target-only, sampling the target's
distribution."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from specdec import GenerationConfig
from specdec.calibration.q41 import HEAD_FILL
from specdec.errors import BackendError
from specdec.manifest import read_manifest
from specdec.native import build
from specdec.blocks import BLOCK4, q41_pairs
from specdec.runtime import load
from specdec.runtime.backend import unwrapped
from specdec.runtime.native_backend import NativeBackend
from specdec.runtime.ort_backend import OrtBackend
from specdec.runtime.registry import open_pair
from tests.runtime.test_distribution import NEW_TOKENS, PROMPT, TOP_K, exact_joint, p_value, sampled

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")
from tests.native.conftest import HEAD_TOKENS


@pytest.fixture(scope="module")
def pair(q41_bundle):
    manifest = read_manifest(q41_bundle)
    target, draft = open_pair(NativeBackend, q41_bundle, manifest, "cpu", 2)
    yield target, draft
    draft.close()
    target.close()


def test_the_backend_drafts_natively_only_for_a_q41_draft(q41_bundle, grid_bundle, pair):
    target, draft = pair
    assert isinstance(draft, NativeBackend) and draft.target is target
    assert draft.takes_kv_from(target) and not draft.takes_kv_from(NativeBackend(q41_bundle, target.entry))
    _, other = open_pair(NativeBackend, grid_bundle, read_manifest(grid_bundle), "cpu", 2)  # an int4 (MatMulNBits) draft
    assert isinstance(other, OrtBackend)


def _int8(x: np.ndarray) -> tuple:
    """x [T, K] float32 -> (what the draft's kernels multiply: per block of 32, d * (128 * qs + lo), qs = rint(x * 127
    / max|x|), lo = rint(128 * (x * 127 / max|x| - qs)), d = max|x| / (127 * 128), rounded in float32 as kernels.c
    rounds; the exact sums [T, K / 32] of each block, for the Q4_1 minimums)."""
    blocks = x.reshape(len(x), -1, 32)
    top = np.abs(blocks).max(-1, keepdims=True)
    steps = blocks * np.divide(np.float32(127), top, out=np.zeros_like(top), where=top > 0)
    codes = np.rint(steps)
    rest = np.rint((steps - codes) * np.float32(128))
    assert np.abs(codes).max() <= 127 and np.abs(rest).max() <= 64  # int8, and maddubs' pairs within int16
    rounded = ((np.float32(128) * codes + rest) * (top / np.float32(127 * 128))).reshape(x.shape)
    return rounded, blocks.sum(-1)


def test_int8_products_match_numpy(pair):
    """The same int8 codes (same float32 rounding) times each weight type: only the summation order differs. A Q4_1
    weight d*q + m adds d times the rounded activations' product and m times the exact block sum, its d and m in fp16
    (the draft's paired blocks). An odd count of blocks (K = 96) ends in a half-empty pair."""
    _, draft = pair
    weights, rng = draft.model.weights, np.random.default_rng(5)
    odd = np.zeros((24, 3), BLOCK4)
    odd["d"], odd["m"] = rng.uniform(1e-3, 2e-2, odd.shape), rng.uniform(-0.1, 0.0, odd.shape)
    odd["qs"] = rng.integers(0, 256, (*odd.shape, 16))
    for blocks in (weights.layers[0].qkv, weights.layers[0].down, odd, draft.model.head):
        for rows in (1, 5, 8):  # a tile of 6 and a rest
            x = rng.normal(0, 2, (rows, blocks.shape[1] * 32)).astype(np.float32)
            x[:, 3] *= 40  # an outlier sets its block's step
            rounded, sums = _int8(x)
            if blocks.dtype.names == ("d", "qs"):  # Q8_0
                want = rounded @ (blocks["d"][..., None] * blocks["qs"]).reshape(len(blocks), -1).T
            else:
                d, m = (blocks[name].astype(np.float16).astype(np.float32) for name in ("d", "m"))
                codes = np.concatenate([blocks["qs"] & 15, blocks["qs"] >> 4], axis=-1)  # [N, nb, 32]
                scaled = (d[..., None] * codes.astype(np.float32)).reshape(len(blocks), -1)
                want = rounded @ scaled.T + sums @ m.T
            got = draft.model.matmul(x, q41_pairs(blocks) if blocks.dtype == BLOCK4 else blocks, "int8")
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
            fp32 = draft.model.matmul(x, blocks)  # and the rounding is there, at about 15 bits (2e-4 here)
            assert 1e-6 * np.abs(fp32).max() < np.abs(got - fp32).max() < 1e-3 * np.abs(fp32).max()


def test_draft_is_the_target_with_int8_activations_and_its_heads_rows(pair):
    """With the rounding off, the draft computes its target's logits on the rows its head keeps, over the shared KV."""
    target, draft = pair
    ids = np.random.default_rng(3).integers(3, target.vocab_size, (1, 20))
    target.reset(1)
    draft.reset(1)
    want = target.forward(ids, np.array([0]))[0, 12:]
    draft.model.quant = False
    try:
        exact = draft.forward(ids[:, 12:], np.array([12]))[0]  # positions 0..11: the target's KV
    finally:
        draft.model.quant = True
    kept = draft.model.draft.head_rows
    assert HEAD_TOKENS <= len(kept) < target.vocab_size and np.all(np.delete(exact, kept, axis=1) == HEAD_FILL)
    assert np.abs(exact[:, kept] - want[:, kept]).max() <= 1e-5 * np.abs(want).max()
    target.forward(ids[:, :12], np.array([0]))
    rounded = draft.forward(ids[:, 12:], np.array([12]))[0]
    assert np.all(np.delete(rounded, kept, axis=1) == HEAD_FILL)
    assert np.abs(rounded[:, kept] - want[:, kept]).max() <= 2e-3 * np.abs(want).max()  # about 15-bit activations
    assert np.all(rounded.argmax(-1) == kept[want[:, kept].argmax(-1)])


def test_draft_scores_the_tokens_its_graph_scores(q41_bundle, pair):
    _, draft = pair
    graph = OrtBackend(q41_bundle, draft.entry, 2).open()
    graph.reset(1)
    scored = graph.forward(np.array([[5, 17, 42]]), np.array([0]))[0] != HEAD_FILL
    assert np.array_equal(np.flatnonzero(scored[0]), draft.model.draft.head_rows)


def test_draft_writes_kv_only_past_the_committed_positions(q41_bundle, pair):
    target, draft = pair
    ids = np.random.default_rng(4).integers(3, target.vocab_size, (1, 15))
    target.reset(2)
    draft.reset(2)
    target.forward(ids[:, :12], np.array([0]), slots=np.array([1]))
    keys, values = target.model.keys[:, 1].copy(), target.model.values[:, 1].copy()
    draft.copy_kv(target, 1, 0, 12)  # shared: nothing to copy
    draft.forward(ids[:, 12:], np.array([12]), slots=np.array([1]))  # three draft positions
    assert np.array_equal(target.model.keys[:, 1, :, :12], keys[:, :, :12])
    assert np.array_equal(target.model.values[:, 1, :, :12], values[:, :, :12])
    assert not np.array_equal(target.model.keys[:, 1, :, 12:15], keys[:, :, 12:15])
    verify = target.forward(ids[:, 12:], np.array([12]), slots=np.array([1]))  # overwrites the draft's positions
    alone = NativeBackend(q41_bundle, target.entry, 2).open()
    alone.reset(1)
    assert np.array_equal(verify, alone.forward(ids, np.array([0]))[:, 12:])
    assert np.array_equal(target.model.keys[:, 1, :, :15], alone.model.keys[:, 0, :, :15])
    with pytest.raises(BackendError, match="holds 2 slots, not 3"):
        draft.reset(3)


@pytest.mark.parametrize("drafter,gamma", [("model", 1), ("model", 4), ("auto", 3)])
def test_greedy_identical_to_target_only(q41_bundle, drafter, gamma):
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown"
    with load(q41_bundle) as ort, load(q41_bundle, backend="native") as native:
        assert isinstance(unwrapped(native.draft), NativeBackend)
        reference = ort.generate(prompt, GenerationConfig(max_new_tokens=40, drafter="none")).token_ids
        got = native.generate(prompt, GenerationConfig(max_new_tokens=40, drafter=drafter, gamma=gamma))
    assert got.token_ids == reference and len(reference) > 8
    assert got.stats.proposed > 0


def test_sampling_matches_the_target_distribution(q41_bundle):
    """The draft's q is 0 where its head does not score; acceptance uses that q: the output stays exact."""
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3, drafter="model", eos_token_ids=(), **TOP_K)
    with load(q41_bundle, backend="native") as gen:  # no EOS: every sample has NEW_TOKENS tokens, as exact_joint counts
        prompt_ids = gen.codec.encode(PROMPT)
        counts, (proposed, accepted) = sampled(gen, prompt_ids, config)
        assert proposed[2] > 100 and accepted[1] > 50, (proposed, accepted)
        assert p_value(exact_joint(gen, prompt_ids, config), counts) > 1e-3


def test_demo_runs_both_backends(q41_bundle):
    demo = [sys.executable, "-m", "specdec.cli.demo", "--new-tokens", "8", "--repeats", "1"]
    done = subprocess.run([*demo, str(q41_bundle)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "[onnxruntime] greedy" in done.stdout and "identical across drafters and backends" in done.stdout
    off = dict(os.environ, SPECDEC_BACKEND="onnxruntime")  # a machine where native does not open
    skipped = subprocess.run([*demo, str(q41_bundle)], capture_output=True, text=True, timeout=600, env=off)
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert "[native] skipped: " in skipped.stdout and "turned off" in skipped.stdout
