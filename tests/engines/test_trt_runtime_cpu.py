"""What the TensorRT path does on a machine without TensorRT, cuda-python or a GPU, and the KV write-back math."""
from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys

import numpy as np
import pytest

from specdec.engines.cuda_glue import Copy3D, kv_row_copies
from specdec.engines.tensorrt import build_bundle_engines, build_engine, check_buildable
from specdec.engines.trt_compat import major_version
from specdec.engines.trt_config import build_config_for
from specdec.errors import EngineBuildError, MissingDependencyError
from specdec.manifest import read_manifest
from specdec.runtime.trt_backend import TrtBackend

no_tensorrt = pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed")
no_cuda_python = pytest.mark.skipif(importlib.util.find_spec("cuda") is not None, reason="cuda-python is installed")


def _is_missing_tensorrt(error: MissingDependencyError) -> bool:
    return "'tensorrt'" in error.message and error.hint == "pip install 'specdec[tensorrt]'"


@no_tensorrt
def test_build_engine_without_tensorrt(int4_bundle):
    manifest = read_manifest(int4_bundle)
    with pytest.raises(MissingDependencyError) as info:
        build_engine(int4_bundle / manifest.target.onnx_path, build_config_for(manifest), manifest.target)
    assert _is_missing_tensorrt(info.value)


@no_tensorrt
def test_build_bundle_engines_without_tensorrt(int4_bundle):
    with pytest.raises(MissingDependencyError) as info:
        build_bundle_engines(int4_bundle, roles=("target",))
    assert _is_missing_tensorrt(info.value)


@no_tensorrt
def test_trt_backend_without_tensorrt(int4_bundle):
    manifest = read_manifest(int4_bundle)
    backend = TrtBackend(int4_bundle, manifest.target)  # __init__ does no work
    with pytest.raises(MissingDependencyError) as info:
        backend.open()
    assert _is_missing_tensorrt(info.value)
    backend.close()  # closing a backend that never opened is harmless


@no_cuda_python
def test_cuda_glue_without_cuda_python():
    from specdec.engines.cuda_glue import compute_capability

    with pytest.raises(MissingDependencyError) as info:
        compute_capability()
    assert "'cuda-python'" in info.value.message and "specdec[tensorrt]" in info.value.hint


def test_the_int4_draft_is_not_a_tensorrt_graph(int4_bundle):
    draft = read_manifest(int4_bundle).draft
    for derived in (draft.derived, "int4-q41", "layers:1+int4-rtn"):  # export's and calibrate's int4 drafts
        with pytest.raises(EngineBuildError, match="MatMulNBits") as info:
            check_buildable(dataclasses.replace(draft, derived=derived))
        assert "--draft-layers" in info.value.hint


def test_importing_the_backend_loads_no_gpu_module_nor_torch():
    code = ("import sys, specdec.runtime.trt_backend, specdec.engines.trt_select, specdec.runtime;"
            "print([m for m in ('tensorrt', 'cuda', 'torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_major_version():
    assert [major_version(v) for v in ("10.13.3.9", "11.0.0", "x")] == [10, 11, 0]


def _memcpy3d(dst: np.ndarray, src: np.ndarray, c: Copy3D) -> None:
    """cudaMemcpy3D on linear memory, by its documented addressing: (x, y, z) at ptr + z*pitch*ysize + y*pitch + x."""
    for z in range(c.depth):
        for y in range(c.height):
            s = c.src_offset + z * c.src_pitch * c.src_ysize + y * c.src_pitch
            d = c.dst_offset + z * c.dst_pitch * c.dst_ysize + y * c.dst_pitch
            dst[d : d + c.width] = src[s : s + c.width]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_kv_row_copies_write_new_kv_at_each_rows_cache_len(dtype):
    layers, batch, heads, size, dim, steps = 3, 3, 2, 11, 4, 3
    rng = np.random.default_rng(0)
    past = rng.standard_normal((layers, batch, heads, size, dim)).astype(dtype)  # [L, B, Hkv, S, D]
    new = rng.standard_normal((layers, batch, heads, steps, dim)).astype(dtype)  # [L, B, Hkv, T, D]
    cache_len = np.asarray([0, 5, 8], dtype=np.int64)
    expected = past.copy()
    for row, start in enumerate(cache_len):  # the onnxruntime backend's write-back
        expected[:, row, :, start : start + steps] = new[:, row]
    raw = past.copy().view(np.uint8).reshape(-1)
    copies = kv_row_copies(layers, batch, heads, dim, size, steps, cache_len, np.dtype(dtype).itemsize)
    assert len(copies) == batch
    for copy in copies:
        _memcpy3d(raw, new.view(np.uint8).reshape(-1), copy)
    np.testing.assert_array_equal(raw.view(dtype).reshape(past.shape), expected)
