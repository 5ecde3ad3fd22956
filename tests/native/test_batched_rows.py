"""One native call serves several rows, each at its own cache length and slot, and every row gets the bits it gets
alone; a verify pass gives each position the bits one-token steps give it; 1 and 2 threads agree bit for bit; and
greedy requests batched together produce what each produces alone."""
from __future__ import annotations

import numpy as np
import pytest

from specdec import GenerationConfig
from specdec.manifest import read_manifest
from specdec.native import build
from specdec.runtime import load
from specdec.runtime.native_backend import NativeBackend

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")


def _target(bundle, threads: int) -> NativeBackend:
    backend = NativeBackend(bundle, read_manifest(bundle).target, threads).open()
    backend.reset(4)
    return backend


def _prefill(backend, ids: np.ndarray, lengths: list) -> None:
    for slot, length in enumerate(lengths):
        backend.forward(ids[slot : slot + 1, :length], np.array([0]), last_only=True, slots=np.array([slot]))


@pytest.mark.parametrize("bundle", ["grid_bundle", "gpt2_bundle"])  # GPT-2: each row's own learned positions
@pytest.mark.parametrize("steps", [1, 4])
def test_batched_rows_equal_rows_alone(request, bundle, steps):
    """Rows at cache lengths 140, 37, 200 and 9 in slots 2, 0, 3, 1 in one call (T = 1: steps; T = 4: verify)."""
    grid_bundle = request.getfixturevalue(bundle)
    ids = np.random.default_rng(11).integers(3, 300, (4, 240))
    lengths, order = [37, 9, 140, 200], np.array([2, 0, 3, 1])
    batched, alone = _target(grid_bundle, 2), _target(grid_bundle, 2)
    _prefill(batched, ids, lengths)
    _prefill(alone, ids, lengths)
    starts = np.array([lengths[s] for s in order])
    tokens = np.stack([ids[s, lengths[s] : lengths[s] + steps] for s in order])
    together = batched.forward(tokens, starts, slots=order)
    for row, slot in enumerate(order):
        one = alone.forward(tokens[row : row + 1], starts[row : row + 1], slots=np.array([slot]))[0]
        assert np.array_equal(together[row], one)
    assert np.array_equal(batched.model.keys, alone.model.keys)


@pytest.mark.parametrize("bundle", ["grid_bundle", "gpt2_bundle"])
def test_verify_pass_equals_steps_and_threads_agree(request, bundle):
    """Past 128 cached positions, where keys come in several chunks: a 5-token pass against five one-token steps, on
    1 and 2 threads."""
    grid_bundle = request.getfixturevalue(bundle)
    ids = np.random.default_rng(12).integers(3, 300, (1, 220))
    runs = []
    for threads in (1, 2):
        backend = _target(grid_bundle, threads)
        _prefill(backend, ids, [210])
        verify = backend.forward(ids[:, 210:215], np.array([210]))[0]
        backend.forward(ids[:, :210], np.array([0]), last_only=True, slots=np.array([1]))
        steps = np.stack([backend.forward(ids[:, p : p + 1], np.array([p]), slots=np.array([1]))[0, 0]
                          for p in range(210, 215)])
        assert np.array_equal(verify, steps)
        runs.append(verify)
    assert np.array_equal(*runs)


def test_greedy_batch_equals_requests_alone(q41_bundle):
    prompts = ["The quick brown fox", "Once upon a time there was", "A cache holds", "Speculative decoding is"]
    for drafter in ("none", "model"):
        config = GenerationConfig(max_new_tokens=24, drafter=drafter, gamma=3)
        with load(q41_bundle, backend="native") as gen:
            together = [r.token_ids for r in gen.generate(prompts, config)]
            alone = [gen.generate(prompt, config).token_ids for prompt in prompts]
        assert together == alone, drafter
