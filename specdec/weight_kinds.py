"""The weight kinds, read from the one table that defines them: specdec/native/specdec_kinds.h (numpy only; the ground
floor, beside manifest.py).

A weight kind is how a product's weights are stored (ggml's type traits): its id, its element (a block struct or a
row's scalar), the bytes of an element, the weights an element holds along K, the kernels that serve it and the
builds that have them. The header owns all of it and the C compiler checks it there (static asserts on every
element's size, ids 0..count - 1); this module parses the same file at import, so nothing here restates a kind:

- WeightKind: an IntEnum of the table's rows (value: the id the kernels take), each with its traits and numpy dtype
  (the header's structs, field by field);
- ModelKind: model_t.kind's rows (a target's linears and head), and the bundle layouts (WEIGHT_LAYOUTS) built on them;
- TensorKind and DTYPES: the elements a native weights file may hold, by name;
- BLOCK, Q5_ORDER: the header's block size and blk5's code order.

Adding a weight kind is one row of the table (with its struct) plus its kernels; tests/test_weight_kinds.py and
tests/native/test_kind_table.py fail until every backend serves it or says, in one place, that it does not.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from pathlib import Path

import numpy as np

from specdec.manifest import Role

HEADER = Path(__file__).with_name("native") / "specdec_kinds.h"
# the header's C types as numpy's: its f16 holds an IEEE half's bits (bf16 stays its bits: numpy has no bf16)
SCALARS = {"float": np.dtype("<f4"), "uint8_t": np.dtype("u1"), "int8_t": np.dtype("i1"), "uint16_t": np.dtype("<u2"),
           "f16": np.dtype("<f2")}
ENUMERATED = {"SPECDEC_WEIGHT_KINDS": "SPECDEC_W_", "SPECDEC_MODEL_KINDS": "SPECDEC_"}  # table -> its rows' enum
_LEXEME = re.compile(r'"(?:\\.|[^"\\])*"|//[^\n]*|/\*.*?\*/', re.S)  # a string literal or a comment
_OPERATORS = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__, ast.FloorDiv: int.__floordiv__,
              ast.BitOr: int.__or__, ast.LShift: int.__lshift__}


class HeaderError(ValueError):
    """specdec_kinds.h says something this reader cannot take (a packaging bug: the tests read the same file)."""


class Kernel(StrEnum):
    """A kernel of specdec_matmul (KERNELS: its code, the header's SPECDEC_KERNEL_<NAME>)."""

    STEP = "step"  # a decode step's and a verify pass's
    PROMPT = "prompt"  # a prompt's (fp32)
    INT8 = "int8"  # the activations rounded to two int8 parts: the draft's
    Q8A = "q8a"  # ... to one int8 part per block of 32: a target's int8 activations mode (SPECDEC_ACT_INT8)
    Q8A_REF = "q8a-ref"  # Q8A in plain C: the bits every build of Q8A must give
    BF16A = "bf16a"  # ... to bf16, times bf16 rows on AMX tiles: a target's bf16 activations mode (SPECDEC_ACT_BF16)


class Isa(StrEnum):
    """The instruction set the native kernels are built for (the header's SPECDEC_ISA_<NAME> bits)."""

    AUTO = "auto"  # the default: the widest of the others the CPU has
    AVX2 = "avx2"
    AVX512 = "avx512"
    AVX512_VBMI = "avx512-vbmi"
    AVX2_VNNI = "avx2-vnni"  # AVX2 with AVX-VNNI's 256-bit vpdpbusd (Alder Lake and later cores without AVX-512)


# ---- reading the header ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Header:
    """What specdec_kinds.h defines: object-like #defines and enumerators (name -> C expression), the element types
    (name -> numpy dtype), and the rows of its X-macro tables (name -> [[argument, ...], ...])."""

    constants: dict
    elements: dict
    tables: dict

    def value(self, name: str) -> int:
        """The integer a constant's expression comes to."""
        if name not in self.constants:
            raise HeaderError(f"{HEADER.name} defines no {name}")
        return evaluate(self.constants[name], self)

    def table(self, name: str) -> list:
        if name not in self.tables:
            raise HeaderError(f"{HEADER.name} has no table {name}")
        return self.tables[name]


def read_header(text: str) -> Header:
    """The header's constants, elements and tables, from its text (comments dropped, continued lines joined)."""
    text = _LEXEME.sub(lambda match: match.group() if match.group().startswith('"') else " ", text)
    text = text.replace("\\\n", " ")
    constants = dict(re.findall(r"^[ \t]*#define[ \t]+(\w+)[ \t]+(.+?)[ \t]*$", text, re.M))
    for body in re.findall(r"\benum\s*\{([^}]*)\}", text):
        lines = "\n".join(line for line in body.splitlines() if not line.lstrip().startswith("#"))
        for item in lines.split(","):
            found = re.search(r"(\w+)\s*=\s*([^=]+)$", item.strip(), re.S)
            if found:
                constants[found.group(1)] = found.group(2).strip()
    tables = {name: _rows(body) for name, body in
              re.findall(r"^[ \t]*#define[ \t]+(SPECDEC_\w+_KINDS)\(X\)[ \t]+(.+?)[ \t]*$", text, re.M)}
    for table, prefix in ENUMERATED.items():  # the enumerators the header generates from its tables' rows
        constants.update((prefix + row[0], row[1]) for row in tables.get(table, ()))
    header = Header(constants, {}, tables)
    header.elements.update(_scalars(text))
    for body, name in re.findall(r"\btypedef\s+struct\s*\{([^}]*)\}\s*(\w+)\s*;", text):
        header.elements[name] = _struct(body, header)
    return header


def _rows(body: str) -> list:
    """X(a, b, ...) X(...) ... -> [[a, b, ...], ...]: each call's arguments, split at its top-level commas."""
    rows, depth, quoted, current, row = [], 0, False, "", []
    for char in body:
        if quoted or char == '"':
            quoted = not quoted if char == '"' else quoted
            current += char
        elif char == "(":
            depth += 1
            current += char if depth > 1 else ""
        elif char == ")":
            depth -= 1
            current += char if depth else ""
            if not depth:
                rows.append(row + [current.strip()])
                row, current = [], ""
        elif char == "," and depth == 1:
            row.append(current.strip())
            current = ""
        elif depth:
            current += char
    return rows


def _scalars(text: str) -> dict:
    """The header's scalar typedefs (typedef float f32;) as numpy dtypes, and SCALARS' own."""
    found = dict(SCALARS)
    for base, name in re.findall(r"\btypedef\s+(\w+)\s+(\w+)\s*;", text):
        if base in SCALARS and name not in found:
            found[name] = SCALARS[base]
    return found


def _struct(body: str, header: Header) -> np.dtype:
    """A struct's fields (float d, m; uint8_t qs[SPECDEC_BLOCK / 2];) as a packed numpy dtype; the table's BYTES,
    asserted by the compiler, then proves the C struct has no padding either."""
    fields = []
    for declaration in filter(None, (part.strip() for part in body.split(";"))):
        kind, names = declaration.split(None, 1)
        if kind not in header.elements:
            raise HeaderError(f"{HEADER.name}: a field of type {kind} ({declaration!r}) has no numpy dtype")
        for declarator in names.split(","):
            found = re.fullmatch(r"\s*(\w+)\s*((?:\[[^\]]+\]\s*)*)", declarator)
            if found is None:
                raise HeaderError(f"{HEADER.name}: {declarator.strip()!r} is not a field this reader takes")
            name, dims = found.groups()
            shape = tuple(evaluate(dim, header) for dim in re.findall(r"\[([^\]]+)\]", dims))
            fields.append((name, header.elements[kind], shape) if shape else (name, header.elements[kind]))
    return np.dtype(fields)


def evaluate(expression: str, header: Header) -> int:
    """A C integer expression of the header's constants (+ - * / | <<, parentheses) -> its value."""
    def walk(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return header.value(node.id)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](walk(node.left), walk(node.right))
        raise HeaderError(f"{HEADER.name}: {expression!r} is not an integer expression this reader takes")

    try:
        return walk(ast.parse(expression.replace("/", "//"), mode="eval").body)
    except SyntaxError:
        raise HeaderError(f"{HEADER.name}: {expression!r} is not an integer expression") from None


SOURCE = read_header(HEADER.read_text(encoding="utf-8"))
BLOCK = SOURCE.value("SPECDEC_BLOCK")  # weights per block along K
Q5_ORDER = np.array([int(v) for v in SOURCE.constants["SPECDEC_Q5_ORDER"].strip("{} ").split(",")])  # blk5's slots
KERNELS = {kernel: SOURCE.value(f"SPECDEC_KERNEL_{kernel.name}") for kernel in Kernel}  # specdec_matmul's kernel
ISA_BITS = {isa: SOURCE.value(f"SPECDEC_ISA_{isa.name}") for isa in Isa if isa is not Isa.AUTO}


def _bits(mask: int, codes: dict) -> frozenset:
    """The members of `codes` ({member: bit}) whose bits `mask` sets; HeaderError for a bit none of them has."""
    chosen = frozenset(member for member, bit in codes.items() if mask & bit)
    if mask & ~sum(codes.values()):
        raise HeaderError(f"{HEADER.name}: a table sets bits {mask:#x}, beyond those of {sorted(codes)}")
    return chosen


# ---- the weight kinds -----------------------------------------------------------------------------------------------
class _WeightKind(IntEnum):
    """A row of SPECDEC_WEIGHT_KINDS (the value: its id, which specdec_matmul and model_t.kinds take)."""

    def __new__(cls, value: int, element: str, dtype: np.dtype, per: int, kernels: frozenset, isas: frozenset,
                decode: str):
        kind = int.__new__(cls, value)
        kind._value_ = value
        kind.element = element  # its element's name: a block struct's, or a row's scalar's (a TensorKind)
        kind.dtype = dtype  # the element as numpy holds it
        kind.per = per  # weights an element holds along K
        kind.kernels = kernels  # the Kernels of specdec_matmul that run it
        kind.isas = isas  # the Isa builds that have them
        kind.decode = decode  # a weight's value, in words
        return kind

    @property
    def label(self) -> str:
        """Its name in Python and in kernels.cu's kernel names (q41, bf16, ...)."""
        return self.name.lower()

    @property
    def bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def rows(self) -> bool:
        """Whether its weights are rows [N, K] of one scalar a weight (else blocks of several)."""
        return self.per == 1

    @property
    def fp32(self) -> bool:
        """Whether the fp32 kernels run it (a step's and a prompt's): what a target's linears take."""
        return {Kernel.STEP, Kernel.PROMPT} <= self.kernels

    def elements(self, inputs: int) -> int:
        """Elements of a column of `inputs` weights (K): ceil(K / per)."""
        return -(-inputs // self.per)

    def traits(self) -> tuple:
        """(bytes, per, kernel bits, isa bits): what the library's specdec_weight_kind answers for it."""
        return (self.bytes, self.per, sum(1 << KERNELS[k] for k in self.kernels),
                sum(ISA_BITS[isa] for isa in self.isas))


def _weight_rows(header: Header) -> list:
    """(name, (id, element, dtype, per, kernels, isas, decode)) of each row of SPECDEC_WEIGHT_KINDS, checked: ids
    0..n - 1, each element's dtype of the row's BYTES."""
    rows = []
    for row in header.table("SPECDEC_WEIGHT_KINDS"):
        name, ident, element, size, per, kernels, isas, decode = row
        dtype = header.elements.get(element)
        if dtype is None or dtype.itemsize != evaluate(size, header):
            raise HeaderError(f"{HEADER.name}: kind {name}'s element {element} is not a {size}-byte type it defines")
        kernel_bits = {kernel: 1 << bit for kernel, bit in KERNELS.items()}
        rows.append((name, (evaluate(ident, header), element, dtype, evaluate(per, header),
                            _bits(evaluate(kernels, header), kernel_bits), _bits(evaluate(isas, header), ISA_BITS),
                            ast.literal_eval(decode))))
    if sorted(ident for _, (ident, *_) in rows) != list(range(len(rows))):
        raise HeaderError(f"{HEADER.name}: the weight kinds' ids are not 0..{len(rows) - 1}")
    return sorted(rows, key=lambda row: row[1][0])


WeightKind = _WeightKind("WeightKind", _weight_rows(SOURCE), module=__name__, qualname="WeightKind")
TensorKind = StrEnum("TensorKind", [(kind.element.upper(), kind.element) for kind in WeightKind] + [("I64", "i64")],
                     module=__name__, qualname="TensorKind")
TensorKind.__doc__ = "The element of a tensor of the native weights file (TensorEntry.kind; DTYPES holds its dtype)."
DTYPES = {TensorKind(kind.element): kind.dtype for kind in WeightKind} | {TensorKind.I64: np.dtype("<i8")}
KIND_OF = {kind.dtype: kind for kind in WeightKind}  # the weight kind of an array's dtype
# a "mixed" layout's linears: a GGUF grid's blocks, one block an element, fp32 kernels; narrowest first
MIXED_KINDS = tuple(sorted((kind for kind in WeightKind if kind.per == BLOCK and kind.fp32), key=lambda k: k.bytes))


def kind_of(array: np.ndarray) -> WeightKind:
    """The weight kind an array of weights holds; TypeError for a dtype no kind has."""
    try:
        return KIND_OF[array.dtype]
    except KeyError:
        raise TypeError(f"no weight kind holds dtype {array.dtype}") from None


# ---- the model kinds and the bundle layouts built on them -----------------------------------------------------------
class _ModelKind(IntEnum):
    """A row of SPECDEC_MODEL_KINDS: how a target holds its weights (the value: model_t.kind)."""

    def __new__(cls, value: int, linear: WeightKind | None, head: WeightKind | None):
        kind = int.__new__(cls, value)
        kind._value_ = value
        kind.linear = linear  # the kind of its linear weights; None: each its own (model_t.kinds)
        kind.head = head  # the kind of its head; None: its own (model_t.head_kind)
        return kind


def _weight_kind(argument: str, header: Header) -> WeightKind | None:
    """A table's SPECDEC_W_<NAME> as its WeightKind (SPECDEC_W_EACH: None)."""
    value = evaluate(argument, header)
    return None if value == header.value("SPECDEC_W_EACH") else WeightKind(value)


ModelKind = _ModelKind("ModelKind", [
    (name, (evaluate(ident, SOURCE), _weight_kind(linear, SOURCE), _weight_kind(head, SOURCE)))
    for name, ident, linear, head in SOURCE.table("SPECDEC_MODEL_KINDS")], module=__name__, qualname="ModelKind")
LayoutName = StrEnum("LayoutName", [(kind.name, kind.name.lower()) for kind in ModelKind] +
                     [("Q41_DRAFT", "q41-draft")], module=__name__, qualname="LayoutName")
LayoutName.__doc__ = """How a native weights file holds a model (NativeRecord.layout; WEIGHT_LAYOUTS holds what each
is): a model kind's name, or an int4-q41 draft's."""


@dataclass(frozen=True)
class WeightLayout:
    """How a native weights file holds a model's weights; a NativeRecord's `layout` names one (WEIGHT_LAYOUTS)."""

    name: LayoutName
    role: Role  # the model it holds
    kind: int  # model_t.kind, a ModelKind (-1: a draft's, which runs on its target's model_t)
    linear: WeightKind | None  # the kind of its linear weights; None: each its own of MIXED_KINDS
    head: WeightKind | None  # ... of its head; None: its own of MIXED_KINDS

    @property
    def per(self) -> int:
        """Inputs one stored element of a linear weight holds along K."""
        return BLOCK if self.linear is None else self.linear.per

    @property
    def rows(self) -> bool:
        """Whether its linear weights and head are rows [N, K] in a checkpoint's precision (else GGUF blocks)."""
        return self.per == 1

    @property
    def mixed(self) -> bool:
        """Whether each linear weight has blocks of its own kind (MIXED_KINDS; model_t.kinds says which)."""
        return self.linear is None


WEIGHT_LAYOUTS = {layout.name: layout for layout in (
    *(WeightLayout(LayoutName[kind.name], Role.TARGET, int(kind), kind.linear, kind.head) for kind in ModelKind),
    WeightLayout(LayoutName.Q41_DRAFT, Role.DRAFT, -1, WeightKind.Q41P, WeightKind.Q80))}  # pairs of Q4_1 blocks
