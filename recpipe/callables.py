"""User code named in the config: ``"package.module:function"`` (``model.factory``,
``data.factory``, ``pipeline.inputs``), imported from the working directory or
PYTHONPATH. Every problem is a :class:`~recpipe.errors.ConfigError` naming the key,
so ``recpipe train`` exits with code 2 before any process starts.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any, Callable

from recpipe.errors import ConfigError

__all__ = ["class_spec", "load_callable"]


def load_callable(spec: str, key: str) -> Callable[..., Any]:
    """The function named by ``spec`` ("package.module:function"); ``key`` is the
    config key it came from, for the error message."""
    module_name, _, attr = spec.partition(":")
    cwd = os.getcwd()
    if cwd not in sys.path:  # the `recpipe` console script does not put it there
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or an error raised while importing the user's module
        raise ConfigError(
            f"{key}={spec!r}: cannot import module {module_name!r} ({type(err).__name__}: {err}); it is looked up "
            f"in the working directory ({cwd}) and on PYTHONPATH"
        ) from err
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"{key}={spec!r}: module {module_name!r} ({module.__file__}) has no attribute {attr!r}")
    if not callable(fn):
        raise ConfigError(f"{key}={spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


def class_spec(cls: type) -> str:
    """``"package.module:ClassName"`` naming ``cls`` so that another process imports it (a
    rank imports ``pipeline.class`` by name). A class defined in the script that runs
    (module ``__main__``) is named by the script's module: its ``-m`` name, else its path
    under the working directory or a ``sys.path`` entry (``scripts/x.py``: ``scripts.x``)."""
    module = cls.__module__
    if module == "__main__":
        module = _script_module()
    if "." in cls.__qualname__ or "<" in cls.__qualname__:
        raise ConfigError(f"class {cls.__qualname__} is defined inside a function or class; another process can only "
                          f"import a class defined at the top of its module ({module})")
    return f"{module}:{cls.__qualname__}"


def _script_module() -> str:
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return spec.name.removesuffix(".__main__")
    path = Path(getattr(main, "__file__", "") or "").resolve()
    for entry in (os.getcwd(), *sys.path):
        try:
            parts = path.with_suffix("").relative_to(Path(entry or ".").resolve()).parts
        except ValueError:
            continue
        if parts and all(p.isidentifier() for p in parts):
            return ".".join(parts)
    raise ConfigError(f"the running script {str(path)!r} is not under the working directory or sys.path, so the ranks "
                      "cannot import its classes; run it from the directory above it")

