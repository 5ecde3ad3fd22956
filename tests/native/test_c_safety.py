"""Malformed calls to every export of the native kernels raise BackendError (through Backend.forward and through the
lower wrappers) or return their status code (raw); none writes out of bounds or aborts the process. The sanitizer
run (make test-sanitize: ASan + UBSan) runs this file too."""
from __future__ import annotations

import ctypes
import json
import shutil

import numpy as np
import pytest

from specdec.blocks import BLOCK4, BLOCK5, BLOCK6
from specdec.native.build import ABI_VERSION
from specdec.weight_kinds import ISA_BITS, Q5_ORDER, WeightKind
from specdec.weights_file import FORMAT_VERSION
from specdec.errors import BackendError, SpecDecError
from specdec.manifest import read_manifest
from specdec.native import build
from specdec.head.kernels import HeadStruct
from specdec.native.model import FeaturesStruct, ModelStruct
from specdec.runtime.native_backend import NativeBackend

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")
E_NULL, E_SHAPE, E_TOKEN, E_POSITION, E_SCRATCH, E_THREADS = 1, 2, 3, 4, 5, 6  # specdec_native.h


@pytest.fixture(scope="module")
def target(grid_bundle):
    backend = NativeBackend(grid_bundle, read_manifest(grid_bundle).target, 2).open()
    backend.reset(2)
    yield backend
    backend.close()


def test_the_library_reports_the_header_and_the_python_layouts():
    lib = build.load_kernels()
    header = (build.HERE / "specdec_native.h").read_text(encoding="utf-8")
    assert f"#define SPECDEC_ABI_VERSION {ABI_VERSION}\n" in header
    assert f"#define SPECDEC_FORMAT_VERSION {FORMAT_VERSION}\n" in header
    assert lib.specdec_abi_version() == ABI_VERSION
    assert [lib.specdec_layout_size(i) for i in range(-1, 6)] == [-1, 72, 144, ctypes.sizeof(ModelStruct),
                                                                 ctypes.sizeof(FeaturesStruct), ctypes.sizeof(HeadStruct),
                                                                 -1]  # blkq, blkqp, model_t, features_t, head_t
    found, build_isa = build.library_kinds(lib)
    assert found == [kind.traits() for kind in WeightKind] and build_isa == ISA_BITS[build.isa()]
    assert [BLOCK4.itemsize, BLOCK6.itemsize, BLOCK5.itemsize] == [24, 40, 28]
    assert sorted(Q5_ORDER.tolist()) == list(range(32))  # blk5's slots (specdec_kinds.h), as blocks.py packs them


@pytest.mark.parametrize("ids,start,last_only,match", [
    (np.zeros((1, 0), np.int64), 0, True, "token ids shaped"),  # an empty forward (once a write past malloc(0))
    (np.zeros((1, 0), np.int64), 0, False, "token ids shaped"),
    (np.full((1, 2), 10**6), 3, False, "outside the weights' vocabulary"),
    (np.full((1, 2), -1), 3, False, "outside the weights' vocabulary"),
    (np.ones((1, 3)), 255, False, "needs 258 slots"),  # past S
    (np.ones((1, 3)), -1, False, "needs|cache_len"),  # before 0
])
def test_backend_forward_refuses(target, ids, start, last_only, match):
    with pytest.raises(SpecDecError, match=match):
        target.forward(np.asarray(ids, np.int64), np.array([start]), last_only=last_only)


@pytest.mark.parametrize("pos,ids,status", [
    (250, [[1] * 8], "position"), (-2, [[1]], "position"), (0, [[10**6]], "vocabulary"), (0, [[-5]], "vocabulary")])
def test_the_kernels_check_what_the_backend_would(target, pos, ids, status):
    """Below Backend.forward's checks: NativeModel.forward hands the kernels a position past S, before 0, a token
    outside the weights; the kernels refuse (status codes 4 and 3)."""
    with pytest.raises(BackendError, match=status):
        target.model.forward(np.array(ids), np.array([pos]), np.array([0]))


@pytest.mark.parametrize("pos,slots,match", [
    (np.array([2**32 + 5]), np.array([0]), "fall outside"),  # once wrapped to 5 by the cast to 32 bits
    (np.array([0, 0]), np.array([0]), "one integer position and one slot per row"),  # once read past a short array
    (np.array([1.5]), np.array([0]), "one integer position"),
    (np.array([0]), np.array([7]), "not distinct slots"),
])
def test_native_model_forward_checks_positions_and_slots(target, pos, slots, match):
    target.reset(2)
    with pytest.raises(BackendError, match=match):
        target.model.forward(np.array([[1]]), pos, slots)


