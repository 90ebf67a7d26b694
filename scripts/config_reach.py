"""The functions of recpipe that take the whole config, file by file.

    python scripts/config_reach.py           # per file, and the total
    python scripts/config_reach.py --list    # every function too

A function is an assembly point of the config when it takes the whole ``RecpipeConfig``
rather than the section (``cfg.data``, ``cfg.model``, ...) or the small value object it
needs. Every module under ``recpipe/`` is parsed with ``ast``; a function or method
(nested ones included) takes the whole config when one of its parameters

* is annotated with ``RecpipeConfig`` (``RecpipeConfig``, ``"RecpipeConfig"``,
  ``RecpipeConfig | None``, ...), or
* is named ``cfg`` or ``config``, has no annotation or ``Any``, and the function's own body
  reads two or more of the config's top-level sections off it (``cfg.data`` and
  ``cfg.model``): the fields of ``RecpipeConfig`` in ``recpipe/config.py``.

A parameter annotated with a section (``cfg: DataConfig``) is not the whole config.
tests/test_config_reach.py holds ``recpipe/data/`` and ``recpipe/planner/`` to their assembly
points and the total to its figure.
"""

from __future__ import annotations

import argparse
import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "recpipe"
WHOLE = "RecpipeConfig"
NAMES = ("cfg", "config")


def sections() -> set[str]:
    """The top-level fields of ``RecpipeConfig``, read off ``recpipe/config.py``."""
    tree = ast.parse((ROOT / "config.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == WHOLE)
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _names_whole(annotation: ast.expr) -> bool:
    text = annotation.value if isinstance(annotation, ast.Constant) else ast.unparse(annotation)
    return isinstance(text, str) and WHOLE in text.replace("'", "").replace('"', "").replace("|", " ").split()


def _untyped(annotation: ast.expr | None) -> bool:
    return annotation is None or ast.unparse(annotation) in ("Any", "typing.Any", "object", "'Any'")


def _sections_read(fn: ast.AST, name: str, known: set[str]) -> set[str]:
    return {n.attr for n in ast.walk(fn)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == name and n.attr in known}


def takes_whole_config(fn: ast.FunctionDef | ast.AsyncFunctionDef, known: set[str]) -> bool:
    a = fn.args
    for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
        if arg.annotation is not None and _names_whole(arg.annotation):
            return True
        if arg.arg in NAMES and _untyped(arg.annotation) and len(_sections_read(fn, arg.arg, known)) >= 2:
            return True
    return False


def _functions(tree: ast.AST, prefix: str = ""):
    """Every function of a module, with its qualified name (``Class.method``, ``outer.inner``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


def reach(root: Path = ROOT) -> dict[str, list[str]]:
    """``{"recpipe/data/loader.py": ["make_dataloader", ...]}``: the functions of each file
    that take the whole config (files with none are left out)."""
    known = sections()
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for name, fn in _functions(tree):
            if takes_whole_config(fn, known):
                found[path.relative_to(root.parent).as_posix()].append(name)
    return dict(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every function, not only the counts")
    args = parser.parse_args(argv)
    found = reach()
    for path, names in found.items():
        print(f"{len(names):4d}  {path}")
        if args.list:
            for name in names:
                print(f"        {name}")
    print(f"{sum(map(len, found.values())):4d}  functions in {len(found)} files take the whole config")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
