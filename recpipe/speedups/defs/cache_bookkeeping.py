"""FBGEMM's backward pre-hook work of the UVM caches on the prefetch stream: always on
where a pipeline has a prefetch step (no config section: its alternative was measured and
is not an option; ``recpipe.speedups.cache_bookkeeping``)."""

from __future__ import annotations

from recpipe.capabilities import PREFETCH_STEP
from recpipe.speedups.definition import SpeedupDef

__all__ = ["FEATURE"]

FEATURE = SpeedupDef(
    "cache_bookkeeping", None,
    "FBGEMM's backward pre-hook work of batch i on the prefetch stream after prefetch(i+1)",
    apply="recpipe.speedups.cache_bookkeeping:apply", needs=frozenset({PREFETCH_STEP}), missing="skip",
    plan_facts=lambda options: {"cache_bookkeeping_stream": "prefetch"},
)
