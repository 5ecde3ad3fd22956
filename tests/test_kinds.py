"""Kinds are objects, read from the source (CONTRIBUTING.md): a drafter, backend, coupling, role, precision, weight
layout or any other kind is compared as an enum member or a registry entry, never as a bare string, and held as one.

So no comparison in specdec/ (==, !=, in, not in, or a match case) has a string literal on a side, nor a literal
tuple, list, set or dict holding one, nor a module constant bound to such a collection (`x in NAMES`); and no string
that names a kind (the value of an enum member of specdec/) is a dataclass field's or a parameter's default, a
class attribute, a dict literal's key or an item of a literal tuple, list or set. The exceptions are the few of
ALLOWED: strings of a protocol or another library, which are no kinds."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specdec"
OPERATORS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)
COLLECTIONS = (ast.Tuple, ast.List, ast.Set)
ENUMS = {"Enum", "StrEnum"}
NOT_KINDS = set()  # enums of another library's names

ALLOWED = {  # file -> the literals it may compare or hold, and why none of them is a kind
    "specdec/__init__.py": {"GenerationConfig", "GenerationResult", "Generator", "load"},  # lazy attributes (PEP 562)
    "specdec/cli/demo.py": {"__main__"},
    "specdec/calibration/quantize.py": {"__dict__", "__weakref__",  # attributes every class has
                                        "Constant", "Mul", "MatMul",  # ONNX op types
                                        "cpu"},  # a ModelOpt calibration execution provider
    "specdec/calibration/q41.py": {"Gemm", "MatMul", "", "ai.onnx", "com.microsoft"},  # ONNX op types, op domains
    "specdec/engines/tensorrt.py": {"MatMulNBits", "com.microsoft"},  # in TensorRT's parser errors
    "specdec/export/bundle.py": {"NOT_IMPLEMENTED",  # in onnxruntime's error
                                 "onnxruntime"},  # a package whose version the manifest records
    "specdec/engines/cuda_glue.py": {"Device", "Driver"},  # in CUDA's error names
    "specdec/engines/trt_config.py": {".", "0123456789."},  # the characters of a version number
    "specdec/export/tiny.py": {"lm_head"},  # in a transformers module name
    "specdec/export/architectures.py": {"model", "layers",  # transformers' attribute names of a decoder's blocks
                                        "gelu"},  # a Hugging Face activation name (ACT2FN)
    "specdec/export/native_pack.py": {"qkv", "o", "gate_up", "down", "head"},  # tensor names of the native weights
    "specdec/export/native_family.py": {"final_norm_bias", "positions", "layers.0.q_norm"},  # tensor names of the
                                                                                                # native weights file
    "specdec/native/weights.py": {"final_norm_bias", "positions", "layers.0.q_norm"},  # ... the same
    "specdec/export/parity.py": {"prefill", "verify"},  # labels of the parity record's steps
    "specdec/calibration/data.py": {".txt", ".md", ".jsonl", ".parquet",  # file suffixes
                                    "text"},  # the default column of a JSONL or parquet file
    "specdec/cli/calibrate.py": {"text"},  # ... as --field's default
    "specdec/export/sources.py": {".gguf"},
    "specdec/export/head_import.py": {"silu"},  # a transformers config's hidden_act
    "specdec/manifest.py": {"None", "int", "float",  # type names in a dataclass field's annotation
                            "..", "\\"},  # a path that leaves the bundle
    "specdec/native/core.py": {"iu"},  # numpy's dtype.kind codes of integers
    "specdec/native/model.py": {"head", "layers"},  # field names of specdec_native.h's model_t and features_t
    "specdec/native/build.py": {"1",  # SPECDEC_NATIVE_SANITIZE's value
                                "avx2"},  # a flag of /proc/cpuinfo
    "specdec/weight_kinds.py": {"float", "uint8_t", "int8_t", "uint16_t", "f16",  # specdec_kinds.h's C types, bound
                                                                                   # to numpy's dtypes
                                '"', "(", ")", ",",  # the C punctuation the header's reader splits a table's rows at
                                "i64", "q41-draft"},  # the members of TensorKind and LayoutName that no row of the
                                                      # header makes: defined where the enum is, as a class body would
    "specdec/cuda/device.py": {"cuda"},  # the kernel set's label in run records (benchmarks/cuda_check.py)
    "specdec/runtime/backend.py": {"0", "", "cpu", "max",  # /proc/self/cgroup's fields, a cgroup controller, cpu.max
                                   "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"},  # glibc's variables
    "specdec/runtime/trt_backend.py": {":",  # in a device="cuda:N"
                                       "logits"},  # the engine's output tensor name
    "specdec/lowering.py": {"logits"},  # the graphs' output name (the contract's, docs/export.md)
    "specdec/serving/ray_local.py": {"", "0.0.0.0", "[::]", "::"},  # the wildcard addresses a server may bind
    "specdec/runtime/limits.py": {"memory"},  # /proc/self/cgroup's name of a cgroup controller
    "specdec/runtime/generator.py": {"\0"},  # the NUL character, which no path may hold
    "specdec/serving/app.py": {"http.disconnect",  # an ASGI message type
                               "error"},  # the key of an OpenAI error body
    "specdec/serving/metrics.py": {"error"},  # an outcome label of specdec_requests_total
    "specdec/serving/options.py": {"127.0.0.1", "localhost", "::1"},  # loopback host names
    "specdec/serving/schemas.py": {"none", "text",  # OpenAI's tool_choice and response_format values
                                   "model"},  # OpenAI's object type of a model
    "specdec/serving/web.py": {"http", "http.disconnect",  # ASGI scope and message types
                               "bearer", "]",  # an Authorization scheme, a Host's [IPv6]
                               "localhost", "127.0.0.1", "[::1]",  # a Host header's loopback names
                               "json_invalid", "missing", "body"},  # pydantic's error types and locations
    "specdec/bench/report.py": {"identical", "token_agreement"},  # column names
    "specdec/calibration/quality.py": {"model"},  # a column name
    "specdec/bench/config.py": {"max_new_tokens"},  # an option's name
    "specdec/runtime/config.py": {"max_new_tokens"},
    "specdec/cli/export.py": {"--draft-layers"},  # a flag
    "specdec/runtime/text.py": {"BPE", "Sequence", "ByteLevel", "Removed",  # tokenizer.json's model, normalizer and
                                "Metaspace", "Digits", "Punctuation", "Split"},  # pre-tokenizer types, a Split
                                                                                 # behaviour
    "specdec/runtime/prompt_worker.py": {"LD_PRELOAD"},  # an environment variable (the sanitizers' runtimes)
    "specdec/serving/ray_app.py": {"Z",  # /proc/PID/stat's state of a zombie
                                   "", "0.0.0.0", "[::]", "::"},  # the wildcard hosts, its API probed on loopback
}


def kind_names(trees: dict) -> set:
    """The string values of the enum members defined in `trees` (file -> module AST): the names of specdec's kinds."""
    names = set()
    for rel, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and (rel, node.name) not in NOT_KINDS and _is_enum(node):
                names |= {item.value.value for item in node.body if isinstance(item, ast.Assign)
                          and isinstance(item.value, ast.Constant) and isinstance(item.value.value, str)}
    return names


