"""Targets from a K-quant GGUF (Q4_K_M, Q5_K_M): each linear weight keeps the blocks of its own grid (layout "mixed"):
Q4_K and Q4_1 values as blk4, Q5_0, Q5_1 and Q5_K's as blk5, Q8_0's as blk8, Q6_K's (a scale per 16) as blk6, so the
native target computes the fp32 graph's function while reading 6 to 10 bits a weight. The tiny model here mixes the
grids the way llama.cpp's Q4_K_M mix does on a model whose rows are too short for K-quants (q/k Q5_0 beside v Q8_0)
and reaches every kind (tiny.py's _mixed_grid). Logits against onnxruntime over 320 positions, greedy equality for
every drafter, the sampled output's distribution, the products against numpy, and the fitters on their own."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from specdec.blocks import BLOCK4, BLOCK5, BLOCK6, BLOCK8, GridError, float_gcd, float_rows, mixed_blocks
from specdec.weights_file import FORMAT_VERSION, MAGIC, TensorEntry, check_format, read_tensors
from specdec.cuda.reference import ReferenceKernels
from specdec.errors import BackendError
from specdec.manifest import read_manifest
from specdec.native import build
from specdec.runtime import load
from specdec.runtime.cuda_backend import CudaOptions
from specdec.runtime.generator import load_cuda
from specdec.runtime.native_backend import NativeBackend
from tests.native.conftest import with_q41
from tests.native.parity import (DRAFTER_CASES, assert_greedy_identical_to_target_only, assert_same_bits_in_every_call,
                                 assert_logits_match_onnxruntime, assert_sampling_matches_the_target)

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")


@pytest.fixture(scope="module")
def mixed_bundle(tmp_path_factory):
    """(a tiny LLaMA on a Q4_K_M-like mix of grids, exported with S = 384; the same with its native int4-q41 draft)"""
    from specdec.export.tiny import save_tiny_on_grids

    model = save_tiny_on_grids(tmp_path_factory.mktemp("mixed"), mixed=True, family="llama", seed=0, init_range=0.5,
                               hidden=64)  # head size 16: the fused rotary of the packed gqa graph
    return with_q41(tmp_path_factory, "mixed", model, max_seq_len=384)


def test_layout_keeps_each_weights_blocks(mixed_bundle):
    bundle, q41 = mixed_bundle
    native = read_manifest(bundle).target.native
    assert native.layout == "mixed"
    kinds = {name: spec["kind"] for name, spec in native.tensors.items()}
    assert [kinds.get(f"layers.{i}.{name}") for i in (0, 1) for name in ("qkv", "qkv_v", "o", "gate_up", "down")] == \
        ["blk5", "blk8", "blk5", "blk4", "blk5", "blk4", "blk6", "blk6", "blk4", "blk6"]  # q/k and v apart: fewer
    # bytes in layer 0 (Q5_0 as blk5 beside Q8_0), the only way in layer 1 (Q4_K beside Q6_K)
    assert kinds["head"] == "blk6" and "embedding" not in kinds  # a Q6_K output, tied: the embedding read from it
    weights = (bundle / native.path).stat().st_size
    assert weights < 0.35 * (bundle / "target" / "model.onnx.data").stat().st_size  # 6 to 10 bits a weight, not 32
    assert read_manifest(q41).draft.native.layout == "q41-draft"


def _q6_like(rng, n, k):
    d = rng.random((n, k // 16)).astype(np.float16).astype(np.float32) * np.float32(0.01)
    d = d.astype(np.float16).astype(np.float32)
    scales = d * rng.integers(-128, 128, (n, k // 16)).astype(np.float32)
    return (scales[..., None] * rng.integers(-32, 32, (n, k // 16, 16)).astype(np.float32)).reshape(n, k)


def test_fitters_recover_each_grid_exactly():
    rng = np.random.default_rng(3)
    q6 = _q6_like(rng, 40, 96)
    blocks = mixed_blocks("q6", q6)
    assert blocks.dtype == BLOCK6 and np.array_equal(float_rows(blocks), q6)
    d = rng.random((40, 3)).astype(np.float16).astype(np.float32)
    q8 = (d[..., None] * rng.integers(-127, 128, (40, 3, 32)).astype(np.float32)).reshape(40, 96)
    blocks = mixed_blocks("q8", q8)
    assert blocks.dtype == BLOCK8 and np.array_equal(float_rows(blocks), q8)
    q5 = (d[..., None] * rng.integers(-16, 16, (40, 3, 32)).astype(np.float32)).reshape(40, 96)  # Q5_0: d·(q − 16)
    blocks = mixed_blocks("q5", q5)
    assert blocks.dtype == BLOCK5 and np.abs(float_rows(blocks) - q5).max() <= 1e-5 * np.abs(q5).max()
    step, low = (d * np.float32(7)).astype(np.float32), -d
    codes = rng.integers(3, 13, (40, 3, 32)).astype(np.float32)  # codes that reach neither 0 nor 15 (Q4_K's can)
    q4 = (step[..., None] * codes + low[..., None]).astype(np.float32).reshape(40, 96)
    blocks = mixed_blocks("q4", q4)
    assert blocks.dtype == BLOCK4
    assert np.abs(float_rows(blocks) - q4).max() <= 1e-5 * np.abs(q4).max()
    # values on no common grid: a bf16 checkpoint's, random floats
    for off in (rng.normal(0, 1, (40, 96)).astype(np.float32), q6 + np.float32(1e-3)):
        with pytest.raises(GridError, match="none of the grids"):
            mixed_blocks("off", off)
    off = rng.normal(0, 1, (4, 32)).astype(np.float32)  # dyadic: their gcd is a power of 2, far below 1/127 of them
    assert (float_gcd(off) < np.abs(off).max(-1) / 1e4).all()
    assert float_gcd(np.zeros((1, 32), np.float32))[0] == 0


def test_block_products_match_numpy(mixed_bundle):
    bundle, _ = mixed_bundle
    model = NativeBackend(bundle, read_manifest(bundle).target, 2).open().model
    rng = np.random.default_rng(1)
    for (rows, columns, k), grid in zip(((1, 5, 32), (5, 37, 96), (9, 50, 576), (3, 21, 160), (8, 40, 64)),
                                        ("q6", "q6", "q6", "q5", "q5")):
        if grid == "q5":  # 5-bit codes with a minimum (Q5_1)
            w = rng.integers(0, 32, (columns, k)).astype(np.float32) * np.float32(0.01) - np.float32(0.1)
            blocks = mixed_blocks("q5", w)
            assert blocks.dtype == BLOCK5
        else:
            blocks = mixed_blocks("q6", _q6_like(rng, columns, k))
        weight = float_rows(blocks)
        x = rng.normal(0, 2, (rows, k)).astype(np.float32)
        want = x.astype(np.float64) @ weight.T.astype(np.float64)
        for kernel in ("step", "prompt"):
            got = model.matmul(x, blocks, kernel, threads=2)
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), kernel
        # a row's result does not depend on the rows beside it, nor on the kernel
        assert np.array_equal(model.matmul(x[:1], blocks, threads=1)[0], model.matmul(x, blocks, threads=2)[0])
        assert np.array_equal(model.matmul(x, blocks, "prompt", threads=2), model.matmul(x, blocks, threads=2))


def test_logits_match_onnxruntime_over_320_positions(mixed_bundle):
    bundle, _ = mixed_bundle
    assert_logits_match_onnxruntime(bundle, positions=320)


@pytest.mark.parametrize("drafter,gamma", DRAFTER_CASES)
def test_greedy_identical_to_target_only(mixed_bundle, drafter, gamma):
    bundle, q41 = mixed_bundle
    assert_greedy_identical_to_target_only(bundle, q41, drafter, gamma)


def test_sampling_matches_the_target_distribution(mixed_bundle):
    _, q41 = mixed_bundle
    assert_sampling_matches_the_target(q41)


def test_the_cuda_backend_refuses_mixed_blocks_and_auto_stays_native(mixed_bundle):
    from specdec.cuda.reference import ReferenceKernels
    from specdec.runtime.cuda_backend import CudaBackend, CudaOptions

    bundle, _ = mixed_bundle
    with pytest.raises(BackendError, match="K-quant GGUF's mixed blocks") as caught:
        CudaBackend(bundle, read_manifest(bundle).target, CudaOptions(kernels=ReferenceKernels)).open()
    assert "backend='native'" in caught.value.hint
    with load(bundle) as gen:
        assert gen.backend == "native"


def test_a_gguf_of_a_type_no_block_holds_is_named(tmp_path):
    """Where a GGUF's weights became rows, the note (the manifest's native_note, so gen.backend_note) names the
    types no native block holds; a file of kept types or a layout of blocks gets none."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from specdec.export.bundle import gguf_rows_note

    path = tmp_path / "mixed.gguf"
    writer = GGUFWriter(str(path), "llama")
    iq4 = np.zeros((4, 18), np.uint8)  # IQ4_NL: an fp16 scale and 16 bytes of codes per 32 weights
    writer.add_tensor("blk.0.attn_q.weight", iq4, raw_dtype=GGMLQuantizationType.IQ4_NL)
    writer.add_tensor("blk.0.attn_k.weight", np.zeros((4, 34), np.uint8), raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(32, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    note = gguf_rows_note(path, "f32")
    assert "IQ4_NL tensors fit no block" in note and "as f32 rows" in note and "Q8_0 tensors" not in note
    assert gguf_rows_note(path, "mixed") == ""


def test_weights_of_the_older_format_are_read_only_without_the_blocks_it_changed(mixed_bundle, tmp_path):
    """Format 3 changed blk5's layout alone, format 4 no block (it added the file's own table): a format-3 file and a
    format-2 file without blk5 read as they did; one with blk5, a format-1 file, or a bundle recording either, is
    refused with what changed, and the backend's hint says to re-export."""
    bundle, q41 = mixed_bundle
    assert FORMAT_VERSION == 4
    check_format(2, {"blk4", "blk8", "blk6", "f32"}, "w")
    check_format(3, {"blk4", "blk5", "blk8", "blk6", "f32"}, "w")
    with pytest.raises(ValueError, match="w holds native weights of format 2 with blk5 blocks, whose layout changed "
                       "in format 3"):
        check_format(2, {"blk4", "blk5"}, "w")
    with pytest.raises(ValueError, match="format 1, this specdec reads format 4"):
        check_format(1, {"blk4"}, "w")
    for source, role, readable in ((bundle, "target", False), (q41, "draft", True)):  # blk5 in it, or none
        record = getattr(read_manifest(source), role).native
        index = {name: TensorEntry(spec["kind"], tuple(spec["shape"]), int(spec["offset"]))
                 for name, spec in record.tensors.items()}
        older = tmp_path / f"{role}.bin"
        data = bytearray((source / record.path).read_bytes())
        data[len(MAGIC) : len(MAGIC) + 4] = np.array([2], "<u4").tobytes()
        older.write_bytes(bytes(data))
        if readable:
            got, now = read_tensors(older, index), read_tensors(source / record.path, index)
            assert all(np.array_equal(got[name].view(np.uint8), now[name].view(np.uint8)) for name in now)
        else:
            with pytest.raises(ValueError, match="format 2 with blk5 blocks"):
                read_tensors(older, index)
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["models"]["target"]["native"]["abi"] = 2
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BackendError, match=r"\(the target's\) holds native weights of format 2 with blk5") as caught:
        NativeBackend(copy, read_manifest(copy).target, 2).open()
    assert "re-export" in caught.value.hint


def test_a_manifest_that_reads_blk5_as_blk4_is_refused(mixed_bundle, tmp_path):
    """The file holds its own table: a manifest whose kind for a tensor differs (blk5's 28-byte blocks read as blk4's
    24, which fit inside the tensor's bytes and would pass every bound) is refused at open, and auto runs onnxruntime."""
    bundle = tmp_path / "b"
    shutil.copytree(mixed_bundle[0], bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    tensor = manifest["models"]["target"]["native"]["tensors"]["layers.0.qkv"]
    assert tensor["kind"] == "blk5"
    tensor["kind"] = "blk4"
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    message = "the manifest reads tensor layers.0.qkv as blk4 .* the file's own table holds it as blk5"
    with pytest.raises(BackendError, match=message) as caught:
        load(bundle, backend="native")
    assert "re-export" in caught.value.hint
    with load(bundle) as gen:
        assert gen.backend == "onnxruntime" and "the file's own table holds it as blk5" in gen.backend_note
    with pytest.raises(BackendError, match=message):  # cuda reads through the same reader (its CPU reference here)
        load_cuda(bundle, CudaOptions(kernels=ReferenceKernels))


def test_int8_activations_take_every_block_of_the_mix(mixed_bundle):
    """int8 activations run on every kind of a K-quant mix, blk5 (Q5_0, the fallback of most of a Q4_K_M's weights)
    included: a row's logits are the same bits in every call, near fp32's and not equal to them, and speculative
    greedy output equals plain greedy output."""
    from specdec import GenerationConfig
    from specdec.native_record import Activations
    from specdec.weight_kinds import Kernel, WeightKind

    assert all(Kernel.Q8A in kind.kernels for kind in (WeightKind.Q41, WeightKind.Q5, WeightKind.Q80, WeightKind.Q6))
    bundle, q41 = mixed_bundle
    int8 = assert_same_bits_in_every_call(bundle, Activations.INT8)
    fp32 = assert_same_bits_in_every_call(bundle, Activations.FP32)
    assert not np.array_equal(fp32, int8) and np.abs(fp32 - int8).mean() <= 0.02 * np.abs(fp32).max()
    with load(q41, backend="native", activations="int8") as gen:
        plain = gen.generate("The quick brown fox", GenerationConfig(max_new_tokens=40, drafter="none")).token_ids
        for drafter, gamma in (("model", 3), ("prompt_lookup", 4)):
            assert gen.generate("The quick brown fox", GenerationConfig(max_new_tokens=40, drafter=drafter,
                                                                        gamma=gamma)).token_ids == plain
