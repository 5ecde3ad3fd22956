"""The int8 activations mode of the native target (SPECDEC_ACT_INT8; linear_q8a.c): its kernel gives the bits of its
plain C reference for every kind it takes, shape and thread count; a row's logits are the same bits alone, in a verify
pass, at a prompt chunk's end and in a batch; speculative greedy output equals plain greedy output in the mode; and
`load(activations=...)` chooses it, refusing what cannot run it. The sanitizer run (make test-sanitize) runs it."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from specdec import GenerationConfig
from specdec.blocks import encode, float_rows
from specdec.errors import BackendError, ConfigError
from specdec.manifest import read_manifest
from specdec.native_record import Activations
from specdec.native import build
from specdec.runtime import load
from specdec.runtime.native_backend import NativeBackend
from specdec.weight_kinds import KERNELS, Kernel, WeightKind
from tests.bench.test_entry_points import read_record, run_script
from tests.native.parity import assert_same_bits_in_every_call

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")
KINDS = tuple(kind for kind in WeightKind if Kernel.Q8A in kind.kernels)  # what the int8 kernels take (the table)
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"


def product(x: np.ndarray, weights: np.ndarray, kind: WeightKind, kernel: Kernel, threads: int) -> np.ndarray:
    """y [M, N] of specdec_matmul, called raw (status 0 asserted)."""
    lib = build.load_kernels()
    y = np.full((len(x), len(weights)), np.nan, np.float32)
    need = lib.specdec_matmul_scratch_bytes(x.shape[0], x.shape[1], KERNELS[kernel], threads)
    scratch = np.empty(need, np.uint8)
    status = lib.specdec_matmul(x.ctypes.data, x.shape[0], x.shape[1], weights.ctypes.data, weights.shape[1],
                                int(kind), KERNELS[kernel], y.ctypes.data, len(weights), scratch.ctypes.data,
                                scratch.size, threads)
    assert status == 0, f"{kind.label} by {kernel}: status {status}"
    return y


def _activations(rng, m: int, k: int) -> np.ndarray:
    """x [M, K]: normal values, a block of zeros, a block far below the rest, a block with one large value, and
    (where there are rows and blocks enough) a block of one value and zeros, one whose largest |x| is there twice,
    and one of equal values."""
    x = rng.normal(0, 1, (m, k)).astype(np.float32)
    x[0, :32] = 0.0
    if m > 1:
        x[1, :32] *= 1e-20
    if m > 4 and k >= 64:
        x[2, 32:64] = np.where(np.arange(32) == 9, 3.0, 0.0)
        x[3, 33], x[3, 50] = 7.0, -7.0
        x[4, 32:64] = -0.5
    x[-1, -32:] *= np.where(np.arange(32) == 5, 1e4, 1.0).astype(np.float32)
    return x


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.label)
def test_the_kernel_gives_its_references_bits(kind, threads):
    rng = np.random.default_rng(int(kind) + 10 * threads)
    for m in (1, 5, 7, 64):
        for k, n in ((32, 16), (96, 37), (320, 50), (64, 129)):  # N not a multiple of 16 too
            weights = encode(kind, rng.normal(0, 0.1, (n, k)).astype(np.float32))
            x = _activations(rng, m, k)
            fast, reference = (product(x, weights, kind, kernel, threads) for kernel in (Kernel.Q8A, Kernel.Q8A_REF))
            assert np.array_equal(fast, reference), f"{kind.label} M={m} K={k} N={n} threads={threads}"
            want = x.astype(np.float64) @ float_rows(weights)[:, :k].T.astype(np.float64)
            scale = np.abs(x).reshape(m, -1, 32).max(-1).sum(-1, keepdims=True) * np.abs(float_rows(weights)).max()
            # each activation within 1/254 of its block's largest: 32/254 of it times the largest weight a block
            assert (np.abs(fast - want) <= (32 / 254 + 1e-4) * scale).all()


def rounded(x: np.ndarray) -> np.ndarray:
    """x [M, K] as the mode rounds it, per block of 32: the first of the largest |x| kept, the others
    d * round-to-nearest-even(x / d), d = their own largest |x| / 127."""
    blocks = x.astype(np.float64).reshape(len(x), -1, 32)
    largest = np.abs(blocks).argmax(-1)[..., None]  # the first of the largest
    kept = np.take_along_axis(blocks, largest, -1)
    rest = blocks.copy()
    np.put_along_axis(rest, largest, 0.0, -1)
    d = np.abs(rest).max(-1, keepdims=True) / 127
    out = np.rint(np.divide(rest, d, out=np.zeros_like(rest), where=d > 0)) * d
    np.put_along_axis(out, largest, kept, -1)
    return out.reshape(x.shape)


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.label)
def test_the_product_is_that_of_the_rounded_activations(kind):
    # The only error the mode may add is the activations' rounding: every term of a weight's value, Q4_1's minimum
    # included, meets the same rounded block, whose largest value is kept. (Q4_1's minimum once met the exact sum of
    # the unrounded block, which left m times the sum of the rounding errors in every output: 5x the mean KL from fp32
    # on the default bundle.)
    rng = np.random.default_rng(int(kind))
    weights = encode(kind, rng.normal(0, 0.1, (64, 576)).astype(np.float32))
    x = rng.normal(0, 1, (5, 576)).astype(np.float32)
    dense = float_rows(weights)[:, :576].astype(np.float64)
    want, unrounded = rounded(x) @ dense.T, x.astype(np.float64) @ dense.T
    for kernel in (Kernel.Q8A, Kernel.Q8A_REF):
        got = product(x, weights, kind, kernel, 1)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(unrounded).max(), f"{kind.label} by {kernel}"


def test_a_block_holding_nan_or_inf_gives_nan_not_a_guess():
    weights = encode(WeightKind.Q80, np.ones((16, 64), np.float32))
    x = np.ones((9, 64), np.float32)  # 9 rows: the rounding of several blocks at a time meets them too
    x[1, 40], x[4, 3], x[6, 63] = np.nan, np.inf, -np.inf
    for kernel in (Kernel.Q8A, Kernel.Q8A_REF):
        y = product(x, weights, WeightKind.Q80, kernel, 1)
        bad = np.isin(np.arange(9), (1, 4, 6))
        assert np.isfinite(y[~bad]).all() and np.isnan(y[bad]).all()


def _target(bundle, activations=Activations.INT8, threads: int = 2, slots: int = 4) -> NativeBackend:
    backend = NativeBackend(bundle, read_manifest(bundle).target, threads, activations=activations).open()
    backend.reset(slots)
    return backend


def test_a_rows_logits_are_the_same_bits_in_every_call(grid_bundle):
    """Alone, in a verify pass, at a prompt chunk's end and in a batch, on 1 and 2 threads (parity.py)."""
    assert_same_bits_in_every_call(grid_bundle, Activations.INT8)


