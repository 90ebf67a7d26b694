"""User models and user data named in the config (``model.factory``, ``data.factory``).

``"package.module:function"`` is imported from the working directory or PYTHONPATH.
Every problem (a module that does not import, a missing function, a result of the
wrong type) is a :class:`~recpipe.config.ConfigError` that names the config key, so
``recpipe train`` exits with code 2 before any process starts.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Callable

from torch import nn

from recpipe.config import ConfigError, RecpipeConfig

__all__ = ["load_callable", "make_model"]


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


def make_model(cfg: RecpipeConfig) -> nn.Module:
    """The unsharded model: ``model.factory(cfg)`` if set, else the built-in DLRM/DCNv2
    (embedding tables on the meta device; DistributedModelParallel materializes the shards).
    Either runs at ``train.precision`` (:mod:`recpipe.models.precision`)."""
    if cfg.model.factory is None:
        from recpipe.models.dlrm import build_model

        return build_model(cfg.model, precision=cfg.train.precision)
    build = load_callable(cfg.model.factory, "model.factory")
    try:
        model = build(cfg)
    except Exception as err:  # the user's code: name the key, keep the cause (recpipe --debug shows it)
        raise ConfigError(f"model.factory={cfg.model.factory!r} raised {type(err).__name__}: {err}") from err
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model.factory={cfg.model.factory!r} returned {type(model).__name__}; it must return a torch.nn.Module "
            "whose forward(batch) returns (loss, output)"
        )
    from recpipe.models.precision import with_precision

    return with_precision(model, cfg.train.precision)
