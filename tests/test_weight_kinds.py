"""The table of weight kinds, as Python reads it (specdec/weight_kinds.py from specdec/native/specdec_kinds.h): every
kind's element, bytes, weights per element, kernels and builds; the stored layouts a bundle's format pins; every Python
registry of per-kind code covering the whole table (the numpy decoders and encoders, the mixed layout's fitters, the
file's element kinds, the layouts); a row added to the header is a kind everywhere; a header that contradicts itself is
refused. The native library's reading of the same table: tests/native/test_kind_table.py; the cuda kernels':
tests/cuda/test_kernels.py."""
from __future__ import annotations

import numpy as np
import pytest

from specdec.blocks import DECODERS, ENCODERS, FITTERS, encode, float_rows
from specdec.manifest import Role
from specdec.weight_kinds import (BLOCK, DTYPES, HEADER, MIXED_KINDS, WEIGHT_LAYOUTS, HeaderError, Isa, Kernel,
                                  LayoutName, ModelKind, TensorKind, WeightKind, _weight_rows, kind_of, read_header)
from specdec.weights_file import FORMAT_VERSION

# The elements a bundle of FORMAT_VERSION stores, field by field: a change here changes every bundle on disk, so it
# comes with a new FORMAT_VERSION (and CHANGED_SINCE), and this pin moves with it.
STORED = {4: {"blk4": [("d", "<f4"), ("m", "<f4"), ("qs", "|u1", (16,))], "blk8": [("d", "<f4"), ("qs", "|i1", (32,))],
              "blk4p": [("h", "<f2", (4,)), ("qs", "|u1", (32,))], "bf16": [("", "<u2")], "f16": [("", "<f2")],
              "f32": [("", "<f4")], "blk6": [("d", "<f4", (2,)), ("qs", "|i1", (32,))],
              "blk5": [("codes", "|u1", (20,)), ("d", "<f4"), ("m", "<f4")]}}


def test_the_table_reads_as_the_kernels_take_it():
    assert BLOCK == 32 and [int(kind) for kind in WeightKind] == list(range(len(WeightKind)))
    assert {kind.label: (kind.bytes, kind.per) for kind in WeightKind} == {
        "q41": (24, 32), "q80": (36, 32), "q41p": (40, 64), "bf16": (2, 1), "f16": (2, 1), "f32": (4, 1),
        "q6": (40, 32), "q5": (28, 32)}
    assert WeightKind.Q41P.kernels == {Kernel.INT8} and WeightKind.Q80.kernels == set(Kernel) - {Kernel.BF16A}
    assert WeightKind.BF16.kernels == {Kernel.STEP, Kernel.PROMPT, Kernel.BF16A}
    assert all(kind.isas == set(Isa) - {Isa.AUTO} and kind.decode for kind in WeightKind)
    assert MIXED_KINDS == (WeightKind.Q41, WeightKind.Q5, WeightKind.Q80, WeightKind.Q6)  # narrowest first
    assert [kind.elements(96) for kind in (WeightKind.Q41, WeightKind.Q41P, WeightKind.F32)] == [3, 2, 96]


def test_the_stored_elements_are_the_formats():
    got = {kind.element: [field if len(field) > 2 or field[0] else ("", field[1]) for field in kind.dtype.descr]
           for kind in WeightKind}
    assert got == STORED[FORMAT_VERSION]


def test_every_registry_of_per_kind_code_covers_the_table():
    assert set(DECODERS) == set(ENCODERS) == set(WeightKind)
    assert set(FITTERS) == set(MIXED_KINDS)
    assert {TensorKind(kind.element) for kind in WeightKind} | {TensorKind.I64} == set(TensorKind) == set(DTYPES)
    assert {layout.kind for layout in WEIGHT_LAYOUTS.values() if layout.role == Role.TARGET} == set(ModelKind)
    for kind in ModelKind:
        layout = WEIGHT_LAYOUTS[LayoutName[kind.name]]
        assert (layout.linear, layout.head, layout.mixed) == (kind.linear, kind.head, kind.linear is None)
    assert WEIGHT_LAYOUTS[LayoutName.MIXED].per == BLOCK and WEIGHT_LAYOUTS[LayoutName.BF16].rows


@pytest.mark.parametrize("kind", list(WeightKind), ids=lambda kind: kind.label)
def test_each_kinds_numpy_decoder_reads_its_encoder(kind):
    weight = np.random.default_rng(int(kind)).normal(0, 0.1, (5, 96)).astype(np.float32)
    array = encode(kind, weight)
    assert array.dtype == kind.dtype and array.shape == (5, kind.elements(96)) and kind_of(array) is kind
    values = float_rows(array)
    assert values.dtype == np.float32 and values.shape == (5, kind.elements(96) * kind.per)
    levels = {WeightKind.Q41: 15, WeightKind.Q41P: 15, WeightKind.Q5: 31}.get(kind, 254)  # steps over a block's span
    bound = np.abs(weight) / 128 if kind.rows else np.abs(weight).max() / levels  # half a step; bf16 keeps 8 bits
    assert (np.abs(values[:, :96] - weight) <= bound).all() and not values[:, 96:].any()


def test_a_row_of_the_header_is_a_kind_everywhere_it_is_read():
    text = HEADER.read_text(encoding="utf-8")
    row = 'X(Q5,   7, blk5,  28, SPECDEC_BLOCK,     SPECDEC_STEP | SPECDEC_PROMPT | SPECDEC_Q8A_BOTH, SPECDEC_EVERY_ISA, \\\n'
    assert text.count(row) == 1
    added = text.replace(row, row + '      "d * q + m") \\\n    X(Q4X,  8, blk4,  24, SPECDEC_BLOCK, SPECDEC_STEP, '
                                     'SPECDEC_ISA_AVX2, \\\n')
    rows = _weight_rows(read_header(added))
    assert [name for name, _ in rows][-2:] == ["Q5", "Q4X"]
    assert rows[-1][1][:5] == (8, "blk4", WeightKind.Q41.dtype, 32, frozenset({Kernel.STEP}))


@pytest.mark.parametrize("old,new,match", [
    ("X(Q5,   7, blk5,  28,", "X(Q5,   6, blk5,  28,", "ids are not 0..7"),
    ("X(Q5,   7, blk5,  28,", "X(Q5,   7, blk5,  24,", "element blk5 is not a 24-byte type"),
    ("X(Q5,   7, blk5,  28,", "X(Q5,   7, blk9,  28,", "element blk9 is not"),
    ("typedef struct { float d; int8_t qs[SPECDEC_BLOCK]; } blk8;",
     "typedef struct { double d; int8_t qs[SPECDEC_BLOCK]; } blk8;", "a field of type double"),
    ("X(Q41P, 2, blk4p, 40, 2 * SPECDEC_BLOCK, SPECDEC_INT8,", "X(Q41P, 2, blk4p, 40, 2 * SPECDEC_BLOCK, 64,",
     "beyond those of"),
    ("X(Q41P, 2, blk4p, 40, 2 * SPECDEC_BLOCK,", "X(Q41P, 2, blk4p, 40, 2.5 * SPECDEC_BLOCK,", "not an integer"),
])
def test_a_header_that_contradicts_itself_is_refused(old, new, match):
    text = HEADER.read_text(encoding="utf-8")
    assert text.count(old) == 1
    with pytest.raises(HeaderError, match=match):
        _weight_rows(read_header(text.replace(old, new)))
