"""The bf16 activations mode of the native target (SPECDEC_ACT_BF16; linear_bf16a.c): each row's activations rounded to
bf16 before every product with bf16 rows, multiplied on AMX-BF16 tiles. Its product is that of the rounded activations
(to fp32 accumulation); an output's bits do not depend on the rows, columns or threads beside it; a row's logits are
the same bits alone, in a verify pass, at a prompt chunk's end and in a batch; speculative greedy output equals plain
greedy output and sampling keeps the target's distribution in the mode; `load(activations="bf16")` refuses what cannot
run it. Where the CPU lacks AMX-BF16 the kernel's tests skip and the refusal is tested. The sanitizer run runs it."""
from __future__ import annotations

import numpy as np
import pytest

from specdec import GenerationConfig
from specdec.blocks import encode, float_rows
from specdec.errors import BackendError, ConfigError
from specdec.manifest import read_manifest
from specdec.native import build
from specdec.native_record import Activations
from specdec.runtime import load
from specdec.runtime.native_backend import NativeBackend
from specdec.weight_kinds import Isa, Kernel, WeightKind
from tests.native.parity import assert_same_bits_in_every_call
from tests.native.test_int8_activations import PROMPT, product

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")


def _runs() -> bool:
    return not build.missing_cpu_flags() and build.kernel_runs(build.load_kernels(), Kernel.BF16A, WeightKind.BF16)


amx = pytest.mark.skipif(not _runs(), reason="bf16 activations need AMX-BF16 (amx_bf16 and avx512_bf16)")


def bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to bf16 (to nearest, ties to even), as float64."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + (bits >> 16 & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


@amx
@pytest.mark.parametrize("threads", [1, 2])
def test_the_product_is_that_of_the_rounded_activations(threads):
    rng = np.random.default_rng(threads)
    for k, n in ((32, 16), (96, 37), (576, 50), (1536, 129)):  # N not a multiple of 16 or 32 too
        weights = encode(WeightKind.BF16, rng.normal(0, 0.1, (n, k)).astype(np.float32))
        dense = float_rows(weights)[:, :k].astype(np.float64)
        for m in (1, 5, 16, 17, 40):
            x = rng.normal(0, 1, (m, k)).astype(np.float32)
            got = product(x, weights, WeightKind.BF16, Kernel.BF16A, threads)
            want, unrounded = bf16(x) @ dense.T, x.astype(np.float64) @ dense.T
            bound = np.abs(bf16(x)) @ np.abs(dense).T  # the sum of the products' magnitudes
            assert (np.abs(got - want) <= 1e-6 * bound + 1e-30).all(), f"M={m} K={k} N={n}: fp32 accumulation"
            # the deliberately failing comparison: the activations were rounded (else the mode would be off)
            assert np.abs(got - unrounded).max() > 10 * np.abs(got - want).max(), f"M={m} K={k} N={n}"


@amx
def test_an_outputs_bits_do_not_depend_on_the_call():
    """Rows alone, in runs of 5 and 17 at other offsets, and the whole of 40; columns alone and in part; 1 and 2
    threads: the same bits for every output."""
    rng = np.random.default_rng(7)
    k, n = 576, 70
    weights = encode(WeightKind.BF16, rng.normal(0, 0.1, (n, k)).astype(np.float32))
    x = rng.normal(0, 1, (40, k)).astype(np.float32)
    whole = product(x, weights, WeightKind.BF16, Kernel.BF16A, 2)
    for threads in (1, 2):
        for m, at in ((1, 0), (1, 23), (5, 3), (17, 20), (40, 0)):
            part = product(x[at : at + m].copy(), weights, WeightKind.BF16, Kernel.BF16A, threads)
            assert np.array_equal(part, whole[at : at + m]), (m, at, threads)
    columns = product(x[:5].copy(), weights[33:40].copy(), WeightKind.BF16, Kernel.BF16A, 1)
    assert np.array_equal(columns, whole[:5, 33:40])


@amx
def test_a_row_holding_nan_or_inf_gives_nan_and_leaves_the_others():
    weights = encode(WeightKind.BF16, np.ones((20, 64), np.float32))
    x = np.ones((9, 64), np.float32)
    x[1, 40], x[4, 3], x[6, 63] = np.nan, np.inf, -np.inf
    y = product(x, weights, WeightKind.BF16, Kernel.BF16A, 1)
    bad = np.isin(np.arange(9), (1, 4, 6))
    assert (y[~bad] == 64.0).all() and np.isnan(y[1]).all() and (y[4] == np.inf).all() and (y[6] == -np.inf).all()


