"""The TensorRT entry points fail clearly where TensorRT is not installed (as on every CPU machine here)."""
from __future__ import annotations

import importlib.util

import pytest

import specdec
from specdec.cli import export_main
from specdec.errors import BackendError, MissingDependencyError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed")


def test_export_engine_without_tensorrt_names_the_extra(int4_bundle, capsys):
    assert export_main(["--out", str(int4_bundle), "--engine", "tensorrt"]) == 1
    err = capsys.readouterr().err
    assert "tensorrt" in err and "pip install 'specdec[tensorrt]'" in err and "Traceback" not in err


def test_load_with_tensorrt_backend_without_tensorrt(int4_bundle):
    with pytest.raises(MissingDependencyError) as info:
        specdec.load(int4_bundle, backend="tensorrt", device="cuda:0")
    assert "specdec[tensorrt]" in info.value.hint


def test_unknown_backend(int4_bundle):
    with pytest.raises(BackendError, match="not available"):
        specdec.load(int4_bundle, backend="openvino")


def test_tensorrt_refuses_the_gqa_lowering(gqa_int4_bundle):
    from specdec.engines.tensorrt import check_buildable
    from specdec.errors import EngineBuildError
    from specdec.manifest import read_manifest

    with pytest.raises(EngineBuildError, match="gqa") as info:
        check_buildable(read_manifest(gqa_int4_bundle).target)
    assert "--lowering plain" in info.value.hint