def test_the_mode_is_on_and_near_fp32(grid_bundle):
    """The deliberately failing comparison: int8 logits are not fp32's bits (else the mode would be off), yet close."""
    ids = np.random.default_rng(3).integers(3, 300, (1, 40))
    out = {}
    for mode in (Activations.FP32, Activations.INT8):
        backend = _target(grid_bundle, mode, slots=1)
        assert backend.model.activations is mode
        out[mode] = backend.forward(ids, np.array([0]))[0]
    fp32, int8 = out[Activations.FP32], out[Activations.INT8]
    assert not np.array_equal(fp32, int8)
    assert np.abs(fp32 - int8).mean() <= 0.02 * np.abs(fp32).max()  # the tiny random model amplifies the rounding


@pytest.mark.parametrize(("drafter", "gamma"), [("model", 1), ("model", 3), ("model", 4), ("prompt_lookup", 3)])
def test_speculative_greedy_equals_plain_greedy_in_int8(q41_bundle, drafter, gamma):
    with load(q41_bundle, backend="native", activations="int8") as gen:
        assert gen.activations is Activations.INT8
        plain = gen.generate(PROMPT, GenerationConfig(max_new_tokens=40, drafter="none")).token_ids
        assert gen.generate(PROMPT, GenerationConfig(max_new_tokens=40, drafter=drafter, gamma=gamma)).token_ids \
            == plain


