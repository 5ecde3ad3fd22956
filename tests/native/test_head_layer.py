"""The draft head's layer in one call of the native kernels (specdec_head_forward, NativeLayer) against its numpy
reference on the same blocks (HeadModel with BlockProducts), a row's bits whatever shares the call, and the export's
refusals. The sanitizer run (make test-sanitize) runs this file too."""
from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest

from specdec.errors import BackendError
from specdec.head.kernels import Q8A, Q8A_REF, STEP, BlockProducts, HeadStruct, NativeLayer
from specdec.head.model import HeadModel, TokenEmbedding, packed
from specdec.head.random import random_head
from specdec.manifest import ModelDims
from specdec.native import build

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")
E_NULL, E_SHAPE, E_POSITION, E_SCRATCH, E_THREADS, E_NONFINITE = 1, 2, 4, 5, 6, 7  # specdec_native.h
SAME_BLOCKS = 1e-5  # of the largest |value|: the one call against numpy on the very same products (summation order)
DIMS = ModelDims("llama", 4, 4, 2, 16, 64, 300, 64)
S = 48  # the head's KV positions


def _heads(kernel: int, threads: int = 2, norm_before_residual: bool = False, seed: int = 1) -> tuple:
    """(the numpy layer, the one-call layer) of one random head: the same blocks, the same embedding."""
    weights, record = random_head(DIMS, (0, 1, 3), np.arange(0, 300, 2), seed=seed, mlp=96)
    if norm_before_residual:
        record = dataclasses.replace(record, norm_before_residual=True)
    table = np.random.default_rng(seed).standard_normal((DIMS.vocab_size, DIMS.hidden_size)).astype(np.float32)
    products = BlockProducts(packed(weights), build.load_kernels(), threads, kernel)
    return (HeadModel(weights, record, TokenEmbedding(table), products, S),
            HeadModel(weights, record, TokenEmbedding(table), products, S, NativeLayer))


def _inputs(rows: int, steps: int, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, DIMS.vocab_size, (rows, steps)),
            rng.standard_normal((rows, steps, DIMS.hidden_size)).astype(np.float32))


def _worst(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("kernel", [STEP, Q8A])
@pytest.mark.parametrize("last_only", [False, True])
@pytest.mark.parametrize("normed", [False, True])
def test_one_call_equals_the_numpy_layer_on_the_same_blocks(kernel, last_only, normed):
    numpy_head, native_head = _heads(kernel, norm_before_residual=normed)
    tokens, hidden = _inputs(2, 5)
    positions, slots = np.array([0, 11]), np.array([2, 0])
    want = numpy_head.forward(tokens, hidden, positions, slots, last_only)
    got = native_head.forward(tokens, hidden, positions, slots, last_only)
    assert [g.shape for g in got] == [w.shape for w in want] == [(2, 1 if last_only else 5, 150), (2, 1 if last_only
                                                                                                   else 5, 64)]
    assert _worst(got[0], want[0]) <= SAME_BLOCKS and _worst(got[1], want[1]) <= SAME_BLOCKS
    assert np.array_equal(np.argmax(got[0], -1), np.argmax(want[0], -1))
    for mine, theirs in ((native_head.keys, numpy_head.keys), (native_head.values, numpy_head.values)):
        assert _worst(mine, theirs) <= SAME_BLOCKS  # every slot, the untouched ones zero in both
    # a chain step from the head's own prenorm, over what the catch-up wrote
    step = np.argmax(want[0][:, -1:], -1)
    more = [head.forward(step, out[1][:, -1:], positions + 5, slots, True)
            for head, out in ((numpy_head, want), (native_head, got))]
    assert _worst(more[1][0], more[0][0]) <= SAME_BLOCKS


@pytest.mark.parametrize("kernel", [STEP, Q8A])
def test_a_rows_outputs_are_its_own_bits_whatever_shares_the_call(kernel):
    """Alone or beside another row, in one catch-up of T tokens or T calls of one, on 1 or 2 threads: the same bits."""
    tokens, hidden = _inputs(2, 4, seed=3)
    positions, slots = np.array([3, 20]), np.array([0, 1])
    _, both = _heads(kernel, threads=2)
    together = both.forward(tokens, hidden, positions, slots, False)
    _, alone = _heads(kernel, threads=1)
    for b in range(2):
        one = [alone.forward(tokens[b : b + 1, t : t + 1], hidden[b : b + 1, t : t + 1], positions[b : b + 1] + t,
                             slots[b : b + 1], True) for t in range(4)]
        for t in range(4):
            assert np.array_equal(one[t][0][0, 0], together[0][b, t]), (b, t)
            assert np.array_equal(one[t][1][0, 0], together[1][b, t]), (b, t)


def test_int8_activations_give_their_plain_c_reference_bits():
    tokens, hidden = _inputs(2, 3, seed=4)
    outs = [_heads(kernel, threads)[1].forward(tokens, hidden, np.array([1, 7]), np.array([0, 1]), False)
            for kernel, threads in ((Q8A, 2), (Q8A_REF, 1))]
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])


