"""The tree's shape, as issues 36 and 51 set it: no import circle among the
Rust modules nor among the Python modules (imports inside functions count),
the model layer never reaching up to the engine or the server, the base
layer (the special-token registry, the tokenizer, the model catalogue)
importing nothing above it, no source file so long that its concerns blur
(Python over 450 lines, Rust over 900 outside its tests), and a README of at
most 180 lines.

Read from the sources with the standard library only: `ast` for Python
(imports anywhere, outside `if TYPE_CHECKING:`), `crate::` paths for Rust
(code after a file's `#[cfg(test)]` and the `*_tests.rs` files are tests).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = ROOT / "python"
RUST = ROOT / "rust"
MAX_PY_LINES = 450
MAX_RUST_LINES = 900


# ---- Python -------------------------------------------------------------

def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PY).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PY.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, name: str, modules: dict[str, Path], top_level_only: bool) -> set[str]:
    """The guided modules `name` imports: at module level only, or anywhere."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def resolve(base: str, names: list[str]) -> None:
        for n in names:   # `from pkg import mod` imports the module; else the package
            found.add(f"{base}.{n}" if f"{base}.{n}" in modules else base)

    def visit(nodes) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node):
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                resolve(base, [a.name for a in node.names])
            if top_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            visit(ast.iter_child_nodes(node))

    visit(tree.body)
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component that has one (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def _python_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        # a package's __init__ runs before its submodules: a submodule importing
        # its own package (or an ancestor) at load is what Python resolves itself
        graph[name] = {m for m in _imports(path, name, modules, top_level_only=False)
                       if not name.startswith(m + ".")}
    return graph


def test_no_import_circle_among_python_modules():
    assert _cycles(_python_graph()) == []


def test_the_base_layer_imports_nothing_above_it():
    modules = _modules()
    base = ("guided.special_tokens", "guided.tokenizer", "guided.models")
    above = ("guided.chat", "guided.grammar", "guided.model", "guided.engine", "guided.llm", "guided.serve")
    reaching = {name: sorted(m for m in _imports(modules[name], name, modules, top_level_only=False)
                             if m.startswith(above)) for name in base}
    assert {k: v for k, v in reaching.items() if v} == {}


def test_the_readme_is_at_most_180_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 180


def test_the_model_layer_does_not_import_the_engine_or_the_server():
    modules = _modules()
    above = ("guided.engine", "guided.llm", "guided.serve")
    reaching = {name: sorted(m for m in _imports(path, name, modules, top_level_only=False)
                             if m.startswith(above))
                for name, path in modules.items() if name.startswith("guided.model")}
    assert {k: v for k, v in reaching.items() if v} == {}


def test_no_python_source_file_is_too_long():
    long = {str(p.relative_to(ROOT)): n for p in PY.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_PY_LINES}
    assert long == {}


# ---- Rust -----------------------------------------------------------------

def _rust_code(path: Path) -> str:
    """The file's code before its tests (`#[cfg(test)]` at the start of a line)."""
    text = path.read_text()
    cut = re.search(r"^#\[cfg\(test\)\]", text, re.M)
    return text[:cut.start()] if cut else text


def _rust_graph() -> dict[str, set[str]]:
    files = {p.stem: p for p in RUST.glob("*.rs") if not p.stem.endswith("_tests") and p.stem != "build"}
    graph = {}
    for name, path in files.items():
        code = re.sub(r"//[^\n]*", "", _rust_code(path))   # comments name modules too
        used = set(re.findall(r"\bcrate::(\w+)", code))
        used |= {m for group in re.findall(r"\bcrate::\{([^}]*)\}", code) for m in re.findall(r"\b(\w+)\b", group)}
        graph[name] = {m for m in used if m in files and m != name}
    return graph


def test_no_import_circle_among_rust_modules():
    graph = _rust_graph()
    assert graph["scheduler"] and graph["python"], graph   # the reading finds the edges there are
    assert _cycles(graph) == []


def test_no_rust_file_is_too_long_outside_its_tests():
    long = {p.name: n for p in RUST.glob("*.rs")
            if not p.stem.endswith("_tests") and (n := len(_rust_code(p).splitlines())) > MAX_RUST_LINES}
    assert long == {}


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
