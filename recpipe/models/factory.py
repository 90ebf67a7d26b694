"""User models and user data named in the config (``model.factory``, ``data.factory``).

``"package.module:function"`` is imported from the working directory or PYTHONPATH.
Every problem (a module that does not import, a missing function, a result of the
wrong type) is a :class:`~recpipe.config.ConfigError` that names the config key, so
``recpipe train`` exits with code 2 before any process starts.
"""

from __future__ import annotations

from torch import nn

from recpipe.callables import load_callable
from recpipe.config import ConfigError, RecpipeConfig
from recpipe.models.dlrm import build_model
from recpipe.models.precision import with_precision

__all__ = ["load_callable", "make_model"]


def make_model(cfg: RecpipeConfig) -> nn.Module:
    """The unsharded model: ``model.factory(cfg)`` if set, else the built-in DLRM/DCNv2
    (embedding tables on the meta device; DistributedModelParallel materializes the shards).
    Either runs at ``train.precision`` (:mod:`recpipe.models.precision`)."""
    if cfg.model.factory is None:
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
    return with_precision(model, cfg.train.precision)
