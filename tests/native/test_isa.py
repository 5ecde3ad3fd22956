"""The kernels' instruction sets: where the CPU has AVX-512 (F, VL, BW, DQ) and VNNI, the library is built with them
(16-lane products, 32 registers, int8 dot products in one instruction), and with VBMI too where it has that (blk5's
codes unpacked by one multishift); each computes the same bits as the AVX2 build: every product of every weight
layout and kernel at every row count, and whole forwards of a Q4_1 target, its int8 draft and a bf16 target.
SPECDEC_NATIVE_ISA picks one; its bad values are refused with a hint."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specdec.blocks import encode
from specdec.errors import BackendError
from specdec.native import build
from specdec.weight_kinds import Kernel, WeightKind

ROOT = Path(__file__).resolve().parents[2]
AVX512 = "flags\t\t: fpu avx2 fma f16c " + " ".join(build.AVX512_CPU)
VBMI = AVX512 + " avx512vbmi"
AVX2_ONLY = "flags\t\t: fpu avx2 fma f16c avx512f"
AVX_VNNI = "flags\t\t: fpu avx2 fma f16c avx_vnni"  # AVX-VNNI without AVX-512 (Alder Lake)
needs_avx512 = pytest.mark.skipif(bool(build.missing_cpu_flags(required=build.AVX512_CPU)),
                                  reason="this CPU lacks AVX-512 or VNNI: only the AVX2 build runs here")
# the wider builds this CPU runs, each compared with the AVX2 build
WIDER = [isa for isa in (build.Isa.AVX512, build.Isa.AVX512_VBMI, build.Isa.AVX2_VNNI) if not build.missing_cpu_flags(
    required=build.ISA_CPU[isa])]
pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")


@pytest.mark.parametrize("cpu, wanted, expected", [
    (AVX512, None, "avx512"), (AVX512, "auto", "avx512"), (AVX512, "avx2", "avx2"), (AVX512, " AVX512 ", "avx512"),
    (VBMI, None, "avx512-vbmi"), (VBMI, "avx512", "avx512"), (VBMI, "avx512-vbmi", "avx512-vbmi"),
    (AVX2_ONLY, None, "avx2"), (AVX2_ONLY, "avx2", "avx2"),
    (AVX_VNNI, None, "avx2-vnni"), (AVX_VNNI, "avx2", "avx2"), (AVX512 + " avx_vnni", None, "avx512"),
    (AVX512 + " avx_vnni", "avx2-vnni", "avx2-vnni"),
])
def test_the_widest_set_the_cpu_has_unless_told(tmp_path, monkeypatch, cpu, wanted, expected):
    (tmp_path / "cpuinfo").write_text(cpu)
    if wanted is None:
        monkeypatch.delenv(build.ISA_ENV, raising=False)
    else:
        monkeypatch.setenv(build.ISA_ENV, wanted)
    assert build.isa(tmp_path / "cpuinfo") == expected


def test_wider_than_the_cpu_or_unknown_is_refused(tmp_path, monkeypatch):
    (tmp_path / "cpuinfo").write_text(AVX2_ONLY)
    monkeypatch.setenv(build.ISA_ENV, "avx512")
    with pytest.raises(BackendError, match="lacks avx512vl, avx512bw, avx512dq, avx512_vnni") as caught:
        build.isa(tmp_path / "cpuinfo")
    assert "avx2" in caught.value.hint
    (tmp_path / "cpuinfo").write_text(AVX512)
    monkeypatch.setenv(build.ISA_ENV, "avx512-vbmi")
    with pytest.raises(BackendError, match="but this CPU lacks avx512vbmi\n"):
        build.isa(tmp_path / "cpuinfo")
    monkeypatch.setenv(build.ISA_ENV, "avx2-vnni")
    with pytest.raises(BackendError, match="but this CPU lacks avx_vnni\n"):
        build.isa(tmp_path / "cpuinfo")
    monkeypatch.setenv(build.ISA_ENV, "sse4")
    with pytest.raises(BackendError, match="'sse4' is not one of auto, avx2, avx512"):
        build.isa(tmp_path / "cpuinfo")


def test_each_set_builds_its_own_library(monkeypatch):
    monkeypatch.setenv(build.ISA_ENV, "avx2")
    narrow, narrow_key = build.build_flags(), build.source_key("cc")
    assert not set(build.AVX512_FLAGS) & set(narrow)
    if not build.missing_cpu_flags(required=build.AVX512_CPU):
        monkeypatch.setenv(build.ISA_ENV, "avx512")
        wide, wide_key = build.build_flags(), build.source_key("cc")
        assert set(build.AVX512_FLAGS) <= set(wide) and "-mavx512vbmi" not in wide and wide_key != narrow_key
        if build.Isa.AVX512_VBMI in WIDER:
            monkeypatch.setenv(build.ISA_ENV, "avx512-vbmi")
            assert set(build.VBMI_FLAGS) <= set(build.build_flags()) and build.source_key("cc") not in (narrow_key,
                                                                                                         wide_key)
    if build.Isa.AVX2_VNNI in WIDER:
        monkeypatch.setenv(build.ISA_ENV, "avx2-vnni")
        flags = build.build_flags()
        assert "-mavxvnni" in flags and not set(build.AVX512_FLAGS) & set(flags)
        assert build.source_key("cc") != narrow_key


def products(bundle: str, out: str) -> None:
    """Every weight kind's products by every kernel the table gives it, at 1..33 rows, into `out` (npz); run under
    each SPECDEC_NATIVE_ISA. Not bf16 activations': one AMX kernel that only the AVX-512 builds have
    (tests/native/test_bf16_activations.py)."""
    from specdec.manifest import read_manifest
    from specdec.runtime.native_backend import NativeBackend

    model = NativeBackend(Path(bundle), read_manifest(Path(bundle)).target, 2).open().model
    rng = np.random.default_rng(0)
    results = {}
    for n, k in ((37, 96), (50, 576), (7, 32)):  # odd block counts (pairs padded), a column count no tile divides
        weight = rng.normal(0, 0.1, (n, k)).astype(np.float32)
        layouts = {kind.label: (encode(kind, weight), sorted(kind.kernels - {Kernel.BF16A})) for kind in WeightKind}
        for rows in (1, 2, 5, 6, 7, 8, 9, 13, 33):  # 33: past the int8 kernel's WIDE, its decoded-weights path
            x = rng.normal(0, 2, (rows, k)).astype(np.float32)
            for name, (blocks, kernels) in layouts.items():
                for kernel in kernels:
                    for threads in (1, 2):
                        results[f"{name}-{kernel}-{n}x{k}-{rows}-{threads}"] = model.matmul(x, blocks, kernel, threads)
    np.savez(out, **results)


def forwards(bundle: str, out: str) -> None:
    """A prompt, a verify pass and a step of every slot, by the target and the draft of `bundle`, and by its target
    with int8 activations where its weights are blocks, into `out`."""
    from specdec.manifest import read_manifest
    from specdec.runtime import load
    from specdec.weight_kinds import WEIGHT_LAYOUTS

    blocks = not WEIGHT_LAYOUTS[read_manifest(Path(bundle)).target.native.layout].rows
    fp32 = load(bundle, backend="native")
    int8 = load(bundle, backend="native", activations="int8") if blocks else None
    rng = np.random.default_rng(1)
    results = {}
    for role, generator in (("target", fp32), ("draft", fp32), ("int8", int8)):
        if generator is None:
            continue
        backend = getattr(generator, "target" if role == "int8" else role)
        rows = backend.max_batch
        generator.target.reset(rows)
        backend.reset(rows)
        lengths = [int(n) for n in rng.integers(1, 100, rows)]
        for slot, length in enumerate(lengths):
            results[f"{role}-prompt-{slot}"] = backend.forward(
                rng.integers(3, backend.vocab_size, (1, length)), np.array([0]), slots=np.array([slot]))
        results[f"{role}-verify"] = backend.forward(rng.integers(3, backend.vocab_size, (1, 4)),
                                                    np.array(lengths[:1]), slots=np.array([0]))
        results[f"{role}-rows"] = backend.forward(rng.integers(3, backend.vocab_size, (rows, 1)),
                                                  np.array(lengths) + 4 * (np.arange(rows) == 0),
                                                  slots=np.arange(rows))
    for generator in filter(None, (fp32, int8)):
        generator.close()
    np.savez(out, **results)


def under(isa: str, call: str, cache: Path) -> None:
    env = dict(os.environ, SPECDEC_NATIVE_ISA=isa, SPECDEC_CACHE=str(cache), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", f"import tests.native.test_isa as t; t.{call}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def same_bits(first: Path, second: Path) -> None:
    a, b = np.load(first), np.load(second)
    assert sorted(a.files) == sorted(b.files) and a.files
    differ = [name for name in a.files if not np.array_equal(a[name].view(np.uint32), b[name].view(np.uint32))]
    assert not differ, f"{len(differ)} of {len(a.files)} differ, e.g. {differ[:5]}"


@needs_avx512
def test_products_are_the_same_bits_in_every_build(q41_bundle, tmp_path):
    for isa in ("avx2", *WIDER):
        under(isa, f"products({str(q41_bundle)!r}, {str(tmp_path / isa)!r})", tmp_path / "cache")
    for isa in WIDER:
        same_bits(tmp_path / "avx2.npz", tmp_path / f"{isa}.npz")


@needs_avx512
@pytest.mark.parametrize("which", ["q41_bundle", "bf16_pair"])
def test_forwards_are_the_same_bits_in_every_build(request, tmp_path, which):
    bundle = request.getfixturevalue(which)
    for isa in ("avx2", *WIDER):
        under(isa, f"forwards({str(bundle)!r}, {str(tmp_path / isa)!r})", tmp_path / "cache")
    for isa in WIDER:
        same_bits(tmp_path / "avx2.npz", tmp_path / f"{isa}.npz")


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory):
    """A bf16 tiny LLaMA exported to its native bf16 rows, with its int4-q41 draft."""
    from specdec.calibration.bundle_io import quantized_bundle
    from specdec.calibration.data import DataConfig
    from specdec.calibration.quantize import QuantizeConfig
    from specdec.export.tiny import save_tiny_in
    from tests.native.conftest import HEAD_TOKENS, _gqa_export

    model = save_tiny_in(tmp_path_factory.mktemp("bf16"), "bfloat16", family="llama", seed=0, init_range=0.5,
                         hidden=64)
    bundle = _gqa_export(tmp_path_factory.mktemp("b") / "bf16", model, draft_from_target="int4")
    config = QuantizeConfig(method="int4-q41", data=DataConfig(seq_len=16, num_samples=4), head_tokens=HEAD_TOKENS)
    return quantized_bundle(bundle, tmp_path_factory.mktemp("q41") / "q41", config)