def test_load_chooses_the_mode_and_refuses_what_cannot_run_it(q41_bundle, off_grid_bundle, tmp_path):
    with pytest.raises(ConfigError, match="activations='int4' is not one of fp32, int8"):
        load(q41_bundle, activations="int4")
    with pytest.raises(ConfigError, match="runs on the native backend"):
        load(q41_bundle, backend="onnxruntime", activations="int8")
    with pytest.raises(BackendError, match="rows"):  # fp32 rows: nothing for int8 activations to multiply
        load(off_grid_bundle, backend="native", activations="int8")
    with load(q41_bundle, backend="native") as gen:
        assert gen.activations is Activations.FP32  # the bundle has no default: fp32
    copy = shutil.copytree(q41_bundle, tmp_path / "int8")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["defaults"]["activations"] = "int8"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with load(copy, backend="native") as gen:
        assert gen.activations is Activations.INT8
    with load(copy, backend="native", activations="fp32") as gen:
        assert gen.activations is Activations.FP32
    with load(copy, backend="onnxruntime") as gen:  # the bundle's default, where int8 cannot run: fp32
        assert gen.activations is Activations.FP32


def test_the_commands_take_activations(q41_bundle, capsys):
    from specdec.cli.main import main
    from specdec.serving.options import ServeOptions

    assert main(["generate", str(q41_bundle), "--prompt", "The quick", "--max-new-tokens", "4", "--backend", "native",
                 "--activations", "int8"]) == 0
    assert ", int8]" in capsys.readouterr().err
    assert main(["generate", str(q41_bundle), "--prompt", "The quick", "--backend", "onnxruntime", "--activations", "int8"]) == 1
    assert "runs on the native backend" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse's choices
        main(["generate", str(q41_bundle), "--prompt", "The quick", "--activations", "int4"])
    assert ServeOptions(bundle=str(q41_bundle), activations="int8").activations is Activations.INT8
    with pytest.raises(ConfigError, match="not one of fp32, int8"):
        ServeOptions(bundle=str(q41_bundle), activations="int4")


def test_the_fidelity_benchmark_compares_int8_with_fp32_teacher_forced(grid_bundle, tmp_path):
    """benchmarks/fidelity.py runs end to end and its record adds up; the mode moves the logits a little."""
    out = tmp_path / "fidelity"
    run_script("fidelity.py", grid_bundle, "--prompts", 3, "--positions", 8, "--out", out)
    record = read_record(out, "fidelity.py")
    figures = record["summary"]
    assert figures["prompts"] == 3 and figures["positions"] == 24
    assert 0.0 <= figures["top1_agreement"] <= 1.0 and figures["kl_mean"] > 0.0
    assert figures["disagreements"] == 24 - sum(p["agree"] for p in record["prompts"])


