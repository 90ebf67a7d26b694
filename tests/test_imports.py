"""The package's import graph has no circles, and no module reaches into another's
private names.

Every ``import`` / ``from ... import`` in ``recpipe/`` counts, at module level and inside
functions (an import moved into a function to dodge a circle is still a circle);
imports under ``if TYPE_CHECKING:`` do not (they never run). A package's ``__init__``
is a node of its own: importing ``recpipe.pipelines.schedule`` runs
``recpipe/pipelines/__init__.py`` first, so that file imports nothing of the package
eagerly (recpipe.pipelines loads its public names on first use).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "recpipe"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _resolve(name: str) -> str | None:
    """The recpipe module a dotted name lives in (a module, or the package defining it)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str) -> tuple[set[str], list[str]]:
    """(the recpipe modules ``module`` imports, its uses of other modules' private names)."""
    tree = ast.parse(MODULES[module].read_text())
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    edges: set[str] = set()
    private: list[str] = []
    aliases: dict[str, str] = {}  # local name -> recpipe module

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                target = _resolve(a.name)
                if target and a.name.startswith("recpipe"):
                    edges.add(target)
                    aliases[a.asname or a.name] = target
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            if base.startswith("recpipe"):
                for a in node.names:
                    full = f"{base}.{a.name}"
                    target = full if full in MODULES else _resolve(base)
                    if target:
                        edges.add(target)
                    if full in MODULES:
                        aliases[a.asname or a.name] = full
                    elif a.name.startswith("_") and not a.name.startswith("__"):
                        private.append(f"{module}: from {base} import {a.name}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            target = aliases.get(node.value.id)
            if target and target != module and node.attr.startswith("_") and not node.attr.startswith("__"):
                private.append(f"{module}: {node.value.id}.{node.attr} ({target})")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    edges.discard(module)
    return edges, private


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_no_import_circles_and_no_private_names_across_modules():
    graph, private = {}, []
    for module in MODULES:
        graph[module], uses = _imports(module)
        private += uses
    assert not _cycles(graph), f"import circles: {_cycles(graph)}"
    assert not private, "private names used across modules:\n" + "\n".join(private)


def test_the_checker_sees_circles_and_private_names():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
