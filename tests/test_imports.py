"""The package's import graph has no circles, no module reaches into another's private
names, and nothing outside the engine reads the engine's private fields.

Every ``import`` / ``from ... import`` in ``recpipe/`` counts, at module level and inside
functions (an import moved into a function to dodge a circle is still a circle), and so
do imports under ``if TYPE_CHECKING:`` (a circle of types is a circle of the design) and
the names a package loads on first use (``_EXPORTS``: ``recpipe.pipelines``). A
package's ``__init__`` is a node of its own: importing ``recpipe.pipelines.schedule``
runs ``recpipe/pipelines/__init__.py`` first, so that file imports nothing of the
package eagerly. A dotted path in data (a pipeline's engine class, a speed feature's
``apply``, ``model.factory``) is not an import: it is loaded by name when something is
built, from above.
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


def _is_exports(node: ast.AST) -> bool:
    """``_EXPORTS = {name: "recpipe.module", ...}``: a package's names loaded on first use."""
    return (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
            and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets))


def _imports(module: str) -> tuple[set[str], list[str]]:
    """(the recpipe modules ``module`` imports, its uses of other modules' private names)."""
    tree = ast.parse(MODULES[module].read_text())
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    edges: set[str] = set()
    private: list[str] = []
    aliases: dict[str, str] = {}  # local name -> recpipe module

    def visit(node: ast.AST) -> None:
        if _is_exports(node):  # names loaded on first use: imports all the same
            for value in node.value.values:
                target = _resolve(value.value) if isinstance(value, ast.Constant) else None
                if target:
                    edges.add(target)
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


def _engine_private_fields() -> set[str]:
    """The private attributes and methods of the engine's ``Pipeline`` (recpipe/pipelines/engine.py)."""
    tree = ast.parse(MODULES["recpipe.pipelines.engine"].read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Pipeline")
    names = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
    names |= {t.attr for n in ast.walk(cls) if isinstance(n, (ast.Assign, ast.AnnAssign))
              for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
              if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _reads_of(fields: set[str], module: str) -> list[str]:
    tree = ast.parse(MODULES[module].read_text())
    return [f"{module}:{n.lineno}: .{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in fields]


def test_nothing_outside_the_engine_reads_its_private_fields():
    """Steps, pipeline classes, the evaluation and speed features use the engine through
    its step context and public methods (recpipe.pipelines.context): 0 reads of the
    engine's private fields anywhere else in the package."""
    fields = _engine_private_fields()
    assert {"_slots", "_recent", "_plan", "_fetch"} <= fields  # the checker sees the engine's state
    reads = [r for m in MODULES if m != "recpipe.pipelines.engine" for r in _reads_of(fields, m)]
    assert not reads, f"{len(reads)} reads of the engine's private fields:\n" + "\n".join(reads)


def test_the_checkers_see_type_checking_imports_lazy_names_and_private_reads(tmp_path):
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from recpipe.config import RecpipeConfig\n"
              "_EXPORTS = {'Pipeline': 'recpipe.pipelines.engine'}\n")
    node = ast.parse(source)
    assert _is_exports(node.body[2])
    MODULES["recpipe._probe"] = path = tmp_path / "probe.py"
    path.write_text(source + "def f(pipe):\n    return pipe._slots\n")
    try:
        edges, _ = _imports("recpipe._probe")
        assert {"recpipe.config", "recpipe.pipelines.engine"} <= edges
        assert _reads_of({"_slots"}, "recpipe._probe") == ["recpipe._probe:6: ._slots"]
    finally:
        del MODULES["recpipe._probe"]

