"""The target's kernel for a prompt's rows (a forward of several tokens with last_only, as the runtime feeds
prompts): its products match numpy's and equal the step kernel's bit for bit (the same summation order per output),
so a prompt's KV is the same however it is chunked or fed, token by token included."""
from __future__ import annotations

import numpy as np
import pytest

from specdec.native import build
from specdec.blocks import BLOCK4, BLOCK8
from specdec.runtime.native_backend import NativeBackend

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")


@pytest.fixture(scope="module")
def target(grid_bundle):
    from specdec.manifest import read_manifest

    backend = NativeBackend(grid_bundle, read_manifest(grid_bundle).target, 2).open()
    yield backend
    backend.close()


def _blocks(kind, n, nb, rng):
    if kind == "q8":
        blocks = np.zeros((n, nb), BLOCK8)
        blocks["d"], blocks["qs"] = rng.uniform(1e-3, 2e-2, (n, nb)), rng.integers(-127, 128, (n, nb, 32))
        return blocks, blocks["d"][..., None] * blocks["qs"]
    blocks = np.zeros((n, nb), BLOCK4)
    blocks["d"], blocks["m"] = rng.uniform(1e-3, 2e-2, (n, nb)), rng.uniform(-0.1, 0.0, (n, nb))
    blocks["qs"] = rng.integers(0, 256, (n, nb, 16))
    codes = np.concatenate([blocks["qs"] & 15, blocks["qs"] >> 4], axis=-1).astype(np.float64)
    return blocks, blocks["d"][..., None].astype(np.float64) * codes + blocks["m"][..., None]


@pytest.mark.parametrize("kind", ["q41", "q8"])
def test_prompt_products_match_numpy(target, kind):
    """Rows in tiles of 2 and a rest, columns in tiles of 3 within tasks of 24 and a rest, K one block or several."""
    rng = np.random.default_rng(3)
    for rows, columns, nb in ((1, 5, 1), (4, 24, 2), (5, 37, 3), (13, 50, 18), (9, 3, 48)):
        blocks, weights = _blocks(kind, columns, nb, rng)
        x = rng.normal(0, 2, (rows, nb * 32)).astype(np.float32)
        want = x.astype(np.float64) @ weights.reshape(columns, -1).T
        got = target.model.matmul(x, blocks, "prompt", threads=2)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
        assert np.array_equal(got, target.model.matmul(x, blocks))  # the step kernel: the same sums, in the same order


def test_chunking_never_changes_a_prompts_rows(target):
    """A prompt fed whole or in pieces of two tokens or more: the same KV and last logits, bit for bit. A piece of
    one token is a step's forward and keeps the step kernel, last_only or not."""
    ids = np.random.default_rng(4).integers(3, target.vocab_size, (1, 23))
    target.reset(2)
    whole = target.forward(ids, np.array([0]), last_only=True, slots=np.array([0]))
    start = 0
    for stop in (5, 7, 23):
        pieces = target.forward(ids[:, start:stop], np.array([start]), last_only=True, slots=np.array([1]))
        start = stop
    assert np.array_equal(whole, pieces)
    model = target.model
    assert np.array_equal(model.keys[:, 0, :, :23], model.keys[:, 1, :, :23])
    assert np.array_equal(model.values[:, 0, :, :23], model.values[:, 1, :, :23])
    one = ids[:, 22:]
    assert np.array_equal(target.forward(one, np.array([22]), last_only=True, slots=np.array([0])),
                          target.forward(one, np.array([22]), slots=np.array([1])))


def test_prompt_kv_equals_the_step_kernels(target):
    """The same positions through the step kernel (every row scored), and one token at a time: the same KV."""
    ids = np.random.default_rng(5).integers(3, target.vocab_size, (1, 20))
    target.reset(3)
    target.forward(ids, np.array([0]), last_only=True, slots=np.array([0]))
    target.forward(ids, np.array([0]), slots=np.array([1]))
    for at in range(20):
        target.forward(ids[:, at : at + 1], np.array([at]), slots=np.array([2]))
    for cache in (target.model.keys, target.model.values):
        assert np.array_equal(cache[:, 0, :, :20], cache[:, 1, :, :20])
        assert np.array_equal(cache[:, 0, :, :20], cache[:, 2, :, :20])


def test_tied_embedding_read_from_the_heads_blocks(target):
    """Where the head's Q8_0 blocks give the embedding exactly (tied weights, the default model), the kernels read
    its rows from them and no float32 copy is kept: the same KV and logits, bit for bit, as with the copy."""
    import dataclasses

    from specdec.native.model import NativeModel
    from specdec.blocks import head_holds, q8_rows

    weights = target.model.weights
    head = weights.head
    rebuilt = q8_rows(head)
    assert head_holds(head, rebuilt, rows=7)  # in pieces, the last one short
    nudged = rebuilt.copy()
    nudged[-1, -1] = np.nextafter(nudged[-1, -1], np.float32(np.inf))
    assert not head_holds(head, nudged, rows=7) and not head_holds(head, rebuilt[:, :32])
    ids = np.random.default_rng(6).integers(3, target.vocab_size, 12)
    runs = []
    for embedding in (rebuilt, None):
        model = NativeModel(dataclasses.replace(weights, embedding=embedding), target.model.dims, target.model.kernels,
                            target.max_seq_len)
        model.reset(1)
        one = np.array([0])
        runs.append([model.forward(ids[None, :8], one, one, last_only=True), model.forward(ids[None, 8:9], one + 8, one),
                     model.forward(ids[None, 9:], one + 9, one), model.keys[:, 0, :, :12].copy()])
    for ours, theirs in zip(*runs):
        assert np.array_equal(ours, theirs)
