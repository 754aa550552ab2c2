"""The tree's shape, as issues 36, 51 and 63 set it: no import circle among
the Rust modules nor among the Python modules (imports inside functions
count), the model layer never reaching up to the engine or the server, the
base layer (the special-token registry, the tokenizer, the model catalogue)
importing nothing above it, rust/'s folders as layers (`RUST_LAYERS`: each
imports only the folders listed for it; only the bindings name the bindings),
no file stem shared between rust/ and python/ or cuda/ (a Rust file named by
its role: `native_step.rs`, not a second `decoder`), no source file so long
that its concerns blur (Python over 450 lines, Rust over 900 outside its
tests), and a README of at most 180 lines.

Read from the sources with the standard library only: `ast` for Python
(imports anywhere, outside `if TYPE_CHECKING:`), `crate::` and `super::`
paths for Rust (`use` groups expanded; a module is its crate path,
`engine::scheduler`; code after a file's `#[cfg(test)]` and the
`*_tests.rs` files are tests: left out of the circle check, read by the
layer check).
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

#: The Rust folders as layers: what each may import besides itself (lib.rs,
#: the crate root that declares them, excepted). Only the bindings name the
#: bindings; the core layers import nothing of each other but what is listed.
RUST_LAYERS: dict[str, set[str]] = {
    "threads": set(),     # the pool the step's short parallel loops share
    "cpu": {"threads"},   # the native CPU step and its kernels
    "sampling": {"threads"},   # the seeded random stream, the CPU sampler
    "grammar": set(),     # llguidance's matchers, the closing search
    "cuda": {"cpu", "sampling"},            # launchers, CPU references, device rows
    "engine": {"grammar", "sampling", "cuda", "threads"},   # the scheduler and what it schedules
    "bindings": {"cpu", "sampling", "grammar", "cuda", "engine"},   # PyO3, translation only
}
#: Stems a Rust file may share with a Python or CUDA file, for the one concept
#: both files are (stem: why). None: a stem names one thing in the whole tree.
SHARED_STEMS: dict[str, str] = {}


def _rust_code(path: Path) -> str:
    """The file's code before its tests (`#[cfg(test)]` at the start of a line)."""
    text = path.read_text()
    cut = re.search(r"^#\[cfg\(test\)\]", text, re.M)
    return text[:cut.start()] if cut else text


def _rust_module(path: Path) -> str:
    """A file's crate path: rust/engine/scheduler.rs → `engine::scheduler`,
    rust/cpu/mod.rs → `cpu`, rust/lib.rs → `` (the crate root)."""
    parts = list(path.relative_to(RUST).with_suffix("").parts)
    if parts[-1] in ("mod", "lib"):
        parts.pop()
    return "::".join(parts)


def _rust_modules() -> dict[str, Path]:
    """Every module file but the build script and the `*_tests.rs` files
    (tests, included by their module through `#[path]`)."""
    return {_rust_module(p): p for p in RUST.rglob("*.rs")
            if not p.stem.endswith("_tests") and p != RUST / "build.rs"}


def _use_paths(code: str, module: str) -> set[str]:
    """The absolute paths (`engine::scheduler::Error`) that `code` names from
    `crate::` or `super::`, `{...}` groups expanded (nested too)."""
    found: set[str] = set()

    def tree(i: int, prefix: list[str]) -> int:
        """Reads the use tree at code[i:] under `prefix`; returns where it ends."""
        while True:
            m = re.match(r"\s*(\w+)\s*(::)?", code[i:])
            if m:
                i += m.end()
                if m.group(1) == "self":
                    found.add("::".join(prefix))
                    return i
                prefix = prefix + [m.group(1)]
                if not m.group(2):
                    found.add("::".join(prefix))
                    return i
                continue
            m = re.match(r"\s*\{", code[i:])
            if not m:   # `*` or the end of a path
                found.add("::".join(prefix))
                return i
            i += m.end()
            while True:
                i = tree(i, prefix)
                m = re.match(r"\s*(,|\})", code[i:])
                if not m:
                    return i
                i += m.end()
                if m.group(1) == "}":
                    return i
                if re.match(r"\s*\}", code[i:]):   # a trailing comma
                    return i + re.match(r"\s*\}", code[i:]).end()

    parent = module.split("::")[:-1] if module else []
    for m in re.finditer(r"\b(crate|super)::", code):
        tree(m.end(), [] if m.group(1) == "crate" else parent)
    return found


def _rust_imports(code: str, module: str, modules: set[str]) -> set[str]:
    """The modules `code` (of `module`) uses: each path's longest prefix that
    is a module, the module itself and its ancestors (the folders that
    declare it) left out."""
    code = re.sub(r"//[^\n]*", "", code)   # comments name modules too
    used = set()
    for path in _use_paths(code, module):
        parts = path.split("::")
        for n in range(len(parts), 0, -1):
            if (prefix := "::".join(parts[:n])) in modules:
                used.add(prefix)
                break
    return {m for m in used if m != module and not module.startswith(m + "::")}