def _is_enum(node: ast.ClassDef) -> bool:
    return any((base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)) in ENUMS for base in node.bases)


def _strings(node) -> list:
    """The string literals of an expression: itself, or the items of a literal tuple, list or set, or a dict's keys
    (also inside frozenset(...), set(...) or tuple(...))."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args and \
            node.func.id in ("frozenset", "set", "tuple"):
        return _strings(node.args[0])
    items = node.elts if isinstance(node, COLLECTIONS) else node.keys if isinstance(node, ast.Dict) else [node]
    return [item.value for item in items if isinstance(item, ast.Constant) and isinstance(item.value, str)]


def constants(trees: dict) -> dict:
    """(module, name) -> the strings of a module-level constant bound to a literal collection of strings."""
    found = {}
    for rel, tree in trees.items():
        for statement in tree.body:
            if isinstance(statement, (ast.Assign, ast.AnnAssign)) and statement.value is not None:
                targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                strings = [] if isinstance(statement.value, ast.Constant) else _strings(statement.value)
                found.update({(_module(rel), t.id): strings for t in targets if isinstance(t, ast.Name) and strings})
    return found


def _module(rel: str) -> str:
    return rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _names(tree: ast.Module, rel: str, known: dict) -> dict:
    """Local name -> the strings of the constant it stands for: the module's own, and those it imports."""
    names = {name: strings for (module, name), strings in known.items() if module == _module(rel)}
    for statement in tree.body:
        if isinstance(statement, ast.ImportFrom) and statement.module:
            names.update({alias.asname or alias.name: known[(statement.module, alias.name)]
                          for alias in statement.names if (statement.module, alias.name) in known})
    return names


def string_comparisons(tree: ast.Module, names: dict | None = None) -> list:
    """(line, literal) of every string literal that the module compares with: on a side of a comparison, in a
    literal collection on a side, or in a constant collection (`names`: local name -> its strings) tested with in."""
    names = names or {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for op, left, right in zip(node.ops, sides, sides[1:]):
                if isinstance(op, OPERATORS):
                    found += [(node.lineno, literal) for literal in _literals(left) + _literals(right)]
                if isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, ast.Name):
                    found += [(node.lineno, literal) for literal in names.get(right.id, ())]
        elif isinstance(node, ast.MatchValue):
            found += [(node.lineno, literal) for literal in _literals(node.value)]
    return found


def _literals(side: ast.expr) -> list:
    return [] if isinstance(side, ast.Dict) else _strings(side)


