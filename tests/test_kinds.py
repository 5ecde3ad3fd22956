"""Kinds are objects, read from the source (CONTRIBUTING.md): a drafter, backend, coupling, role, precision, weight
layout or any other kind is compared as an enum member or a registry entry, never as a bare string. So no comparison
in specdec/ (==, !=, in, not in, or a match case) has a string literal on a side, nor a literal tuple, list or set
holding one, except the few of ALLOWED: strings of a protocol or another library's output, which are no kinds."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specdec"
OPERATORS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)

ALLOWED = {  # file -> the literals it may compare with, and why none of them is a kind
    "specdec/__init__.py": {"GenerationConfig", "GenerationResult", "Generator", "load"},  # lazy attributes (PEP 562)
    "specdec/cli/demo.py": {"__main__"},
    "specdec/calibration/quantize.py": {"__dict__", "__weakref__",  # attributes every class has
                                        "Constant", "Mul", "MatMul"},  # ONNX op types
    "specdec/calibration/q41.py": {"Gemm", "MatMul", "", "ai.onnx", "com.microsoft"},  # ONNX op types, op domains
    "specdec/engines/tensorrt.py": {"MatMulNBits", "com.microsoft"},  # in TensorRT's parser errors
    "specdec/export/bundle.py": {"NOT_IMPLEMENTED"},  # in onnxruntime's error
    "specdec/engines/cuda_glue.py": {"Device", "Driver"},  # in CUDA's error names
    "specdec/engines/trt_config.py": {".", "0123456789."},  # the characters of a version number
    "specdec/export/tiny.py": {"lm_head"},  # in a transformers module name
    "specdec/calibration/data.py": {".jsonl", ".parquet"},  # file suffixes
    "specdec/export/sources.py": {".gguf"},
    "specdec/export/head_import.py": {"silu"},  # a transformers config's hidden_act
    "specdec/manifest.py": {"None", "int", "float",  # type names in a dataclass field's annotation
                            "..", "\\"},  # a path that leaves the bundle
    "specdec/native/model.py": {"iu"},  # numpy's dtype.kind codes of integers
    "specdec/native/build.py": {"1"},  # SPECDEC_NATIVE_SANITIZE's value
    "specdec/runtime/backend.py": {"0", "", "cpu", "max",  # /proc/self/cgroup's fields, a cgroup controller, cpu.max
                                   "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"},  # glibc's variables
    "specdec/runtime/trt_backend.py": {":"},  # in a device="cuda:N"
    "specdec/runtime/limits.py": {"memory"},  # /proc/self/cgroup's name of a cgroup controller
    "specdec/runtime/generator.py": {"\0"},  # the NUL character, which no path may hold
    "specdec/serving/app.py": {"http.disconnect"},  # an ASGI message type
    "specdec/serving/web.py": {"http", "http.disconnect",  # ASGI scope and message types
                               "POST", "bearer", "]",  # an HTTP method, an Authorization scheme, a Host's [IPv6]
                               "json_invalid", "missing", "body"},  # pydantic's error types and locations
    "specdec/bench/report.py": {"identical", "token_agreement"},  # column names
    "specdec/cli/export.py": {"--draft-layers"},  # a flag
    "specdec/runtime/text.py": {"BPE", "Sequence", "ByteLevel", "Removed"},  # tokenizer.json's model, normalizer and
                                                                               # pre-tokenizer types, a Split behaviour
    "specdec/serving/ray_app.py": {"Z"},  # /proc/PID/stat's state of a zombie
}


def _literals(side: ast.expr) -> list:
    """The string literals of one side of a comparison: the side itself, or the items of a literal tuple, list or
    set."""
    items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
    return [item.value for item in items if isinstance(item, ast.Constant) and isinstance(item.value, str)]


def string_comparisons(source: str) -> list:
    """(line, literal) of every string literal that `source` compares with."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for op, left, right in zip(node.ops, sides, sides[1:]):
                if isinstance(op, OPERATORS):
                    found += [(node.lineno, literal) for literal in _literals(left) + _literals(right)]
        elif isinstance(node, ast.MatchValue):
            found += [(node.lineno, literal) for literal in _literals(node.value)]
    return found


FOUND = {path.relative_to(ROOT).as_posix(): string_comparisons(path.read_text(encoding="utf-8"))
         for path in sorted(PACKAGE.rglob("*.py"))}


def test_the_source_is_read():
    assert len(FOUND) > 50 and "specdec/runtime/loop.py" in FOUND
    assert string_comparisons('if config.coupling == "gumbel" or "x" in y or role not in ("target", other): pass\n'
                              'match kind:\n    case "int4": pass\n') == [(1, "gumbel"), (1, "x"), (1, "target"),
                                                                          (3, "int4")]
    assert string_comparisons("if config.coupling == Coupling.GUMBEL or name.startswith('x'): pass") == []


def test_no_kind_is_compared_as_a_string():
    compared = [f"{rel}:{line}: {literal!r}" for rel, hits in FOUND.items() for line, literal in hits
                if literal not in ALLOWED.get(rel, ())]
    assert not compared, ("compare a kind as its object (an enum member, a registry entry, a property of it), not as "
                          "a string; a string that is no kind goes into ALLOWED with why:\n" + "\n".join(compared))


def test_every_allowed_literal_is_still_compared():
    """An entry outlives its comparison only as a hole a kind could slip through: it goes with the code."""
    used = {(rel, literal) for rel, hits in FOUND.items() for _, literal in hits}
    assert not sorted((rel, literal) for rel, literals in ALLOWED.items() for literal in literals
                      if (rel, literal) not in used)