@pytest.fixture(scope="module")
def bf16_bundle(tmp_path_factory):
    """(a tiny LLaMA saved in bf16, exported (the native engine holds bf16 rows); the same with its int4-q41 draft)"""
    from specdec.export.tiny import save_tiny_in
    from tests.native.conftest import with_q41

    model = save_tiny_in(tmp_path_factory.mktemp("bf16"), "bfloat16", family="llama", seed=0, init_range=0.5,
                         hidden=64)
    return with_q41(tmp_path_factory, "bf16", model)


@amx
def test_a_rows_logits_are_the_same_bits_in_every_call(bf16_bundle):
    """Alone, in a verify pass, at a prompt chunk's end and in a batch, on 1 and 2 threads (parity.py). And the mode is
    on: not fp32's logits, yet close."""
    steps = assert_same_bits_in_every_call(bf16_bundle[0], Activations.BF16)
    ids = np.random.default_rng(12).integers(3, 300, (4, 240))  # parity.py's ids
    fp32 = NativeBackend(bf16_bundle[0], read_manifest(bf16_bundle[0]).target, 2).open()  # fp32 activations
    fp32.reset(1)
    fp32.forward(ids[:1, :210], np.array([0]), last_only=True, slots=np.array([0]))
    reference = fp32.forward(ids[:1, 210:215], np.array([210]), slots=np.array([0]))[0]
    assert not np.array_equal(reference, steps)
    assert np.abs(reference - steps).mean() <= 0.02 * np.abs(reference).max()


@amx
@pytest.mark.parametrize(("drafter", "gamma"), [("model", 1), ("model", 3), ("model", 5), ("prompt_lookup", 3)])
def test_speculative_greedy_equals_plain_greedy_in_bf16(bf16_bundle, drafter, gamma):
    with load(bf16_bundle[1], backend="native", activations="bf16") as gen:
        assert gen.activations is Activations.BF16
        plain = gen.generate(PROMPT, GenerationConfig(max_new_tokens=40, drafter="none")).token_ids
        assert gen.generate(PROMPT, GenerationConfig(max_new_tokens=40, drafter=drafter, gamma=gamma)).token_ids \
            == plain


@amx
def test_speculative_sampling_keeps_the_bf16_targets_distribution(bf16_bundle):
    """The chi-square test of tests/runtime/test_distribution.py with the target in bf16 mode."""
    from tests.runtime.test_distribution import NEW_TOKENS, PROMPT as SAMPLED, TOP_K, exact_joint, p_value, sampled

    with load(bf16_bundle[1], backend="native", activations="bf16") as gen:
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3, drafter="model", eos_token_ids=(), **TOP_K)
        prompt_ids = gen.codec.encode(SAMPLED)
        counts, (proposed, accepted) = sampled(gen, prompt_ids, config)
        assert proposed[2] > 100 and accepted[1] > 30, (proposed, accepted)
        assert p_value(exact_joint(gen, prompt_ids, config), counts) > 1e-3


def test_load_refuses_what_cannot_run_bf16(bf16_bundle, q41_bundle):
    with pytest.raises(BackendError, match="multiply bf16 rows, and this target holds q41"):
        load(q41_bundle, backend="native", activations="bf16")
    with pytest.raises(ConfigError, match="activations='bf16' runs on the native backend"):
        load(bf16_bundle[0], backend="onnxruntime", activations="bf16")
    with pytest.raises(BackendError, match="AMX-BF16 tiles, which this CPU or build lacks"):  # the AVX2 build has none
        load(bf16_bundle[0], backend="native", activations="bf16", isa=Isa.AVX2)
    if not _runs():
        with pytest.raises(BackendError, match="AMX-BF16 tiles"):
            load(bf16_bundle[0], backend="native", activations="bf16")


def test_a_bundles_bf16_default_runs_fp32_where_the_tiles_are_missing(bf16_bundle, tmp_path):
    import json
    import logging
    import shutil

    from specdec.runtime import registry

    copy = shutil.copytree(bf16_bundle[0], tmp_path / "bf16")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["defaults"]["activations"] = "bf16"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger(registry.__name__).addHandler(handler)
    registry._warn_once.cache_clear()
    try:
        with load(copy, backend="native", isa=Isa.AVX2) as gen:  # the AVX2 build has no AMX kernel: fp32, warned
            assert gen.activations is Activations.FP32
    finally:
        logging.getLogger(registry.__name__).removeHandler(handler)
    assert any("need AMX-BF16 tiles" in message for message in seen), seen
    with load(copy, backend="native") as gen:
        assert gen.activations is (Activations.BF16 if _runs() else Activations.FP32)