def test_matmul_refuses_a_k_that_its_blocks_do_not_have(target):
    blocks = target.model.weights.layers[0].qkv  # K = 64: two blocks per column
    with pytest.raises(BackendError, match="out of range"):
        target.model.matmul(np.ones((2, 96), np.float32), blocks)
    with pytest.raises(BackendError, match="out of range"):
        target.model.matmul(np.ones((2, 64), np.float32), blocks, "int8")  # Q4_1 blocks need pairs for int8
    with pytest.raises(BackendError, match="out of range"):
        target.model.matmul(np.ones((0, 64), np.float32), blocks)


def test_raw_exports_return_status_codes(target):
    lib, model = build.load_kernels(), target.model
    struct, x = ctypes.byref(model.struct), np.ones((4, 64), np.float32)
    y, scratch = np.empty((4, 4096), np.float32), np.empty(1 << 20, np.uint8)
    pos, ids = np.zeros(1, np.int32), np.ones(1, np.int64)
    rows = np.array([model.keys[0, 0].ctypes.data], np.uintp)
    stride = model.keys.strides[0] // 4

    def forward(m=struct, size=scratch.size, B=1, T=1, S=model.max_seq_len, threads=2, keys=rows.ctypes.data,
                pos=pos, ids=ids, features=None):
        return lib.specdec_forward(m, scratch.ctypes.data, size, ids.ctypes.data, B, T, pos.ctypes.data, keys,
                                   rows.ctypes.data, stride, S, 0, 0, threads, y.ctypes.data, features)

    assert forward() == 0
    out, L = np.empty((1, 1, 2, model.dims.hidden_size), np.float32), model.dims.num_layers
    for layers, status in (([0, L - 1], 0), ([0, L], E_SHAPE), ([-1, 0], E_SHAPE)):
        chosen = np.array(layers, np.int32)
        assert forward(features=ctypes.byref(FeaturesStruct(chosen.ctypes.data, 2, out.ctypes.data))) == status
    assert forward(features=ctypes.byref(FeaturesStruct(chosen.ctypes.data, 0, out.ctypes.data))) == E_SHAPE
    assert forward(features=ctypes.byref(FeaturesStruct(None, 1, out.ctypes.data))) == E_NULL
    assert forward(features=ctypes.byref(FeaturesStruct(chosen.ctypes.data, 1, None))) == E_NULL
    assert forward(m=None) == E_NULL and forward(keys=None) == E_NULL
    assert forward(size=16) == E_SCRATCH
    assert forward(B=0) == E_SHAPE and forward(T=0) == E_SHAPE and forward(S=0) == E_SHAPE
    assert forward(threads=0) == E_THREADS and forward(threads=10**6) == E_THREADS
    assert forward(pos=np.array([model.max_seq_len], np.int32)) == E_POSITION
    assert forward(ids=np.array([len(model.weights.head)], np.int64)) == E_TOKEN
    null = type(model.struct).from_buffer_copy(model.struct)  # a descriptor with a NULL layer table
    null.qkv = None
    assert forward(m=ctypes.byref(null)) == E_NULL
    odd = type(model.struct).from_buffer_copy(model.struct)  # ... and one with a hidden size off the blocks
    odd.H = 33
    assert forward(m=ctypes.byref(odd)) == E_SHAPE
    mixed = type(model.struct).from_buffer_copy(model.struct)  # a "mixed" descriptor without its kinds, then with
    mixed.kind = 5  # SPECDEC_MIXED                              # a kind no linear may have
    assert forward(m=ctypes.byref(mixed)) == E_NULL
    kinds = np.zeros((model.dims.num_layers, 5), np.int32)  # every linear blk4: the q41 bundle's own
    kinds[:, 4] = 99  # the v rows' kind, read only where a layer has them apart
    mixed.kinds = kinds.ctypes.data
    assert forward(m=ctypes.byref(mixed)) == 0
    split = np.zeros(model.dims.num_layers, np.uintp)  # no layer's v rows apart: the same
    mixed.qkv_v = split.ctypes.data
    assert forward(m=ctypes.byref(mixed)) == 0
    split[-1] = model.weights.layers[-1].qkv.ctypes.data  # the last layer's v rows apart, of kind 99
    assert forward(m=ctypes.byref(mixed)) == E_SHAPE
    kinds[-1, 4] = 0
    assert forward(m=ctypes.byref(mixed)) == 0
    for head_kind in (2, 3, 7 + 1):  # the draft's pairs, rows, none
        mixed.head_kind = head_kind
        assert forward(m=ctypes.byref(mixed)) == E_SHAPE, head_kind
    mixed.head_kind = 1  # blk8, as the q41 bundle's head is
    assert forward(m=ctypes.byref(mixed)) == 0
    for kind in (2, 3, 5, 8, -1):  # paired Q4_1 (the draft's), rows, none
        kinds[-1, 3] = kind
        assert forward(m=ctypes.byref(mixed)) == E_SHAPE, kind
    mixed.kind = 6
    assert forward(m=ctypes.byref(mixed)) == E_SHAPE
    for mlp in (-1, 3):  # SiLU-gated, GELU tanh, GELU erf: 0..2
        gpt2 = type(model.struct).from_buffer_copy(model.struct)
        gpt2.mlp = mlp
        assert forward(m=ctypes.byref(gpt2)) == E_SHAPE, mlp
    H, L = model.dims.hidden_size, model.dims.num_layers
    table, beta = np.zeros((model.max_seq_len, H), np.float32), np.zeros(H, np.float32)
    betas = np.array([beta.ctypes.data] * L, np.uintp)
    gpt2 = type(model.struct).from_buffer_copy(model.struct)
    gpt2.position_table = table.ctypes.data  # learned positions beside rotary tables
    assert forward(m=ctypes.byref(gpt2)) == E_NULL
    gpt2.cos = None  # ... beside half of them
    assert forward(m=ctypes.byref(gpt2)) == E_NULL
    gpt2.sin = None  # learned positions alone
    assert forward(m=ctypes.byref(gpt2)) == 0
    gpt2.position_table = None  # neither
    assert forward(m=ctypes.byref(gpt2)) == E_NULL
    gpt2 = type(model.struct).from_buffer_copy(model.struct)
    gpt2.in_norm_bias = gpt2.post_norm_bias = betas.ctypes.data  # LayerNorm without the final norm's bias
    assert forward(m=ctypes.byref(gpt2)) == E_NULL
    gpt2.final_norm_bias = beta.ctypes.data
    gpt2.o_bias = gpt2.down_bias = betas.ctypes.data
    assert forward(m=ctypes.byref(gpt2)) == 0
    holes = betas.copy()
    holes[-1] = 0  # the last layer's bias NULL
    for field in ("in_norm_bias", "o_bias", "down_bias", "qkv_bias"):
        broken = type(gpt2).from_buffer_copy(gpt2)
        setattr(broken, field, holes.ctypes.data)
        assert forward(m=ctypes.byref(broken)) == E_NULL, field
    assert lib.specdec_scratch_bytes(struct, 0, 1, 8, 1) == -1 and lib.specdec_scratch_bytes(None, 1, 1, 8, 1) == -1
    w = model.weights.layers[0].qkv
    assert lib.specdec_matmul(None, 4, 64, w.ctypes.data, 2, 0, 0, y.ctypes.data, 4, scratch.ctypes.data, 64, 1) == 1
    assert lib.specdec_matmul(x.ctypes.data, 4, 64, w.ctypes.data, 2, 0, 7, y.ctypes.data, 4, scratch.ctypes.data,
                              64, 1) == E_SHAPE  # no kernel 7
    assert lib.specdec_matmul(x.ctypes.data, 4, 64, w.ctypes.data, 2, 8, 0, y.ctypes.data, 4, scratch.ctypes.data,
                              64, 1) == E_SHAPE  # no kind 8
    assert lib.specdec_matmul(x.ctypes.data, 4, 64, w.ctypes.data, 2, 6, 2, y.ctypes.data, 4, scratch.ctypes.data,
                              1 << 20, 1) == E_SHAPE  # blk6 has no int8 kernel
    assert lib.specdec_matmul(x.ctypes.data, 4, 64, w.ctypes.data, 2, 0, 1, y.ctypes.data, 4, scratch.ctypes.data,
                              64, 1) == E_SCRATCH  # the prompt kernel's decoded columns need more
    q = np.ones((2, 4, 16), np.float32)
    kv = np.ones((2, 8, 16), np.float32)
    attention = lambda pos, size=scratch.size: lib.specdec_attention(  # noqa: E731
        q.ctypes.data, 2, 4, 2, 16, kv.ctypes.data, kv.ctypes.data, 8, pos, 0.25, y.ctypes.data, scratch.ctypes.data,
        size, 2)
    assert attention(6) == 0 and attention(7) == E_POSITION and attention(-1) == E_POSITION
    assert attention(0, size=8) == E_SCRATCH


def test_a_manifest_vocabulary_larger_than_the_weights_is_refused(grid_bundle, tmp_path):
    """The manifest says more tokens than the weights hold; the native engine trusts the weights and refuses."""
    bundle = tmp_path / "bundle"
    shutil.copytree(grid_bundle, bundle)
    path = bundle / "manifest.json"
    manifest = json.loads(path.read_text(encoding="utf-8"))
    for entry in manifest["models"].values():
        entry["dims"]["vocab_size"] += 64
    path.write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(BackendError, match="head is .* its dims need"):
        NativeBackend(bundle, read_manifest(bundle).target, 2).open()