def test_the_demo_compares_an_int8_target_with_fp32_and_does_not_require_it_equal(q41_bundle, tmp_path):
    import subprocess
    import sys

    copy = shutil.copytree(q41_bundle, tmp_path / "int8")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["defaults"]["activations"] = "int8"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    demo = [sys.executable, "-m", "specdec.cli.demo", "--new-tokens", "8", "--repeats", "1", str(copy)]
    done = subprocess.run(demo, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "[onnxruntime] greedy" in done.stdout, done.stdout
    assert "[native, int8 activations] greedy" in done.stdout, done.stdout
    assert "prompts' outputs equal the onnxruntime backend's (fp32" in done.stdout, done.stdout


def test_export_records_the_default_activations(tmp_path):
    from specdec.export.config import ExportConfig
    from specdec.export.tiny import save_tiny_on_grids
    from tests.native.conftest import _gqa_export

    with pytest.raises(ConfigError, match="--activations 'int4' is not supported(.|\n)*Hint: choose one of fp32, int8"):
        ExportConfig(out=tmp_path / "x", activations="int4")
    model = save_tiny_on_grids(tmp_path / "grid", family="llama", seed=0, init_range=0.5, hidden=64)
    bundle = _gqa_export(tmp_path / "b", model, no_draft=True, activations="int8")
    assert read_manifest(bundle).defaults.activations == Activations.INT8
    with load(bundle, backend="native") as gen:
        assert gen.activations is Activations.INT8
    bundle = _gqa_export(tmp_path / "fp32", model, no_draft=True, activations="fp32")
    assert read_manifest(bundle).defaults.activations == Activations.FP32


def test_export_defaults_to_int8_where_the_native_weights_are_blocks(tmp_path, capsys):
    # unset: int8 for a GGUF's grids (blocks the int8 kernels take), bf16 for bf16 rows (run as fp32 where the CPU
    # lacks AMX-BF16), fp32 for f16 rows
    from specdec.cli import main as inspect_main
    from specdec.export.bundle import export_bundle
    from specdec.export.config import ExportConfig
    from specdec.export.tiny import save_tiny_in, save_tiny_on_grids

    options = dict(family="llama", seed=0, init_range=0.5, hidden=64)
    bf16_runs = build.kernel_runs(build.load_kernels(), Kernel.BF16A, WeightKind.BF16)
    for name, model, expected, runs in (
            ("grid", save_tiny_on_grids(tmp_path / "grid-hf", **options), Activations.INT8, Activations.INT8),
            ("bf16", save_tiny_in(tmp_path / "bf16-hf", "bfloat16", **options), Activations.BF16,
             Activations.BF16 if bf16_runs else Activations.FP32),
            ("f16", save_tiny_in(tmp_path / "f16-hf", "float16", **options), Activations.FP32, Activations.FP32)):
        bundle = export_bundle(ExportConfig(out=tmp_path / name, target=str(model), max_seq_len=64, gamma=3,
                                            gamma_max=6, max_prefill_chunk=16, progress=False, no_draft=True))
        assert read_manifest(bundle).defaults.activations == expected, name
        with load(bundle, backend="native") as gen:
            assert gen.activations is runs, name
        assert inspect_main(["inspect", str(bundle), "--no-verify"]) == 0
        assert f"native activations {expected}" in capsys.readouterr().out, name


def test_speculative_sampling_keeps_the_int8_targets_distribution(q41_bundle):
    """The chi-square test of tests/runtime/test_distribution.py with the target in int8 mode: sampled with the
    int4-q41 draft at γ = 3, the window of three tokens follows the int8 target's own (enumerated) distribution."""
    from tests.runtime.test_distribution import NEW_TOKENS, PROMPT, TOP_K, exact_joint, p_value, sampled

    with load(q41_bundle, backend="native", activations="int8") as gen:
        assert gen.activations is Activations.INT8
        # EOS ignored: the enumeration counts windows of every length in full (this model's EOS is in its top 3)
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3, drafter="model", eos_token_ids=(), **TOP_K)
        prompt_ids = gen.codec.encode(PROMPT)
        counts, (proposed, accepted) = sampled(gen, prompt_ids, config)
        assert proposed[2] > 100 and accepted[1] > 50, (proposed, accepted)
        assert p_value(exact_joint(gen, prompt_ids, config), counts) > 1e-3


def test_a_head_is_trained_on_the_states_of_the_bundles_default_mode(grid_bundle, tmp_path):
    """`specdec calibrate head` writes its data in the activations the head drafts from: the bundle's default, or
    --activations; the mode is recorded with the data, and the data differ between modes."""
    from specdec.cli.main import main

    copy = shutil.copytree(grid_bundle, tmp_path / "bundle")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["defaults"]["activations"] = "int8"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    tiny = ["--data-tokens", "30", "--max-new-tokens", "10", "--rows", "2", "--draft-vocab", "64", "--steps", "1",
            "--threads", "1"]
    features = {}
    for mode, extra in (("int8", []), ("fp32", ["--activations", "fp32"])):
        out = tmp_path / mode
        assert main(["calibrate", "head", str(copy), "--out", str(out), *tiny, *extra]) == 0
        work = out.with_name(f"{mode}.head-train")
        assert json.loads((work / "run.json").read_text())["summary"]["data"]["activations"] == mode
        features[mode] = np.load(sorted((work / "data").iterdir())[0] / "features.npy")
    first = features["fp32"][:8]  # the first prompt's positions: the same tokens, computed in each mode
    assert np.isfinite(first).all() and not np.array_equal(features["int8"][:8], first)
    gap = np.abs(features["int8"][:8].astype(np.float32) - first).max()
    assert gap <= 0.05 * np.abs(first).max(), gap  # near: int8 rounds, it does not guess