def _defaults(node) -> list:
    """The defaults a node declares: a function's or lambda's parameters', a class's fields and attributes (not an
    enum's members), a call's `default=` (dataclasses.field's, argparse's)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        return [d for d in node.args.defaults + node.args.kw_defaults if d is not None]
    if isinstance(node, ast.Call):
        return [keyword.value for keyword in node.keywords if keyword.arg == "default"]
    if isinstance(node, ast.ClassDef) and not _is_enum(node):
        return [item.value for item in node.body if isinstance(item, (ast.AnnAssign, ast.Assign)) and item.value]
    return []


def kinds_held(tree: ast.Module, kinds: set) -> list:
    """(line, name) of every kind's name held as a string: a default, a class attribute, a dict key or an item of a
    literal tuple, list or set."""
    found = []
    for node in ast.walk(tree):
        held = [d for d in _defaults(node) if isinstance(d, ast.Constant)]
        if isinstance(node, (ast.Dict, *COLLECTIONS)):
            held = [node]
        found += [(value.lineno, s) for value in held for s in _strings(value) if s in kinds]
    return found


def table_names() -> set:
    """The names of the kinds specdec.weight_kinds reads from specdec_kinds.h (its enums are made from the header's
    table, so the source holds no class of them to read): every weight kind's, element's and layout's."""
    from specdec.weight_kinds import LayoutName, TensorKind, WeightKind

    return {kind.label for kind in WeightKind} | {str(kind) for kind in TensorKind} | {str(n) for n in LayoutName}


TREES = {path.relative_to(ROOT).as_posix(): ast.parse(path.read_text(encoding="utf-8"))
         for path in sorted(PACKAGE.rglob("*.py"))}
KINDS, CONSTANTS = kind_names(TREES) | table_names(), constants(TREES)
FOUND = {rel: sorted(set(string_comparisons(tree, _names(tree, rel, CONSTANTS)) + kinds_held(tree, KINDS)))
         for rel, tree in TREES.items()}


def _found(source: str, kinds=frozenset({"int4", "target", "gumbel"})) -> list:
    tree = ast.parse(source)
    return sorted(set(string_comparisons(tree, _names(tree, "m.py", constants({"m.py": tree})))
                      + kinds_held(tree, kinds)))


def test_the_source_is_read():
    assert len(FOUND) > 50 and "specdec/runtime/loop.py" in FOUND
    assert {"int4", "target", "gumbel", "leviathan", "q41", "blk4", "prompt_lookup"} <= KINDS
    assert not {"GroupQueryAttention", "MatMul"} & KINDS  # ONNX's op types (NOT_KINDS)
    assert _found('if config.coupling == "gumbel" or "x" in y or role not in ("target", other): pass\n'
                  'match kind:\n    case "int4": pass\n') == [(1, "gumbel"), (1, "target"), (1, "x"), (3, "int4")]
    assert _found("if config.coupling == Coupling.GUMBEL or name.startswith('x'): pass") == []


def test_a_kind_held_as_a_string_is_found():
    assert _found('NAMES = ("a", "b")\nif x in NAMES: pass\n') == [(2, "a"), (2, "b")]
    assert _found('from dataclasses import dataclass, field\n@dataclass\nclass C:\n    a: str = "int4"\n'
                  '    b: str = field(default="target")\n    c: str = "text"\n'
                  'parser.add_argument("--how", default="gumbel")\n') == [(4, "int4"), (5, "target"), (7, "gumbel")]
    assert _found('def f(role="target", n="x", *, how="gumbel"): pass\ng = lambda kind="int4": kind\n') == [
        (1, "gumbel"), (1, "target"), (2, "int4")]
    assert _found('TABLE = {"int4": 4, "x": 1}\nPAIR = ("target", 1)\nclass L:\n    name = "gumbel"\n') == [
        (1, "int4"), (2, "target"), (4, "gumbel")]
    assert _found('class K(StrEnum):\n    INT4 = "int4"\nTABLE = {K.INT4: 4}\ndef f(kind=K.INT4): pass\n') == []


def test_no_kind_is_compared_or_held_as_a_string():
    compared = [f"{rel}:{line}: {literal!r}" for rel, hits in FOUND.items() for line, literal in hits
                if literal not in ALLOWED.get(rel, ())]
    assert not compared, ("compare and hold a kind as its object (an enum member, a registry entry, a property of "
                          "it), not as a string; a string that is no kind goes into ALLOWED with why:\n"
                          + "\n".join(compared))


def test_every_allowed_literal_is_still_compared_or_held():
    """An entry outlives its use only as a hole a kind could slip through: it goes with the code."""
    used = {(rel, literal) for rel, hits in FOUND.items() for _, literal in hits}
    assert not sorted((rel, literal) for rel, literals in ALLOWED.items() for literal in literals
                      if (rel, literal) not in used)
