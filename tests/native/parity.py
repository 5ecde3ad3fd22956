"""The checks every native layout and family passes against onnxruntime (test_rows, test_q80, test_families)."""
from __future__ import annotations

import numpy as np

from specdec import GenerationConfig
from specdec.manifest import read_manifest
from specdec.runtime import load
from specdec.runtime.backend import unwrapped
from specdec.runtime.native_backend import NativeBackend
from specdec.runtime.ort_backend import OrtBackend

DRAFTER_CASES = [("model", 1), ("model", 4), ("auto", 3), ("prompt_lookup", 3)]  # (drafter, γ)
GREEDY_PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"
CHUNKS = ((0, 17), (17, 18), (18, 23), (23, 150), (150, 200))  # prefill, step, verify, chunks: 200 positions


def assert_logits_match_onnxruntime(bundle, positions: int = 200) -> None:
    """The native target's logits at `positions` positions, fed in CHUNKS (the last one running to `positions`),
    within 1e-4 of onnxruntime's largest and with the same argmax everywhere."""
    manifest = read_manifest(bundle)
    ids = np.random.default_rng(2).integers(3, 300, (1, positions))
    chunks = CHUNKS[:-1] + ((CHUNKS[-1][0], positions),)
    out = {}
    for cls in (NativeBackend, OrtBackend):
        backend = cls(bundle, manifest.target, 2).open()
        backend.reset(1)
        out[cls] = np.concatenate([backend.forward(ids[:, a:b], np.array([a]))[0] for a, b in chunks])
    native, ort = out[NativeBackend], out[OrtBackend]
    assert np.abs(native - ort).max() <= 1e-4 * np.abs(ort).max() and (native.argmax(-1) == ort.argmax(-1)).all()


def assert_sampling_matches_the_target(q41) -> None:
    """The native draft and target of `q41` sample from the target's distribution: χ² of the joint of the first
    NEW_TOKENS tokens against the exact one (tests/runtime/test_distribution.py), with enough drafts at positions 0-2."""
    from tests.runtime.test_distribution import NEW_TOKENS, PROMPT, TOP_K, exact_joint, p_value, sampled

    config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3, drafter="model", eos_token_ids=(), **TOP_K)
    with load(q41, backend="native") as gen:
        prompt_ids = gen.codec.encode(PROMPT)
        counts, (proposed, accepted) = sampled(gen, prompt_ids, config)
        assert proposed[2] > 100 and accepted[1] > 30, (proposed, accepted)
        assert p_value(exact_joint(gen, prompt_ids, config), counts) > 1e-3


def assert_greedy_identical_to_target_only(bundle, q41, drafter: str, gamma: int) -> None:
    """`load` (auto) opens native on `bundle` (onnxruntime's int4 draft) and on `q41` (a native int4-q41 draft), and
    each's greedy output with `drafter` equals the onnxruntime target's alone."""
    config = GenerationConfig(max_new_tokens=40, drafter=drafter, gamma=gamma)
    with load(bundle, backend="onnxruntime") as ort:
        reference = ort.generate(GREEDY_PROMPT, GenerationConfig(max_new_tokens=40, drafter="none")).token_ids
    for path, draft in ((q41, NativeBackend), (bundle, OrtBackend)):
        with load(path) as native:
            assert native.backend == "native" and isinstance(unwrapped(native.draft), draft)
            assert native.generate(GREEDY_PROMPT, config).token_ids == reference


def assert_same_bits_in_every_call(bundle, activations) -> np.ndarray:
    """A row's logits at positions 210..214 in an activations mode of the native target of `bundle`: one-token steps, a
    5-token verify pass, a prompt chunk's last position, and a batch of 4 rows at other lengths in other slots, each
    the same bits, on 1 and 2 threads alike. Returns those logits [5, V]."""
    ids = np.random.default_rng(12).integers(3, 300, (4, 240))
    runs = []
    for threads in (1, 2):
        backend = NativeBackend(bundle, read_manifest(bundle).target, threads, activations=activations).open()
        backend.reset(4)
        assert backend.model.activations is activations
        backend.forward(ids[:1, :210], np.array([0]), last_only=True, slots=np.array([0]))
        steps = np.stack([backend.forward(ids[:1, p : p + 1], np.array([p]), slots=np.array([0]))[0, 0]
                          for p in range(210, 215)])
        verify = backend.forward(ids[:1, 210:215], np.array([210]), slots=np.array([0]))[0]
        chunk = backend.forward(ids[:1, 150:215], np.array([150]), last_only=True, slots=np.array([0]))[0, 0]
        assert np.array_equal(verify, steps) and np.array_equal(chunk, steps[-1])
        lengths = [37, 9, 140]
        for slot, length in zip((1, 2, 3), lengths):
            backend.forward(ids[slot : slot + 1, :length], np.array([0]), last_only=True, slots=np.array([slot]))
        tokens = np.stack([ids[0, 210:215]] + [ids[s, n : n + 5] for s, n in zip((1, 2, 3), lengths)])
        batch = backend.forward(tokens, np.array([210, *lengths]), slots=np.array([0, 1, 2, 3]))
        assert np.array_equal(batch[0], steps)
        runs.append(steps)
    assert np.array_equal(*runs)
    return runs[0]
