"""The speed features recpipe knows, in the order the builder applies them.

Adding a speed feature is one declaration module in ``recpipe/speedups/defs/`` (its
options section, the capabilities it needs, its rules and the dotted path of its
``apply``; ``recpipe.speedups.definition``) and one line here, or :func:`register` from
a trainer script, at any time before its config is loaded. Its section then is a key of
every pipeline's options (``recpipe.pipeline_options`` builds them when first needed), ``recpipe.preflight`` checks it, and
``recpipe.builder.make_pipeline`` applies it. The order matters: the graphs record the
compiled code (``compile`` before ``cuda_graphs``), and the step graph replaces the
schedule the step wrappers before it were given.
"""

from __future__ import annotations

from recpipe.speedups.definition import SpeedupDef
from recpipe.speedups.defs import (cache_bookkeeping, cache_fill, compile, cuda_graphs, recat_cache, splits_exchange,
                                   step_graph)

__all__ = ["SPEEDUPS", "SpeedupDef", "register", "unregister"]

SPEEDUPS: dict[str, SpeedupDef] = {
    d.name: d for d in (splits_exchange.FEATURE, compile.FEATURE, cuda_graphs.FEATURE, cache_fill.FEATURE,
                        cache_bookkeeping.FEATURE, recat_cache.FEATURE, step_graph.FEATURE)
}


def register(feature: SpeedupDef) -> SpeedupDef:
    """Add a speed feature (a trainer script's, a test's), applied after the built-in ones.
    Its options section is a key of the configs validated from now on (those validated
    before keep the options they had)."""
    if feature.name in SPEEDUPS:
        raise ValueError(f"a speed feature named {feature.name!r} is already registered")
    SPEEDUPS[feature.name] = feature
    return feature


def unregister(name: str) -> None:
    SPEEDUPS.pop(name, None)
