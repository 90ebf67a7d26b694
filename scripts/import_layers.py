"""recpipe's import graph: the module-level import cycles and the folder-level cycles.

    python scripts/import_layers.py

Every module under ``recpipe/`` is parsed with ``ast``; every ``import`` counts, at module
level, inside functions (an import moved into a function to dodge a circle is still a
circle) and under ``if TYPE_CHECKING:`` (a circle of types is a circle of the design), and
so do the names a package loads on first use (``_EXPORTS``: ``recpipe.pipelines``). A
package's ``__init__`` is a node of its own, and importing ``recpipe.planner.plan``
from outside ``recpipe.planner`` runs ``recpipe/planner/__init__.py`` first: an edge to that
package too. A dotted path in data (a pipeline's engine class, a speed feature's
``apply``, ``model.factory``) is not an import: it is loaded by name when something is
built, from above.

Modules map to units: ``recpipe/<folder>/...`` is the unit ``<folder>``; a top-level module
(``recpipe/preflight.py``) is a unit of its own. A folder-level cycle is a strongly
connected component of more than one unit in the graph of units. tests/test_layers.py
fails on any module-level cycle and on a folder-level cycle outside its allow-list.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "recpipe"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def resolve(name: str) -> str | None:
    """The recpipe module a dotted name lives in (a module, or the package defining it)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def is_exports(node: ast.AST) -> bool:
    """``_EXPORTS = {name: "recpipe.module", ...}``: a package's names loaded on first use."""
    return (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
            and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets))


def is_lazy(package: str) -> bool:
    """A package that loads its names on first use (``_EXPORTS``) and imports nothing of recpipe eagerly."""
    return any(is_exports(node) for node in ast.parse(MODULES[package].read_text()).body)


def _packages_run_first(module: str, target: str) -> set[str]:
    """The packages whose ``__init__`` importing ``target`` runs, that ``module``'s import has not
    already run (its own packages), leaving out the lazy ones, whose ``__init__`` imports nothing."""
    own = {module.rsplit(".", n)[0] for n in range(module.count(".") + 1)}
    parts = target.split(".")
    packages = (".".join(parts[:n]) for n in range(2, len(parts)))
    return {p for p in packages if p not in own and p in MODULES and not is_lazy(p)}


def imports(module: str) -> tuple[set[str], list[str]]:
    """(the recpipe modules ``module`` imports, its uses of other modules' private names)."""
    tree = ast.parse(MODULES[module].read_text())
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    edges: set[str] = set()
    private: list[str] = []
    aliases: dict[str, str] = {}  # local name -> recpipe module

    def visit(node: ast.AST) -> None:
        if is_exports(node):  # names loaded on first use: imports all the same
            for value in node.value.values:
                target = resolve(value.value) if isinstance(value, ast.Constant) else None
                if target:
                    edges.add(target)
        if isinstance(node, ast.Import):
            for a in node.names:
                target = resolve(a.name)
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
                    target = full if full in MODULES else resolve(base)
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
    for target in list(edges):
        edges |= _packages_run_first(module, target)
    edges.discard(module)
    return edges, private


def module_graph() -> dict[str, set[str]]:
    return {module: imports(module)[0] for module in MODULES}


def unit(module: str) -> str:
    """``recpipe.planner.plan`` -> ``planner``; ``recpipe.preflight`` -> ``preflight``; ``recpipe`` -> ``recpipe``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for module, targets in graph.items():
        units.setdefault(unit(module), set()).update(unit(t) for t in targets)
    return {u: targets - {u} for u, targets in units.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
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
    return sorted(out)


def edges_within(component: list[str], graph: dict[str, set[str]], modules: dict[str, set[str]]) -> list[str]:
    """The module imports behind a folder-level cycle's edges: ``a.b -> c.d``."""
    members = set(component)
    return sorted(f"{m} -> {t}" for m, targets in modules.items() for t in targets
                  if unit(m) in members and unit(t) in members and unit(m) != unit(t))


def main() -> int:
    modules = module_graph()
    folders = folder_graph(modules)
    module_cycles, folder_cycles = cycles(modules), cycles(folders)
    print(f"{len(module_cycles)} module-level import cycles")
    for component in module_cycles:
        print("  " + " <-> ".join(component))
    print(f"{len(folder_cycles)} folder-level cycles")
    for component in folder_cycles:
        print("  " + " <-> ".join(component))
        for edge in edges_within(component, folders, modules):
            print("    " + edge)
    return 1 if module_cycles else 0


if __name__ == "__main__":
    sys.exit(main())
