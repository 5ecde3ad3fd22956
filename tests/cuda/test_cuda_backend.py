"""The cuda backend's orchestration on the numpy reference kernels (the GPU's numerics are the device check's): logits
of prefill, verify and step calls against the CPU native engine on the same weights (Q4_1 blocks and bf16 rows);
greedy output of every drafter and γ identical to onnxruntime's target-only, with graphs and without; the sampled
output's distribution; one graph captured per call shape, replayed after, recaptured when the KV moves; logits kept
on the device until read, and copied before a later call replaces them; the draft on its target's KV; refusals
with their hints (no CuPy, memory, a closed backend) and auto's choice on a machine without a GPU."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from specdec.cuda.logits import DeviceLogits
from specdec.cuda.reference import ReferenceKernels
from specdec.errors import BackendError, CapacityError, MissingDependencyError
from specdec.manifest import read_manifest
from specdec.native import build
from specdec.runtime import GenerationConfig, load
from specdec.runtime.backend import unwrapped
from specdec.runtime.cuda_backend import CudaBackend, CudaOptions
from specdec.runtime.generator import load_cuda
from specdec.runtime.native_backend import NativeBackend
from tests.cuda.conftest import reference
from tests.runtime.test_distribution import NEW_TOKENS, PROMPT, TOP_K, exact_joint, p_value, sampled

TOLERANCE = 1e-4  # of the largest |logit|: fp32 summation order (the native engine sums in another order)
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. The quick brown"
needs_native = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA, F16C")


def _open(bundle, graphs: bool = True) -> CudaBackend:
    return CudaBackend(bundle, read_manifest(bundle).target, CudaOptions(kernels=ReferenceKernels, graphs=graphs)).open()


@needs_native
@pytest.mark.parametrize("pair", ["q41_pair", "bf16_pair", "q80_pair"])
def test_logits_match_the_native_engine_call_by_call(pair, request):
    bundle = request.getfixturevalue(pair)
    cuda, native = _open(bundle), NativeBackend(bundle, read_manifest(bundle).target, 2).open()
    ids = np.random.default_rng(0).integers(3, native.vocab_size, (2, 60))
    cuda.reset(3)
    native.reset(3)
    # a prefill longer than the graphs' rows (cuBLAS's path), a step, a verify pass, a last-only chunk; two slots
    for start, stop, last_only in ((0, 30, False), (30, 31, False), (31, 36, False), (36, 60, True)):
        for slot, row in ((2, 0), (0, 1)):
            args = (ids[row : row + 1, start:stop], np.array([start]), last_only, np.array([slot]))
            got, want = cuda.forward(*args), native.forward(*args)
            assert isinstance(got, DeviceLogits) and got.shape == want.shape
            assert np.abs(np.asarray(got) - want).max() <= TOLERANCE * np.abs(want).max()
            assert np.array_equal(got.argmax(-1), want.argmax(-1))
    args = (np.array([[7], [9]]), np.array([60, 60]), False, np.array([0, 2]))  # two rows in one call
    got, want = np.asarray(cuda.forward(*args)), native.forward(*args)
    assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max()
    with pytest.raises(BackendError, match="token ids shaped"):
        cuda.forward(np.zeros((1, 0), np.int64), np.array([0]))


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("drafter,gamma", [("none", None), ("model", 1), ("model", 3), ("prompt_lookup", 3),
                                           ("auto", 3), ("model", 6)])
def test_greedy_identical_to_onnxruntime_target_only(q41_pair, drafter, gamma, graphs):
    with load(q41_pair, backend="onnxruntime") as ort:
        want = ort.generate(PROMPT_TEXT, GenerationConfig(max_new_tokens=40, drafter="none")).token_ids
    with reference(q41_pair, graphs) as gen:
        assert isinstance(unwrapped(gen.draft), CudaBackend) and gen.backend == "cuda"
        got = gen.generate(PROMPT_TEXT, GenerationConfig(max_new_tokens=40, drafter=drafter, gamma=gamma))
        assert got.token_ids == want and len(want) > 8
        if drafter in ("model", "auto"):
            assert got.stats.proposed > 0
        assert (unwrapped(gen.target).graphs.captures > 0) == graphs


def test_unfused_kernels_give_the_same_tokens(bf16_pair):
    config = GenerationConfig(max_new_tokens=32, drafter="model", gamma=3)
    with reference(bf16_pair) as fused:
        want = fused.generate(PROMPT_TEXT, config).token_ids
    with load_cuda(bf16_pair, CudaOptions(kernels=ReferenceKernels, fused=False)) as apart:
        assert not unwrapped(apart.target).model.fused
        assert apart.generate(PROMPT_TEXT, config).token_ids == want


def test_batched_requests_equal_each_alone(bf16_pair):
    prompts = [PROMPT_TEXT, "Once upon a time", "1 2 3 4 5 6 7 8"]
    config = GenerationConfig(max_new_tokens=24, drafter="model", gamma=3)
    with reference(bf16_pair) as gen:
        alone = [gen.generate(p, config).token_ids for p in prompts]
        together = [r.token_ids for r in gen.run(prompts, config)]
    assert together == alone


def test_sampling_matches_the_target_distribution(q41_pair):
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3, drafter="model", eos_token_ids=(), **TOP_K)
    with reference(q41_pair) as gen:
        prompt_ids = gen.codec.encode(PROMPT)
        counts, (proposed, accepted) = sampled(gen, prompt_ids, config)
        assert proposed[2] > 100 and accepted[1] > 30, (proposed, accepted)
        assert p_value(exact_joint(gen, prompt_ids, config), counts) > 1e-3


def test_one_graph_per_shape_captured_once_and_recaptured_when_the_kv_moves(q41_pair):
    backend = _open(q41_pair)
    backend.reset(2)
    step = np.array([[5]])
    for position in range(4):
        backend.forward(step, np.array([position]), last_only=True)
    assert (backend.graphs.captures, backend.graphs.replays) == (1, 3)
    backend.forward(np.array([[5, 6, 7]]), np.array([4]))  # a verify pass: its own shape
    backend.forward(np.array([[5, 6, 7]]), np.array([7]), last_only=True)  # last-only: another
    backend.forward(np.array([[5], [6]]), np.array([10, 0]), slots=np.array([0, 1]))  # two rows: another
    assert backend.graphs.captures == 4 and set(backend.graphs.graphs) == {
        (1, 1, True), (1, 3, False), (1, 3, True), (2, 1, False)}
    backend.reset(2)  # the same buffers: graphs stay
    backend.forward(step, np.array([0]), last_only=True)
    assert backend.graphs.captures == 4
    backend.reset(3)  # new KV buffers: every graph is captured again
    backend.forward(step, np.array([0]), last_only=True)
    assert backend.graphs.captures == 5 and len(backend.graphs.graphs) == 1
    prefill = backend.forward(np.full((1, 40), 5), np.array([0]))  # 40 rows > 4 slots x 7: eager, no graph
    assert backend.graphs.captures == 5 and prefill.shape[1] == 40


def test_a_replayed_graph_reads_the_new_inputs(q41_pair):
    """Same shape, other tokens, positions and slot: the replay gives what a fresh eager backend gives."""
    graphed, eager = _open(q41_pair), _open(q41_pair, graphs=False)
    for backend in (graphed, eager):
        backend.reset(2)
        backend.forward(np.array([[3, 4, 5, 6]]), np.array([0]), slots=np.array([1]))
        backend.forward(np.array([[9, 8]]), np.array([0]), slots=np.array([0]))
    calls = [((np.array([[11]]), np.array([4]), True, np.array([1])), (np.array([[12]]), np.array([2]), True,
                                                                        np.array([0])))]
    for first, second in calls:
        a = [np.asarray(b.forward(*first)) for b in (graphed, eager)]
        b = [np.asarray(x.forward(*second)) for x in (graphed, eager)]
        assert np.array_equal(a[0], a[1]) and np.array_equal(b[0], b[1]) and not np.array_equal(a[0], b[0])
    assert graphed.graphs.replays == 1


def test_logits_stay_on_the_device_until_read_and_survive_the_next_call(q41_pair):
    backend = _open(q41_pair)
    backend.reset(1)
    first = backend.forward(np.array([[3, 4, 5]]), np.array([0]))
    assert first.result.host is None  # nothing read yet
    ids = first.argmax(-1)  # answered from the ids that came back with the call
    assert first.result.host is None and ids.shape == (1, 3)
    view = first[0, 1:]
    workspace = first.result.logits
    backend.forward(np.array([[6]]), np.array([3]))  # reuses the workspace: the held logits are copied aside first
    assert first.result.host is None and first.result.logits is not workspace
    fresh = _open(q41_pair)
    fresh.reset(1)
    assert np.array_equal(np.asarray(view), np.asarray(fresh.forward(np.array([[3, 4, 5]]), np.array([0])))[0, 1:])
    assert np.array_equal(view.argmax(-1), np.asarray(view).argmax(-1)) and int(first[0, 2].argmax()) == ids[0, 2]


def test_a_trimmed_draft_head_gives_whole_vocabulary_logits(q41_pair):
    with reference(q41_pair) as gen:
        target, draft = unwrapped(gen.target), unwrapped(gen.draft)
        assert draft.takes_kv_from(gen.target) and draft.model.keys is None  # the target's KV, shared
        target.reset(1)
        draft.reset(1)
        target.forward(np.array([[3, 4, 5]]), np.array([0]))
        logits = draft.forward(np.array([[6]]), np.array([3]), last_only=True)
        host = np.asarray(logits)
        rows = draft.model.draft.head_rows
        assert host.shape == (1, 1, target.vocab_size) and len(rows) < target.vocab_size
        assert (np.delete(host[0, 0], rows) == draft.model.draft.fill).all()
        assert int(logits[0, 0].argmax()) == int(host[0, 0].argmax()) and host[0, 0].argmax() in rows


def test_refusals_say_what_and_how(q41_pair, monkeypatch):
    class SmallGpu(ReferenceKernels):
        def free_bytes(self):
            return 64 << 20

    manifest = read_manifest(q41_pair)
    with pytest.raises(CapacityError, match="MiB of GPU memory") as caught:
        CudaBackend(q41_pair, manifest.target, CudaOptions(kernels=SmallGpu)).open()
    assert "--max-batch" in caught.value.hint
    closed = _open(q41_pair)
    closed.close()
    with pytest.raises(BackendError, match="closed"):
        closed.reset(1)
    backend = _open(q41_pair)
    backend.reset(1)
    with pytest.raises(BackendError, match="outside the weights' vocabulary"):
        backend.forward(np.array([[backend.vocab_size]]), np.array([0]))
    with pytest.raises(BackendError, match="not a GPU index"):
        CudaOptions(device=-1)
    monkeypatch.setitem(sys.modules, "cupy", None)  # CuPy not installed
    with pytest.raises(MissingDependencyError, match="CuPy") as caught:
        load(q41_pair, backend="cuda")
    assert "specdec[cuda]" in caught.value.hint


def test_auto_opens_a_cpu_backend_without_a_gpu_and_says_why(q41_pair, monkeypatch):
    from specdec.runtime import registry

    monkeypatch.setitem(sys.modules, "cupy", None)
    registry._warn_once.cache_clear()
    with load(q41_pair) as gen:  # no device named: no GPU here, so the CPU without a word
        assert gen.backend in ("native", "onnxruntime") and "cuda" not in (gen.backend_note or "")
    with load(q41_pair, device="cuda:0") as gen:  # a GPU asked for: the CPU, and why
        assert gen.backend in ("native", "onnxruntime") and "cuda backend did not open" in gen.backend_note
        assert "CuPy" in gen.backend_note


def test_the_cuda_runtime_imports_no_torch(q41_pair):
    code = ("import sys\nfrom specdec.runtime import GenerationConfig\nfrom specdec.runtime.generator import load_cuda\n"
            "from specdec.runtime.cuda_backend import CudaOptions\nfrom specdec.cuda.reference import ReferenceKernels\n"
            f"gen = load_cuda({str(q41_pair)!r}, CudaOptions(kernels=ReferenceKernels))\n"
            "print(len(gen.generate('Hello', GenerationConfig(max_new_tokens=4, drafter='model')).token_ids))\n"
            "import specdec.cuda.device\n"
            "assert not {'torch', 'transformers'} & set(sys.modules), sorted(m for m in sys.modules if 'torch' in m)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "4", done.stderr


def test_chained_draft_steps_equal_steps_one_by_one(q41_pair):
    """propose_greedy: γ draft steps in one graph, each step's argmax fed to the next on the device, choose what
    one-token forwards and their argmax choose, and leave the same K/V."""
    runs = []
    for chained in (True, False):
        with reference(q41_pair) as gen:
            target, draft = unwrapped(gen.target), unwrapped(gen.draft)
            target.reset(2)
            draft.reset(2)
            target.forward(np.array([[3, 4, 5, 6], [7, 8, 9, 10]]), np.array([0, 0]), slots=np.array([1, 0]))
            first = np.array([11, 12])
            if chained:
                chosen = draft.propose_greedy(first, np.array([4, 4]), np.array([1, 0]), 4)
                assert ("chain", 2, 4) in draft.graphs.graphs
            else:
                chosen, token = [], first
                for step in range(4):
                    token = draft.forward(token[:, None], np.array([4 + step] * 2), True, np.array([1, 0])).argmax(-1)[:, 0]
                    chosen.append(token)
                chosen = np.stack(chosen, axis=1)
            runs.append((chosen, target.model.keys.copy()))
    assert np.array_equal(runs[0][0], runs[1][0]) and np.array_equal(runs[0][1], runs[1][1])
    assert runs[0][0].shape == (2, 4)


def test_the_model_drafter_chains_its_greedy_steps(bf16_pair, monkeypatch):
    config = GenerationConfig(max_new_tokens=40, drafter="model", gamma=4)
    with reference(bf16_pair) as gen:
        chained = gen.generate(PROMPT_TEXT, config)
        keys = set(unwrapped(gen.draft).graphs.graphs)
    assert ("chain", 1, 3) in keys  # the catch-up feed of a round's pending tokens is a forward of its own
    monkeypatch.setattr(CudaBackend, "chains", lambda self, rows, steps: False)
    with reference(bf16_pair) as gen:
        stepped = gen.generate(PROMPT_TEXT, config)
        assert (1, 1, True) in unwrapped(gen.draft).graphs.graphs
    assert chained.token_ids == stepped.token_ids and chained.stats.accepted == stepped.stats.accepted
    assert chained.stats.proposed == stepped.stats.proposed > 0
