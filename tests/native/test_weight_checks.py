"""Native weights are checked at open, not only their hash: every tensor aligned, inside its file and apart from the
others; no NaN or inf where the kernels read a float (rows, norms, block scales and minima); and every file a backend
or the tokenizer reads must be listed in the manifest (dropping an entry does not turn its hash check off). A file
that fails makes `auto` fall back to onnxruntime with the reason, and `backend="native"` raise it."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from specdec.blocks import BF16, BLOCK4, nonfinite
from specdec.errors import BackendError, ManifestError
from specdec.manifest import sha256_file
from specdec.native import build
from specdec.runtime import load

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")


@pytest.fixture
def bundle(grid_bundle, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(grid_bundle, copy)
    return copy


def _manifest(bundle, edit) -> None:
    path = bundle / "manifest.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    edit(data)
    path.write_text(json.dumps(data), encoding="utf-8")


def _poke(bundle, tensor: str, value: float, field: str | None = None) -> None:
    """Write `value` into the first float of `tensor` in the target's native.bin, and record the file's new hash (a
    bundle made so on purpose passes its hash check)."""
    data = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))["models"]["target"]
    native, spec = data["native"], data["native"]["tensors"][tensor]
    path = bundle / native["path"]
    raw = bytearray(path.read_bytes())
    raw[spec["offset"] : spec["offset"] + 4] = np.float32(value).tobytes()  # d (or the first f32) of the tensor
    path.write_bytes(bytes(raw))
    _manifest(bundle, lambda m: m["models"]["target"]["files"].update({native["path"]: sha256_file(path)}))


def _refused_and_auto_falls_back(bundle, message: str) -> None:
    with pytest.raises(BackendError, match=message):
        load(bundle, backend="native")
    with load(bundle) as gen:
        assert gen.backend == "onnxruntime" and message.split("|")[0] in gen.backend_note


@pytest.mark.parametrize("tensor,value", [("layers.0.qkv", np.nan), ("layers.1.input_norm", np.inf),
                                          ("final_norm", -np.inf), ("layers.0.down", np.nan)])
def test_weights_holding_nan_or_inf_are_refused(bundle, tensor, value):
    _poke(bundle, tensor, value)
    _refused_and_auto_falls_back(bundle, f"tensor {tensor} holds NaN or inf")


def _tensor(bundle, name: str):
    return lambda m: m["models"]["target"]["native"]["tensors"][name]


@pytest.mark.parametrize("case,edit,message", [
    ("misaligned", lambda t: t["layers.0.qkv"].update(offset=t["layers.0.qkv"]["offset"] + 8), "not a multiple of 64"),
    ("overlapping", lambda t: t["layers.0.o"].update(offset=t["layers.0.qkv"]["offset"]), "overlap"),
    ("past the end", lambda t: t["final_norm"].update(offset=t["final_norm"]["offset"] + (1 << 30)), "bytes; tensor"),
    ("in the header", lambda t: t["final_norm"].update(offset=0), "past the header"),
])
def test_tensors_out_of_place_are_refused(bundle, case, edit, message):
    _manifest(bundle, lambda m: edit(m["models"]["target"]["native"]["tensors"]))
    _refused_and_auto_falls_back(bundle, message)


def test_a_file_read_must_be_listed(bundle):
    _manifest(bundle, lambda m: m["models"]["target"]["files"].pop("target/native.bin"))
    with pytest.raises(ManifestError, match="target/native.bin' is read but not listed"):
        load(bundle, backend="native")
    with load(bundle) as gen:  # onnxruntime reads the graph, which is listed
        assert gen.backend == "onnxruntime" and "not listed" in gen.backend_note
    _manifest(bundle, lambda m: m["tokenizer"]["files"].pop("tokenizer.json"))
    with pytest.raises(ManifestError, match="tokenizer.json' is read but not listed") as caught:
        load(bundle)
    assert "verify=False" in caught.value.hint
    load(bundle, verify=False).close()  # knowingly unchecked


def test_nonfinite_reads_every_float_kind():
    rows = np.zeros((3, 64), np.float32)
    assert not nonfinite(rows) and not nonfinite((rows.view(np.uint32) >> 16).astype(BF16))
    for value in (np.nan, np.inf, -np.inf):
        bad = rows.copy()
        bad[2, 63] = value
        assert nonfinite(bad) and nonfinite((bad.view(np.uint32) >> 16).astype(BF16))
        assert nonfinite(bad.astype(np.float16))
        blocks = np.zeros((2, 2), BLOCK4)
        blocks["m"][1, 1] = value
        assert nonfinite(blocks)
    assert not nonfinite(np.full(5, 2**62, np.int64))  # integers hold no NaN
