"""``pipeline.cache_fill``: recpipe's UVM-cache insert in a pipeline's prefetch step; the
implementation and its measurements are in ``recpipe.speedups.cache_fill``."""

from __future__ import annotations

import importlib.util
from typing import Any

from pydantic import Field

from recpipe.capabilities import PREFETCH_STEP
from recpipe.sections import SwitchSection
from recpipe.speedups.definition import SpeedupDef

__all__ = ["CacheFillOptions", "FEATURE", "check", "plan_facts"]


class CacheFillOptions(SwitchSection):
    """``pipeline.cache_fill`` (pipelines with a prefetch step: ``prefetch``): recpipe's
    UVM-cache insert. ``true`` / ``false`` stand for ``{enabled: true}`` / ``{enabled: false}``."""

    # recpipe's insert (Triton kernels) in the prefetch step; false: FBGEMM's lru_cache_populate.
    # It falls back to FBGEMM's, with a warning, where Triton is missing (it ships with torch's
    # CUDA builds), and for a TBE whose cache rows are not in the weights' precision.
    enabled: bool = True
    # SMs (persistent programs) of the kernel that moves rows between host memory and the cache.
    sms: int = Field(4, ge=1)


def check(cfg: Any) -> list[str]:
    """A written ``pipeline.cache_fill`` needs cache rows in the weights' precision (it copies
    rows as they are). ``cfg``: a ``RecpipeConfig``."""
    fill = cfg.pipeline.cache_fill
    if "cache_fill" not in cfg.pipeline.model_fields_set or not fill.enabled:
        return []
    problems = []
    for name, t in cfg.table_sharding().items():
        if t.kernel == "fused_uvm_caching" and t.cache_precision not in (None, t.weights_precision or "fp32"):
            problems.append(
                f"pipeline.cache_fill copies rows as they are, but sharding table {name} has "
                f"cache_precision={t.cache_precision!r} and weights_precision={t.weights_precision or 'fp32'!r}; "
                "make them equal or set pipeline.cache_fill=false (FBGEMM's insert)"
            )
    return problems


def plan_facts(options: CacheFillOptions) -> dict[str, str]:
    """Who inserts the missed rows: recpipe's insert where Triton can run (checked without
    importing it, which a plan does not need), else FBGEMM's (its fallback)."""
    return {"cache_insert": "recpipe" if importlib.util.find_spec("triton") is not None else "fbgemm"}


FEATURE = SpeedupDef(
    "cache_fill", CacheFillOptions,
    "recpipe's UVM-cache insert in the prefetch step, where the pipeline has one (recpipe/speedups/cache_fill.py)",
    apply="recpipe.speedups.cache_fill:apply", needs=frozenset({PREFETCH_STEP}), missing="skip", check=check,
    plan_facts=plan_facts,
)
