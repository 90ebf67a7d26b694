"""User code named in the config: ``"package.module:function"`` (``model.factory``,
``data.factory``, ``pipeline.inputs``), imported from the working directory or
PYTHONPATH. Every problem is a :class:`~recpipe.errors.ConfigError` naming the key,
so ``recpipe train`` exits with code 2 before any process starts.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Callable

from recpipe.errors import ConfigError

__all__ = ["load_callable"]


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
