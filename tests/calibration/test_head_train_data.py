"""The training data: the target's answers on the native engine, rows batched, carry exactly the features and soft
labels of a teacher-forced pass over the finished sequence; shards are whole, resumable and the same for the same
seed however the rows were batched; the token budget and the deadline stop the run after the shard begun."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from specdec.calibration.head_train.generate import Answering, Budget, DataPlan, ShardRun, top_labels
from specdec.calibration.head_train.shards import Shards, shard_dir, shard_numbers
from specdec.manifest import read_manifest
from specdec.native import build
from specdec.runtime.forward import ForwardRequest, head_feature_layers
from specdec.runtime.native_backend import NativeBackend

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA, F16C")
PROMPTS = [[1, 5, 9, 4], [1, 7], [1, 3, 3, 8, 2, 6], [1, 11, 12], [1, 9, 9], [1, 4, 20, 21, 22], [1, 2], [1, 30, 31]]


def _run(bundle, root, rows: int, budget: Budget, clock=lambda: 0.0, seed: int = 0) -> int:
    manifest = read_manifest(bundle)
    target = NativeBackend(bundle, dataclasses.replace(manifest.target, max_batch=rows), threads=1).open()
    target.reset(rows)
    plan = DataPlan(rows=rows, max_new_tokens=10, top_k=8, per_shard=3, seed=seed)
    answering = Answering(target, head_feature_layers(manifest.target.dims.num_layers), (2,), plan)
    try:
        return ShardRun(answering, lambda i: PROMPTS[i], len(PROMPTS), root, budget, clock).run()
    finally:
        target.close()


def _arrays(root) -> dict:
    shards = Shards(root)
    return vars(shards.batch(list(range(len(shards)))))


def test_answers_carry_the_features_and_labels_of_a_teacher_forced_pass(native_bundle, tmp_path):
    _run(native_bundle, tmp_path, rows=3, budget=Budget())
    shards = Shards(tmp_path)
    assert len(shards) == len(PROMPTS) and shard_numbers(tmp_path) == [0, 1, 2]
    manifest = read_manifest(native_bundle)
    target = NativeBackend(native_bundle, manifest.target, threads=1).open()
    layers = head_feature_layers(manifest.target.dims.num_layers)
    for s in range(len(shards)):
        batch, n = shards.batch([s]), shards.length(s)
        tokens, start = batch.tokens[0, :n], int(batch.prompt_len[0])
        assert list(tokens[:start]) == PROMPTS[s]
        target.reset(1)
        fed = target.run(ForwardRequest(tokens[None, :-1], np.zeros(1, np.int64), feature_layers=layers))
        assert np.array_equal(batch.features[0, : n - 1], fed.features[0].astype(np.float16).astype(np.float32))
        for position in range(start - 1, n - 1):
            ids, probs = top_labels(fed.logits[0, position], 8)
            assert np.array_equal(batch.top_ids[0, position], ids)
            assert np.array_equal(batch.top_probs[0, position], probs.astype(np.float32))
            if s % 2 == 0:  # greedy rows: the answer is the target's argmax
                assert tokens[position + 1] == np.argmax(fed.logits[0, position])
        assert not batch.top_probs[0, : start - 1].any() and not batch.top_probs[0, n - 1].any()
    target.close()


def test_the_data_does_not_depend_on_batching_and_resumes_shard_by_shard(native_bundle, tmp_path):
    _run(native_bundle, tmp_path / "whole", rows=4, budget=Budget())
    first = _run(native_bundle, tmp_path / "parts", rows=2, budget=Budget(tokens=1))  # one shard, then stop
    assert shard_numbers(tmp_path / "parts") == [0] and first > 0
    written = (shard_dir(tmp_path / "parts", 0) / "tokens.npy").stat().st_mtime_ns
    _run(native_bundle, tmp_path / "parts", rows=3, budget=Budget())  # resumed: the other shards
    assert (shard_dir(tmp_path / "parts", 0) / "tokens.npy").stat().st_mtime_ns == written
    whole, parts = _arrays(tmp_path / "whole"), _arrays(tmp_path / "parts")
    assert all(np.array_equal(whole[name], parts[name]) for name in whole)
    _run(native_bundle, tmp_path / "seeded", rows=4, budget=Budget(), seed=1)
    assert not np.array_equal(_arrays(tmp_path / "seeded")["tokens"], whole["tokens"])  # other samples


def test_a_deadline_stops_taking_shards(native_bundle, tmp_path):
    ticks = itertools.count()
    _run(native_bundle, tmp_path, rows=2, budget=Budget(deadline=1.0), clock=lambda: float(next(ticks)))
    assert shard_numbers(tmp_path) == [0]  # begun before the deadline, finished after it


def test_labels_of_rows_together_are_each_rows_alone_and_the_sampler_draws_warps_tokens():
    from specdec.calibration.head_train.generate import sample_top_k, top_labels_rows
    from specdec.runtime.config import GenerationConfig
    from specdec.runtime.sampling import sample, warp

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((5, 3000)) * 4).astype(np.float32)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie at the top
    ids, probs = top_labels_rows(logits, 8)
    for row in range(5):
        alone = top_labels(logits[row], 8)
        assert np.array_equal(ids[row], alone[0]) and np.array_equal(probs[row], alone[1])
        exact = np.exp(logits[row].astype(np.float64) - logits[row].max())
        exact /= exact.sum()
        assert set(ids[row]) == set(np.argsort(-exact, kind="stable")[:8])
        assert np.allclose(probs[row].astype(np.float64), exact[ids[row]], rtol=2e-3)  # float16 kept
    config = GenerationConfig(temperature=0.8, top_k=50, top_p=1.0)
    for row in range(5):
        for seed in range(40):  # the same uniform draw picks the same token as warp and sample
            assert sample_top_k(logits[row], 0.8, 50, np.random.default_rng(seed)) == \
                sample(warp(logits[row], config), np.random.default_rng(seed))
    wrong = [sample_top_k(logits[0], 0.8, 3000, np.random.default_rng(seed)) for seed in range(40)]  # no top-k
    assert wrong != [sample(warp(logits[0], config), np.random.default_rng(seed)) for seed in range(40)]
