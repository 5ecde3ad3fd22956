"""drafter="head" keeps greedy output identical to target-only output, token for token, for γ = 1..7, on the native
engine (the head's products on Q8_0 blocks) and on onnxruntime (a graph exported with --feature-layers head; the
head in fp32 numpy): with a head of random weights over a trimmed vocabulary (its drafts rejected), and with a head
built to be accepted (so accepted drafts, their catch-up and the chain's rollback run too)."""
from __future__ import annotations

import pytest

import specdec
from specdec import GenerationConfig
from specdec.native import build
from tests.runtime.test_exactness import PROMPTS

BACKENDS = ["native", "onnxruntime"]
GAMMAS = range(1, 8)
NEW_TOKENS = 24


def _backend_or_skip(backend: str) -> str:
    if backend == "native" and build.missing_cpu_flags():
        pytest.skip("the native kernels need AVX2, FMA, F16C")
    return backend


def _plain(gen, prompt) -> list:
    return gen.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="none")).token_ids


def _check_equality(gen, prompts) -> tuple[int, int]:
    """Greedy drafter="head" output equals target-only for every prompt and γ; -> (proposed, accepted) in all."""
    proposed = accepted = 0
    for prompt in prompts:
        expected = _plain(gen, prompt)
        for gamma in GAMMAS:
            result = gen.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="head", gamma=gamma))
            assert result.token_ids == expected, (prompt, gamma)
            proposed += result.stats.proposed
            accepted += result.stats.accepted
    return proposed, accepted


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_equality_with_a_random_head(random_head_bundle, backend):
    with specdec.load(random_head_bundle, backend=_backend_or_skip(backend)) as gen:
        assert gen.backend == backend
        proposed, accepted = _check_equality(gen, PROMPTS[:8])
    assert proposed > 1000 and proposed - accepted > 1000  # drafted, and rolled back


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_equality_with_a_head_built_to_be_accepted(mirror_head_bundle, backend):
    with specdec.load(mirror_head_bundle, backend=_backend_or_skip(backend)) as gen:
        proposed, accepted = _check_equality(gen, PROMPTS[:8])
    # whole runs of drafts accepted (the prompts whose repeated token the head's vocabulary holds), others rejected
    assert accepted > 0.2 * proposed and proposed - accepted > 100, (proposed, accepted)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_of_rows_drafting_with_the_head_equals_each_row_alone(random_head_bundle, mirror_head_bundle, backend):
    prompts = [PROMPTS[0], PROMPTS[16], PROMPTS[5]]  # ragged prompt lengths
    for bundle in (random_head_bundle, mirror_head_bundle):
        with specdec.load(bundle, backend=_backend_or_skip(backend)) as gen:
            for drafter in ("head", "none"):
                batch = gen.generate(prompts, GenerationConfig(max_new_tokens=NEW_TOKENS, drafter=drafter, gamma=4))
                assert [r.token_ids for r in batch] == [_plain(gen, p) for p in prompts], drafter


def test_a_stream_interrupted_by_another_request_drafts_the_same(mirror_head_bundle):
    """A stream whose models another request used meanwhile prefills again, and its head starts over from the
    target's features: the same tokens as alone."""
    with specdec.load(mirror_head_bundle) as gen:
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="head", gamma=3, temperature=0.8, seed=5)
        alone = gen.generate(PROMPTS[2], config).text
        stream = gen.stream(PROMPTS[2], config)
        pieces = [next(stream)]
        gen.generate(PROMPTS[0], GenerationConfig(max_new_tokens=8, drafter="head"))
        pieces += list(stream)
    assert "".join(pieces) == alone


def test_greedy_equality_beside_the_cuda_backend_on_its_numpy_references(mirror_head_bundle):
    """The cuda backend returns any layer's hidden states; the head runs in numpy beside it (here the backend's
    orchestration on the CPU references of its kernels)."""
    from specdec.cuda.reference import ReferenceKernels
    from specdec.runtime.cuda_backend import CudaOptions
    from specdec.runtime.generator import load_cuda

    with load_cuda(mirror_head_bundle, CudaOptions(kernels=ReferenceKernels)) as gen:
        proposed, accepted = _check_equality(gen, PROMPTS[:2])
    assert accepted > 0


def test_a_greedy_draft_is_the_argmax_over_the_target_vocabulary_ties_included():
    """Where the draft rows are in target-id order, a greedy draft is taken over the draft vocabulary alone: the same
    token as the argmax of to_target's [V] logits (the first of ties); other orders build the [V] logits."""
    from types import SimpleNamespace

    import numpy as np

    from specdec.runtime.head_drafter import HeadDrafter

    def head_of(ids):
        def to_target(logits):
            full = np.full(20, -np.inf, np.float32)
            full[ids] = logits
            return full
        return SimpleNamespace(draft_ids=np.asarray(ids), to_target=to_target)

    row = SimpleNamespace(config=GenerationConfig(temperature=0.0))
    for ids in ([1, 4, 6, 9, 15], [9, 1, 15, 4, 6]):
        drafter = HeadDrafter(head_of(ids), chunk=16)
        assert drafter.ascending == (ids == sorted(ids))
        for logits in ([0.5, 2.0, -1.0, 2.0, 0.0], [3.0, 1.0, 3.0, 3.0, -2.0], [-5.0, -4.0, -3.0, -2.0, -1.0]):
            logits = np.asarray(logits, np.float32)
            expected = int(np.argmax(head_of(ids).to_target(logits)))
            assert drafter._choose(logits, row, 0) == (expected, None), (ids, logits)
