"""The package's import arrows, read from the source (every import statement, at module level or in a function):
the runtime and the native engine import nothing from export, calibration, the CLI or serving; no module below them
imports another that imports it back (no cycle); no backend imports another backend (the registry plans the pair)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specdec"
LOW = ("specdec.runtime", "specdec.native", "specdec.cuda", "specdec.blocks", "specdec.weight_kinds",
       "specdec.weights_file", "specdec.errors", "specdec.manifest", "specdec.head")
UPPER = ("specdec.calibration", "specdec.export", "specdec.cli", "specdec.serving")  # engines: the TensorRT glue
BACKENDS = ("specdec.runtime.ort_backend", "specdec.runtime.native_backend", "specdec.runtime.trt_backend",
            "specdec.runtime.cuda_backend")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imported(name: str) -> set:
    """The specdec modules `name` imports. `from package import module` counts as the module only: a package's
    __init__ runs before any of its modules, whoever imports them."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                head = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(head + ([base] if base else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & MODULES.keys()
            found |= submodules or {base}
    return {module for module in found if module in MODULES and module != name}


GRAPH = {name: imported(name) for name in MODULES}


def below(name: str) -> bool:
    return name.startswith(LOW)


def test_the_graph_is_read():
    assert len(MODULES) > 50
    assert "specdec.runtime.registry" in GRAPH["specdec.runtime.generator"]
    assert "specdec.weights_file" in GRAPH["specdec.native.weights"]
    assert "specdec.weight_kinds" in GRAPH["specdec.blocks"] and "specdec.weight_kinds" in GRAPH["specdec.weights_file"]


def test_the_runtime_and_native_import_nothing_above_them():
    arrows = {name: sorted(m for m in GRAPH[name] if m.startswith(UPPER)) for name in GRAPH if below(name)}
    assert not {name: up for name, up in arrows.items() if up}


def test_no_cycle_below_the_export():
    def reachable(start: str) -> set:
        seen, stack = set(), [start]
        while stack:
            for nxt in GRAPH[stack.pop()]:
                if below(nxt) and nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    assert not [name for name in GRAPH if below(name) and name in reachable(name)]


def test_no_backend_imports_another():
    assert all(not set(BACKENDS) & GRAPH[name] for name in BACKENDS if name in GRAPH)
    assert {"specdec.runtime.ort_backend", "specdec.runtime.native_backend",
            "specdec.runtime.cuda_backend"} <= GRAPH["specdec.runtime.registry"]
