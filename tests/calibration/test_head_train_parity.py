"""The head training optimises is the head that runs: TorchHead's catch-up pass and its training-time test (chain
steps on the head's own output hidden states) against specdec.head.model's numpy forward on the same weights,
catching up to each origin and drafting from there with its own KV, as HeadDrafter does."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from specdec.calibration.head_train.torch_head import TorchHead
from specdec.head.model import FloatProducts, HeadModel, TokenEmbedding, packed
from specdec.head.random import random_head
from specdec.manifest import ModelDims

TOLERANCE = 1e-4  # of the largest |logit|: fp32 in another summation order (torch's products and attention)
STEPS = 3
DIMS = ModelDims(model_type="llama", num_layers=8, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64,
                 vocab_size=300, max_positions=128)


def _heads(norm_before_residual: bool):
    weights, record = random_head(DIMS, (1, 3, 4), np.arange(0, DIMS.vocab_size, 3), seed=5)
    record = dataclasses.replace(record, norm_before_residual=norm_before_residual)
    table = np.random.default_rng(0).standard_normal((DIMS.vocab_size, DIMS.hidden_size)).astype(np.float32)
    numpy_head = HeadModel(weights, record, TokenEmbedding(table), FloatProducts(packed(weights)), 64)
    return numpy_head, TorchHead(weights, record, table)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_torch_head_computes_what_the_runtime_head_computes(norm_before_residual):
    numpy_head, torch_head = _heads(norm_before_residual)
    rng = np.random.default_rng(1)
    T = 14
    features = rng.standard_normal((1, T, 3, DIMS.hidden_size)).astype(np.float32)
    tokens = rng.integers(0, DIMS.vocab_size, (1, T))
    with torch.no_grad():
        fused = torch_head.fuse(torch.from_numpy(features))
        chain = [logits.numpy() for logits in torch_head.chain(torch.from_numpy(tokens), fused, STEPS)]
        whole, _ = torch_head(torch.from_numpy(tokens[:, 1:]), fused[:, :-1])
    fused_np = numpy_head.fuse(features)
    assert np.abs(fused.numpy() - fused_np).max() <= TOLERANCE * np.abs(fused_np).max()
    want, _ = numpy_head.forward(tokens[:, 1:], fused_np[:, :-1], [0], [0])  # the catch-up over every position
    scale = np.abs(want).max()
    assert np.abs(chain[0] - want).max() <= TOLERANCE * scale
    assert np.abs(whole.numpy() - want).max() <= TOLERANCE * scale
    for origin in range(T - STEPS):  # catch up to `origin`, then draft STEPS - 1 more, as HeadDrafter does
        logits, prenorm = numpy_head.forward(tokens[:, 1 : origin + 2], fused_np[:, : origin + 1], [0], [0],
                                             last_only=True)
        for step in range(1, STEPS):
            logits, prenorm = numpy_head.forward(tokens[:, origin + step + 1 : origin + step + 2], prenorm,
                                                 [origin + step], [0], last_only=True)
            assert np.abs(chain[step][0, origin] - logits[0, -1]).max() <= TOLERANCE * scale, (origin, step)


def test_weights_round_trip_and_gradients_reach_every_trained_tensor():
    numpy_head, torch_head = _heads(False)
    back = torch_head.weights()
    for name, array in numpy_head.weights.arrays().items():
        assert np.array_equal(getattr(back, name), array), name
    rng = np.random.default_rng(2)
    tokens = torch.from_numpy(rng.integers(0, DIMS.vocab_size, (2, 9)))
    features = torch.from_numpy(rng.standard_normal((2, 9, 3, DIMS.hidden_size)).astype(np.float32))
    sum(logits.logsumexp(-1).mean() for logits in torch_head.chain(tokens, torch_head.fuse(features), STEPS)).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in torch_head.parameters())


def test_the_batch_stream_runs_through_epochs_of_different_batch_counts():
    """Each epoch packs its own shuffle, so epochs hold different counts of batches: step s is placed by the counts
    before it (a stream that divided by epoch 0's count ran past a shorter epoch's end), and every epoch covers every
    sequence once."""
    from specdec.calibration.head_train.train import BatchStream, TrainPlan, epoch_batches

    rng = np.random.default_rng(3)
    lengths = {s: int(n) for s, n in enumerate(rng.integers(8, 400, 300))}
    plan = TrainPlan(batch_tokens=1024)
    counts = [len(epoch_batches(lengths, plan.batch_tokens, plan.seed, e)) for e in range(4)]
    assert len(set(counts)) > 1, counts  # the case this test is for
    stream, first = BatchStream(lengths, plan), 0
    for count in counts:
        seen = [s for step in range(first, first + count) for s in stream[step]]
        assert sorted(seen) == sorted(lengths)
        first += count
