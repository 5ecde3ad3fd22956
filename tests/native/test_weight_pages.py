"""How the native weights are held (SPECDEC_NATIVE_PAGES): read into private memory on huge pages (the default) or
the bundle's file mapped shared. Both hold the same bytes, read only, and give the same logits bit for bit; a bad
value is a BackendError with a hint, and `auto` falls back with it as the reason."""
from __future__ import annotations

import numpy as np
import pytest

import specdec
from specdec.weights_file import TensorEntry, read_tensors
from specdec.errors import BackendError
from specdec.manifest import read_manifest
from specdec.native import build
from specdec.runtime.native_backend import PAGES_ENV, NativeBackend

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")


def _index(record) -> dict:
    return {name: TensorEntry(spec["kind"], tuple(spec["shape"]), int(spec["offset"]))
            for name, spec in record.tensors.items()}


def test_private_and_shared_hold_the_same_bytes_read_only(q41_bundle):
    for role in ("target", "draft"):
        record = getattr(read_manifest(q41_bundle), role).native
        shared = read_tensors(q41_bundle / record.path, _index(record), "shared")
        private = read_tensors(q41_bundle / record.path, _index(record), "private")
        assert shared.keys() == private.keys() and len(private) >= 10
        for name, array in private.items():
            assert array.dtype == shared[name].dtype and np.array_equal(array.view(np.uint8),
                                                                        shared[name].view(np.uint8)), name
            assert not array.flags.writeable and array.ctypes.data % 64 == 0  # aligned as the file lays them out
    with pytest.raises(ValueError, match="pages 'huge' is not one of private, shared"):
        read_tensors(q41_bundle / record.path, _index(record), "huge")


def test_a_file_shorter_than_it_reads_is_refused(q41_bundle, tmp_path):
    record = read_manifest(q41_bundle).target.native
    cut = tmp_path / "native.bin"
    cut.write_bytes((q41_bundle / record.path).read_bytes()[:4096])
    with pytest.raises(ValueError, match="has 4096 bytes"):
        read_tensors(cut, _index(record), "private")


@pytest.mark.parametrize("role", ["target", "draft"])
def test_both_ways_give_the_same_logits(q41_bundle, monkeypatch, role):
    ids = np.random.default_rng(3).integers(3, 200, (2, 9))
    got = {}
    for held in ("private", "shared"):
        monkeypatch.setenv(PAGES_ENV, held)
        with specdec.load(q41_bundle, backend="native") as gen:
            target, draft = gen.target.backend, gen.draft.backend
            target.reset(2)
            first = target.forward(ids, np.array([0, 3]))
            if role == "draft":
                draft.reset(2)
                got[held] = draft.forward(ids[:, :4], np.array([9, 12]))
            else:
                got[held] = first
    assert np.array_equal(got["private"], got["shared"])


def test_a_bad_value_is_refused_and_auto_falls_back(q41_bundle, monkeypatch):
    monkeypatch.setenv(PAGES_ENV, "huge")
    manifest = read_manifest(q41_bundle)
    with pytest.raises(BackendError, match="SPECDEC_NATIVE_PAGES='huge' is not one of private, shared") as info:
        NativeBackend(q41_bundle, manifest.target, 2).open()
    assert "shared" in info.value.hint
    from specdec.runtime import registry

    registry._warn_once.cache_clear()
    with specdec.load(q41_bundle) as gen:
        assert gen.backend == "onnxruntime" and PAGES_ENV in gen.backend_note


def test_load_takes_pages_and_isa_as_arguments_over_the_environment(q41_bundle, monkeypatch):
    """The native backend's settings reach it as load's arguments; the variables apply only where they are unset."""
    from specdec.errors import ConfigError

    monkeypatch.setenv(PAGES_ENV, "huge")  # refused where it applies: the argument wins, so it does not
    monkeypatch.setenv(build.ISA_ENV, "sse4")
    outputs = {}
    for pages, isa in (("shared", "avx2"), ("private", "auto")):
        with specdec.load(q41_bundle, backend="native", pages=pages, isa=isa) as gen:
            assert gen.backend == "native" and gen.target.backend.pages == pages
            assert gen.draft.backend.pages == pages  # a draft holds its weights as its target does
            outputs[pages] = gen.generate("hello there", specdec.GenerationConfig(max_new_tokens=8)).token_ids
    assert outputs["shared"] == outputs["private"]  # every instruction set computes the same bits
    with pytest.raises(ConfigError, match="pages='huge' is not one of private, shared"):
        specdec.load(q41_bundle, pages="huge")
    with pytest.raises(ConfigError, match="isa='sse4' is not one of auto, avx2, avx512"):
        specdec.load(q41_bundle, isa="sse4")
