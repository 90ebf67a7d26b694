"""recpipe's reads of torch's, torchrec's and fbgemm-gpu's private names, per file.

    python scripts/private_names.py            # counts per file, and the total
    python scripts/private_names.py --list     # every use, file:line

Every module under ``recpipe/`` is parsed with ``ast``. A private name is one that starts
with an underscore and is not a dunder (``_pg``, ``_get_recat``). A use counts when the
name belongs to one of the libraries (``LIBRARIES``):

- an import whose module path or imported name is private: ``from torch._dynamo.utils
  import counters``, ``from torch.optim.optimizer import _global_optimizer_pre_hooks``;
- an attribute ``obj._x`` (read, write or delete), or ``getattr``/``setattr``/``hasattr``/
  ``delattr(obj, "_x")``, or ``getattr(obj, "_" + name)``, or ``vars(obj)["_x"]``, unless
  the object is recpipe's own: ``self._x``/``cls._x`` in a recpipe class that subclasses no
  library class, a recpipe module's ``_x``, or an ``_x`` recpipe itself defines on its
  classes (``self._x = ...``, a method or class attribute named ``_x``). An object bound to
  the standard library (``os._exit``) is not a library's;
- a string that names a library's private module or attribute (``"torch.fx._symbolic_trace"``,
  a logger's name).

recpipe/compat/ is the one place allowed to do any of this (docs/architecture.md, "The
seam to the libraries"); tests/test_layers.py fails on a use anywhere else.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "recpipe"
LIBRARIES = ("torch", "torchrec", "fbgemm_gpu")
SEAM = "compat"  # recpipe/compat/: the one folder allowed to use them
_PRIVATE_STRING = re.compile(r"^(%s)(\.\w+)*\._[A-Za-z]\w*" % "|".join(LIBRARIES))
_ACCESSORS = {"getattr", "setattr", "hasattr", "delattr"}


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _top(dotted: str) -> str:
    return dotted.split(".")[0]


def _library_base_source(module: str, name: str) -> str:
    """The source of every library class in the MRO of ``module.name`` (a class recpipe
    subclasses), or "" when it cannot be found."""
    import importlib
    import inspect

    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
        texts = []
        for cls in inspect.getmro(obj):
            if _top(cls.__module__) in LIBRARIES:
                try:
                    texts.append(inspect.getsource(cls))
                except (OSError, TypeError):
                    pass
        return "\n".join(texts)
    except Exception:  # noqa: BLE001 - an unresolvable base counts as a library class with no known fields
        return ""


def _class_names(cls: ast.ClassDef) -> set[str]:
    """The private names a class defines itself: methods, class attributes, ``self._x = ...``."""
    own: set[str] = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            own.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            own.update(t.id for t in targets if isinstance(t, ast.Name))
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in (e for t in targets if t is not None for e in ast.walk(t)):
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"):
                own.add(t.attr)
    return {n for n in own if is_private(n)}


class _Scan(ast.NodeVisitor):
    def __init__(self, own: set[str]):
        self.own = own  # private names recpipe's classes define (not a library base's)
        self.bound: dict[str, str] = {}  # local name -> the dotted path it was imported as
        self.classes: list[tuple[set[str], str | None] | None] = []  # (own names, library bases' source) or None
        self.uses: list[tuple[int, str]] = []
        self.defined: set[str] = set()  # private names this module's classes define, not a library base's

    def _add(self, node: ast.AST, text: str) -> None:
        self.uses.append((node.lineno, text))

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.bound[a.asname or _top(a.name)] = a.name if a.asname else _top(a.name)
            if _top(a.name) in LIBRARIES and any(is_private(p) for p in a.name.split(".")):
                self._add(node, f"import {a.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = "" if node.level else (node.module or "")
        for a in node.names:
            self.bound[a.asname or a.name] = f"{base}.{a.name}" if base else "recpipe"
            if _top(base) in LIBRARIES and (is_private(a.name) or any(is_private(p) for p in base.split("."))):
                self._add(node, f"from {base} import {a.name}")

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(self._library_class(node))
        names = _class_names(node)
        if self.classes[-1] is not None:  # a library subclass: its base's names stay the library's
            source = self.classes[-1][1]
            names = {n for n in names if source is not None and not re.search(rf"\b{n}\b", source)}
        self.defined |= names
        self.generic_visit(node)
        self.classes.pop()

    def _library_class(self, node: ast.ClassDef) -> tuple[set[str], str | None] | None:
        """For a subclass of a library class: (the private names it defines, its library bases'
        source, None when unreadable); None for a class of recpipe's own."""
        sources = []
        for base in node.bases:
            dotted = ast.unparse(base)
            origin = self.bound.get(dotted.split(".")[0], "")
            if _top(origin) in LIBRARIES:
                path = origin + dotted[len(dotted.split(".")[0]):]
                module, _, name = path.rpartition(".")
                sources.append(_library_base_source(module, name))
        if not sources:
            return None
        # a base whose source cannot be read might hold any name: every self._x counts as its
        return (_class_names(node), None if "" in sources else "\n".join(sources))

    def _library_object(self, node: ast.AST) -> bool | None:
        """True: the library's; False: recpipe's or the standard library's; None: unknown."""
        if isinstance(node, ast.Name) and node.id in ("self", "cls"):
            return False if not self.classes or self.classes[-1] is None else None
        while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
            if isinstance(node, ast.Call):  # getattr(obj, ...) is obj's; f(...) is f's module's
                accessor = isinstance(node.func, ast.Name) and node.func.id in _ACCESSORS and node.args
                node = node.args[0] if accessor else node.func
            else:
                node = node.value
        if not isinstance(node, ast.Name):
            return None
        if node.id in ("self", "cls"):  # self.x._y: whatever self.x holds
            return None
        origin = self.bound.get(node.id)
        if origin is None:
            return None
        return _top(origin) in LIBRARIES

    def _attribute(self, node: ast.AST, obj: ast.AST, name: str, text: str) -> None:
        if not is_private(name):
            return
        library = self._library_object(obj)
        if library is None and isinstance(obj, ast.Name) and obj.id in ("self", "cls") and self.classes:
            names, source = self.classes[-1]  # self in a subclass of a library class
            library = name not in names or source is None or re.search(rf"\b{name}\b", source) is not None
        if library or (library is None and name not in self.own):
            self._add(node, text)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._attribute(node, node.value, node.attr, ast.unparse(node))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        fn = node.func
        if isinstance(fn, ast.Name) and fn.id in _ACCESSORS and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                self._attribute(node, node.args[0], name.value, ast.unparse(node))
            elif (isinstance(name, ast.BinOp) and isinstance(name.left, ast.Constant)
                  and str(name.left.value).startswith("_")):
                self._add(node, ast.unparse(node))  # getattr(obj, "_" + field)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        key = node.slice
        inner = node.value
        dict_of = (isinstance(inner, ast.Attribute) and inner.attr == "__dict__") or (
            isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and inner.func.id == "vars")
        if dict_of and isinstance(key, ast.Constant) and isinstance(key.value, str):
            obj = inner.value if isinstance(inner, ast.Attribute) else inner.args[0]
            self._attribute(node, obj, key.value, ast.unparse(node))
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and _PRIVATE_STRING.match(node.value) and " " not in node.value:
            self._add(node, repr(node.value))


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of docstring nodes: prose, not uses."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def scan(root: Path = ROOT) -> dict[str, list[tuple[int, str]]]:
    """``{path relative to the repository: [(line, use), ...]}`` for every file with a use."""
    trees = {p: ast.parse(p.read_text(), str(p)) for p in sorted(root.rglob("*.py"))}
    own: set[str] = set()
    for tree in trees.values():  # first pass: what recpipe's classes define
        first = _Scan(set())
        first.visit(tree)
        own |= first.defined
    out: dict[str, list[tuple[int, str]]] = {}
    for path, tree in trees.items():
        scanner = _Scan(own)
        skip = _docstrings(tree)
        original = scanner.visit_Constant
        scanner.visit_Constant = lambda n: None if id(n) in skip else original(n)
        scanner.visit(tree)
        if scanner.uses:
            out[str(path.relative_to(root.parent))] = sorted(set(scanner.uses))
    return out


def outside_seam(uses: dict[str, list[tuple[int, str]]]) -> dict[str, list[tuple[int, str]]]:
    return {f: u for f, u in uses.items() if not f.startswith(f"recpipe/{SEAM}/")}


def main(argv: list[str]) -> int:
    uses = scan()
    for path, found in sorted(uses.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        print(f"{len(found):4d}  {path}")
        if "--list" in argv:
            for line, text in found:
                print(f"        {path}:{line}: {text}")
    total = sum(map(len, uses.values()))
    outside = sum(map(len, outside_seam(uses).values()))
    print(f"{total:4d}  total ({outside} outside recpipe/{SEAM}/)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