def _rust_graph(with_tests: bool = False) -> dict[str, set[str]]:
    """Module → the modules it uses: its code before its tests, or (with_tests)
    all of it and its `*_tests.rs` files too."""
    modules = _rust_modules()
    graph = {}
    for name, path in modules.items():
        if not name:
            continue   # lib.rs declares the layers; it imports none
        code = path.read_text() if with_tests else _rust_code(path)
        if with_tests:
            code += "".join(p.read_text() for p in path.parent.glob(f"{path.stem}_tests.rs"))
        graph[name] = _rust_imports(code, name, set(modules))
    return graph


def _layer_breaches(graph: dict[str, set[str]], layers: dict[str, set[str]]) -> list[str]:
    """`a -> b` for each use that crosses from a folder into one its layer
    may not import (a module outside every folder is a breach too)."""
    found = []
    for name, used in sorted(graph.items()):
        top = name.split("::")[0]
        for m in sorted(used):
            to = m.split("::")[0]
            if top not in layers or (to != top and to not in layers[top]):
                found.append(f"{name} -> {m}")
    return found


def test_no_import_circle_among_rust_modules():
    graph = _rust_graph()
    # the reading finds the edges there are, through groups and nested groups
    assert "grammar::matchers" in graph["engine::scheduler"], graph["engine::scheduler"]
    assert "engine::scheduler" in graph["bindings::python"], graph["bindings::python"]
    assert _cycles(graph) == []


def test_rust_folders_import_only_the_layers_below_them():
    folders = {p.name for p in RUST.iterdir() if p.is_dir()}
    assert folders == set(RUST_LAYERS), "a new folder of rust/ needs its row in RUST_LAYERS"
    loose = sorted(p.name for p in RUST.glob("*.rs") if p.name not in ("lib.rs", "build.rs"))
    assert loose == [], "every module lives in a folder (its layer)"
    assert _layer_breaches(_rust_graph(with_tests=True), RUST_LAYERS) == []


def test_the_rust_reading_and_the_layer_check_can_fail():
    code = "use crate::cpu::{pool::{self, SendPtr}, simd};\nuse super::x::Y;\nfn f() { crate::engine::scheduler::go() }"
    assert _use_paths(code, "cuda::launchers") == {"cpu::pool", "cpu::pool::SendPtr", "cpu::simd",
                                                 "cuda::x::Y", "engine::scheduler::go"}
    modules = {"cpu", "cpu::pool", "cpu::simd", "cuda", "cuda::x", "engine::scheduler"}
    assert _rust_imports(code, "cuda::launchers", modules) == {"cpu::pool", "cpu::simd", "cuda::x", "engine::scheduler"}
    layers = {"cpu": set(), "cuda": {"cpu"}}
    graph = {"cuda::launchers": {"cpu::pool", "cuda::x", "engine::scheduler"}, "cpu::pool": {"cuda::x"}, "loose": set()}
    assert _layer_breaches(graph, layers) == ["cpu::pool -> cuda::x", "cuda::launchers -> engine::scheduler"]
    assert _layer_breaches({"loose": {"cpu"}}, layers) == ["loose -> cpu"]


def test_no_rust_file_is_too_long_outside_its_tests():
    long = {str(p.relative_to(ROOT)): n for p in RUST.rglob("*.rs")
            if not p.stem.endswith("_tests") and (n := len(_rust_code(p).splitlines())) > MAX_RUST_LINES}
    assert long == {}


def _shared_stems() -> dict[str, list[str]]:
    """Stems of rust/**/*.rs (the crate root, folder roots and the build
    script aside) that a python/**/*.py or cuda/ file also has."""
    rust = {p.stem: p for p in RUST.rglob("*.rs") if p.stem not in ("lib", "mod", "build")}
    others = [*PY.rglob("*.py"), *(ROOT / "cuda").glob("*.cu"), *(ROOT / "cuda").glob("*.cuh")]
    shared: dict[str, list[str]] = {}
    for p in others:
        if p.stem in rust:
            shared.setdefault(p.stem, [str(rust[p.stem].relative_to(ROOT))]).append(str(p.relative_to(ROOT)))
    return shared


def test_a_file_name_says_one_thing_across_languages():
    # decoder.py (the torch executor) and decoder.rs (the native CPU step)
    # were two things under one name; a Rust file is named by its role
    shared = _shared_stems()
    assert {s: f for s, f in shared.items() if s not in SHARED_STEMS} == {}
    assert set(SHARED_STEMS) <= set(shared), "an allowed pair that no longer exists"


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
