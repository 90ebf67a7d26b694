"""recpipe's layers: no module-level import cycle and no folder-level one
(``scripts/import_layers.py`` builds the graphs and prints both).

A folder (``recpipe/<folder>/``) or a top-level module is a unit; a folder-level cycle is a
set of units that import one another round a loop, module by module acyclic but not layered.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from scripts.import_layers import MODULES, cycles, folder_graph, imports, is_lazy, module_graph


def test_no_module_level_import_cycles():
    assert cycles(module_graph()) == [], "module-level import cycles (python scripts/import_layers.py)"


def test_no_folder_level_import_cycles():
    assert cycles(folder_graph(module_graph())) == [], "folder-level import cycles (python scripts/import_layers.py)"



def _layers() -> dict[str, int]:
    """docs/architecture.md's layer table: unit -> layer (``recpipe`` for the package's ``__init__``)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    layers = {}
    for number, units in re.findall(r"^\| (\d+) \| (.*) \|$", text, re.M):
        for name in re.findall(r"`([^`]+)`", units):
            layers["recpipe" if name == "__init__" else name.rstrip("/")] = int(number)
    return layers


def test_every_unit_imports_only_its_layer_or_below():
    """Every folder and top-level module has a line in the architecture page's layer table, and
    no import goes from a lower line to a higher one."""
    layers, folders = _layers(), folder_graph(module_graph())
    assert sorted(set(folders) - set(layers)) == [], "units missing from docs/architecture.md's layer table"
    upward = sorted(f"{u} ({layers[u]}) -> {t} ({layers[t]})" for u, ts in folders.items() for t in ts
                    if layers[u] < layers[t])
    assert upward == [], upward

def test_pipelines_and_speed_features_sit_side_by_side_on_the_runtime():
    """Neither ``pipelines/`` nor ``speedups/`` imports the other, and ``runtime/``, which
    both are built on, imports neither, nor anything that reads the config."""
    folders = folder_graph(module_graph())
    assert "speedups" not in folders["pipelines"] and "pipelines" not in folders["speedups"]
    assert folders["runtime"] & {"pipelines", "speedups", "pipeline_options", "config", "builder", "distributed"} == set()


def test_lazy_packages_import_nothing_eagerly():
    """A package with ``_EXPORTS`` loads its names on first use, so importing one of its
    modules runs no other: its ``__init__`` imports nothing of recpipe outside
    ``if TYPE_CHECKING:`` (the checker then adds no edge for running it)."""
    for name, path in MODULES.items():
        if path.name == "__init__.py" and is_lazy(name):
            eager = [ast.unparse(n) for n in ast.parse(path.read_text()).body if _imports_recpipe(n)]
            assert eager == [], f"{name} imports eagerly: {eager}"


def _imports_recpipe(node: ast.stmt) -> bool:
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").startswith("recpipe") or node.level > 0
    return isinstance(node, ast.Import) and any(a.name.startswith("recpipe") for a in node.names)


def test_the_checker_sees_cycles_and_hidden_loops_through_a_package(tmp_path):
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert folder_graph({"recpipe.x.m": {"recpipe.y.n"}, "recpipe.y.n": {"recpipe.top"}, "recpipe.top": set()}) == {
        "x": {"y"}, "y": {"top"}, "top": set()}
    # recpipe.planner.plan, imported from outside recpipe.planner, runs recpipe/planner/__init__.py first
    MODULES["recpipe._probe"] = path = tmp_path / "probe.py"
    path.write_text("from recpipe.planner.plan import check_fits\n")
    try:
        assert {"recpipe.planner.plan", "recpipe.planner"} <= imports("recpipe._probe")[0]
        path.write_text("from recpipe.pipelines.registry import PIPELINES\n")  # a lazy package: its __init__ runs nothing
        assert imports("recpipe._probe")[0] == {"recpipe.pipelines.registry"}
    finally:
        del MODULES["recpipe._probe"]


# Uses of torch's, torchrec's and fbgemm-gpu's private names outside recpipe/compat/, per file
# (python scripts/private_names.py --list): none; every one goes through an accessor there.
PRIVATE_NAMES_OUTSIDE_COMPAT: dict[str, int] = {}


def test_private_library_names_stay_in_compat():
    from scripts.private_names import outside_seam, scan

    found = {path: len(uses) for path, uses in outside_seam(scan()).items()}
    grown = {p: n for p, n in found.items() if n > PRIVATE_NAMES_OUTSIDE_COMPAT.get(p, 0)}
    assert grown == {}, f"private library names outside recpipe/compat/ (python scripts/private_names.py --list): {grown}"
    assert found == PRIVATE_NAMES_OUTSIDE_COMPAT, "fewer uses than listed: lower PRIVATE_NAMES_OUTSIDE_COMPAT"
