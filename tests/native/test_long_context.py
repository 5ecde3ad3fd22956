"""The native target against onnxruntime over 320 positions, at 1 and 2 threads: every position's argmax equal and
its logits within TOLERANCE of the largest |logit|. A mutant whose rotary position freezes at 127 (it passed every
native test before this one) is compiled here and must fail the same comparison."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from specdec.manifest import read_manifest
from specdec.native import build
from specdec.native.model import NativeModel
from specdec.native_record import Activations
from specdec.runtime.native_backend import NativeBackend
from specdec.runtime.ort_backend import OrtBackend

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")
TOLERANCE = 1e-4  # of the largest |logit|: fp32 summation order
POSITIONS = 320
PIECES = (16, 1, 1, 5, 7, 1, 31, 5)  # prefill chunks, steps and verify passes, repeated up to POSITIONS


@pytest.fixture(scope="module")
def long_bundle(tmp_path_factory):
    from specdec.export.bundle import export_bundle
    from specdec.export.config import ExportConfig
    from specdec.export.tiny import save_tiny_on_grids

    model = save_tiny_on_grids(tmp_path_factory.mktemp("long"), family="llama", seed=3, init_range=0.5, hidden=64)
    config = ExportConfig(out=tmp_path_factory.mktemp("b") / "long", target=str(model), max_seq_len=384, gamma=3,
                          gamma_max=6, max_batch=2, max_prefill_chunk=32, progress=False, lowering="gqa",
                          activations=Activations.FP32)
    return export_bundle(config)


def _logits(backend, ids: np.ndarray) -> np.ndarray:
    """Every position's logits [POSITIONS, V], fed in PIECES (every row scored)."""
    backend.reset(1)
    out, start, piece = [], 0, 0
    while start < POSITIONS:
        stop = min(POSITIONS, start + PIECES[piece % len(PIECES)])
        out.append(backend.forward(ids[None, start:stop], np.array([start]))[0])
        start, piece = stop, piece + 1
    return np.concatenate(out)


@pytest.fixture(scope="module")
def reference(long_bundle):
    ids = np.random.default_rng(7).integers(3, 300, POSITIONS)
    ort = OrtBackend(long_bundle, read_manifest(long_bundle).target, 2).open()
    return ids, _logits(ort, ids)


def _mismatch(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """(max |difference| / max |logit|, share of positions whose argmax differs)"""
    return float(np.abs(got - want).max() / np.abs(want).max()), float((got.argmax(-1) != want.argmax(-1)).mean())


@pytest.mark.parametrize("threads", [1, 2])
def test_native_equals_onnxruntime_over_320_positions(long_bundle, reference, threads):
    ids, want = reference
    native = NativeBackend(long_bundle, read_manifest(long_bundle).target, threads).open()
    error, flipped = _mismatch(_logits(native, ids), want)
    assert error <= TOLERANCE and flipped == 0.0, (error, flipped)


def test_a_frozen_rotary_position_fails_the_comparison(long_bundle, reference, tmp_path):
    """The mutant: positions past 127 rotate as 127."""
    for path in build.SOURCES + build.HEADERS:
        shutil.copy(path, tmp_path / path.name)
    source = tmp_path / "forward.c"
    text = source.read_text(encoding="utf-8")
    original = "const int at = p->pos[b] + t;"
    assert original in text
    source.write_text(text.replace(original, "const int at = p->pos[b] + t < 127 ? p->pos[b] + t : 127;"))
    library = tmp_path / "mutant.so"
    subprocess.run([build.compiler(), *build.FLAGS, *(str(tmp_path / p.name) for p in build.SOURCES), "-o",
                    str(library), *build.LIBRARIES], check=True, capture_output=True)
    native = NativeBackend(long_bundle, read_manifest(long_bundle).target, 2).open()
    model = native.model
    native.model = NativeModel(model.weights, model.dims, build.checked(library), model.max_seq_len)
    ids, want = reference
    got = _logits(native, ids)
    error, flipped = _mismatch(got[:127], want[:127])
    assert error <= TOLERANCE and flipped == 0.0  # the same function before position 127
    error, flipped = _mismatch(got, want)
    late = _mismatch(got[128:], want[128:])[1]
    print(f"rotary frozen at 127: max relative logit error {error:.3g} (tolerance {TOLERANCE:g}); the next token "
          f"differs at {flipped:.0%} of all {len(want)} positions, {late:.0%} of those from 128 on")
    assert error > TOLERANCE and flipped > 0.1, (error, flipped)
