"""The speed features recpipe knows, in the order the builder applies them.

Adding a speed feature is one declaration module in ``recpipe/speedups/defs/`` (its
options section, the capabilities it needs, its rules and the dotted path of its
``apply``; ``recpipe.speedups.definition``) and one line here, or :func:`register` from
a trainer script. Its section then is a key of every pipeline's options
(``recpipe.pipeline_options``), ``recpipe.preflight`` checks it, and
``recpipe.builder.make_pipeline`` applies it. The order matters: the graphs record the
compiled code (``compile`` before ``cuda_graphs``), and the step graph replaces the
schedule the step wrappers before it were given.
"""

from __future__ import annotations

import sys

from recpipe.speedups.definition import SpeedupDef
from recpipe.speedups.defs import (cache_bookkeeping, cache_fill, compile, cuda_graphs, recat_cache, splits_exchange,
                                   step_graph)

__all__ = ["SPEEDUPS", "SpeedupDef", "register", "unregister"]

# Builds every pipeline's options from the sections registered when it is imported.
_OPTIONS_MODULE = "recpipe.pipeline_options"

SPEEDUPS: dict[str, SpeedupDef] = {
    d.name: d for d in (splits_exchange.FEATURE, compile.FEATURE, cuda_graphs.FEATURE, cache_fill.FEATURE,
                        cache_bookkeeping.FEATURE, recat_cache.FEATURE, step_graph.FEATURE)
}


def register(feature: SpeedupDef) -> SpeedupDef:
    """Add a speed feature (a trainer script's, a test's), applied after the built-in ones.
    One with an options section must be registered before ``recpipe.config`` is imported:
    every pipeline's options are built from the sections registered by then."""
    if feature.name in SPEEDUPS:
        raise ValueError(f"a speed feature named {feature.name!r} is already registered")
    if feature.options is not None and _OPTIONS_MODULE in sys.modules:
        raise ValueError(f"speed feature {feature.name!r} has an options section, and the pipelines' options are "
                         f"built already ({_OPTIONS_MODULE} is imported): register it before importing recpipe.config")
    SPEEDUPS[feature.name] = feature
    return feature


def unregister(name: str) -> None:
    SPEEDUPS.pop(name, None)