def test_damaged_weights_are_reported_not_drafted():
    _, head = _heads(STEP)
    head.layer._keep[3][:] = np.nan  # the final norm's weights (NativeLayer keeps what its struct points to)
    tokens, hidden = _inputs(1, 1)
    with pytest.raises(BackendError, match="NaN") as caught:
        head.forward(tokens, hidden, np.array([0]), np.array([0]), True)
    assert "train the head again" in caught.value.hint


def test_raw_export_returns_status_codes():
    lib = build.load_kernels()
    _, head = _heads(Q8A)
    head.reserve(1)
    layer = head.layer
    struct = ctypes.byref(layer.struct)
    H, V = DIMS.hidden_size, layer.struct.V
    x = np.ones((1, 2, H), np.float32)
    logits, prenorm = np.empty((1, 2, V), np.float32), np.empty((1, 2, H), np.float32)
    scratch = np.empty(1 << 22, np.uint8)
    rows = np.array([head.keys.ctypes.data], np.uintp)
    values = np.array([head.values.ctypes.data], np.uintp)
    pos = np.zeros(1, np.int32)

    def forward(h=struct, size=scratch.size, B=1, T=1, pos=pos, keys=rows.ctypes.data, S=S, kernel=Q8A, threads=2,
                out=logits.ctypes.data, last_only=0):
        return lib.specdec_head_forward(h, scratch.ctypes.data, size, x.ctypes.data, x.ctypes.data, B, T,
                                        pos.ctypes.data, keys, values.ctypes.data, S, last_only, kernel, threads, out,
                                        prenorm.ctypes.data)

    assert forward() == 0 and forward(T=2, kernel=STEP) == 0 and forward(T=2, last_only=1, kernel=Q8A_REF) == 0
    assert lib.specdec_head_scratch_bytes(struct, 1, 2, S, 2) > 0
    assert lib.specdec_head_scratch_bytes(None, 1, 1, S, 2) == -1
    assert lib.specdec_head_scratch_bytes(struct, 0, 1, S, 2) == -1
    assert forward(h=None) == E_NULL and forward(keys=None) == E_NULL and forward(out=None) == E_NULL
    assert forward(keys=np.zeros(1, np.uintp).ctypes.data) == E_NULL  # a row without its KV
    assert forward(size=64) == E_SCRATCH
    assert forward(B=0) == E_SHAPE and forward(T=0) == E_SHAPE and forward(S=0) == E_SHAPE
    assert forward(kernel=1) == E_SHAPE  # the prompt kernel is not the head's
    assert forward(threads=0) == E_THREADS and forward(threads=10**6) == E_THREADS
    assert forward(pos=np.array([S - 1], np.int32), T=2) == E_POSITION
    assert forward(pos=np.array([-1], np.int32)) == E_POSITION
    assert forward(pos=np.array([S], np.int32), S=S + 64) == E_POSITION  # past the rotary table's rows
    for field, value, status in (("H", 33, E_SHAPE), ("Hq", 3, E_SHAPE), ("D", 3, E_SHAPE), ("I", 0, E_SHAPE),
                                 ("residual_normed", 2, E_SHAPE), ("scale", float("nan"), E_SHAPE),
                                 ("lm_head", None, E_NULL), ("cos", None, E_NULL), ("post_norm", None, E_NULL)):
        broken = HeadStruct.from_buffer_copy(layer.struct)
        setattr(broken, field, value)
        assert forward(h=ctypes.byref(broken)) == status, field
    for kind in (-1, 99, 5, 2):  # none, none, f32 rows and the draft's pairs (no int8 activations' kernel)
        broken = HeadStruct.from_buffer_copy(layer.struct)
        broken.kinds[4] = kind
        assert forward(h=ctypes.byref(broken)) == E_SHAPE, kind
    assert lib.specdec_layout_size(4) == ctypes.sizeof(HeadStruct)
