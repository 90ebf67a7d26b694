"""Knob searches over the pure estimate: what to set so that a plan fits a budget.

* :func:`fit_cache_load_factor`: the largest cache load factor (one value for every
  ``fused_uvm_caching`` table) whose plan fits; memory grows with the load factor, so
  anything below it fits too and more cache means fewer misses.
* :func:`min_prefetch_passes`: the fewest multi-pass prefetch passes that fit (each
  pass costs a round of kernel launches; with FBGEMM >= 1.4 scratch floors at 2x the
  index bytes, so beyond about 6 passes nothing more is saved and the search stops
  early when a pass count stops lowering the peak).

Both return a :class:`SearchResult` with the value, the plan at that value and the
config key to set; ``value`` is None when nothing in range fits. :mod:`recpipe.planner.advice`
names them, with the other changes that make a plan fit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from recpipe.planner.estimate import estimate_memory
from recpipe.planner.plan import MemoryPlan
from recpipe.planner.spec import CACHED, PlannerInputs


@dataclass(frozen=True)
class SearchResult:
    key: str
    value: float | int | None
    plan: MemoryPlan | None
    budget_bytes: int

    def hint(self) -> str:
        budget = f"{self.budget_bytes / (1 << 30):.2f} GiB per rank"
        if self.value is None:
            return f"no {self.key} fits {budget}"
        if self.key == "cache_load_factor":
            return f"cache_load_factor={self.value} on every fused_uvm_caching table fits {budget}"
        return f"--set {self.key}={self.value} fits {budget}"


def _fits(plan: MemoryPlan, budget: int) -> bool:
    return all(r.hbm_bytes <= budget for r in plan.ranks)


def with_cache_load_factor(inputs: PlannerInputs, clf: float) -> PlannerInputs:
    tables = tuple(dataclasses.replace(t, cache_load_factor=clf) if t.kernel == CACHED else t for t in inputs.tables)
    return dataclasses.replace(inputs, tables=tables)


def fit_cache_load_factor(inputs: PlannerInputs, budget_bytes: int | None = None, *, lo: float = 0.001,
                          hi: float = 1.0, tol: float = 1e-3) -> SearchResult:
    """Largest load factor in [lo, hi] (to ``tol``) at which every rank fits."""
    budget = budget_bytes or inputs.hbm_capacity_bytes
    key = "cache_load_factor"
    if not any(t.kernel == CACHED for t in inputs.tables):
        raise ValueError("fit_cache_load_factor: no table has kernel 'fused_uvm_caching'")
    plan_hi = estimate_memory(with_cache_load_factor(inputs, hi))
    if _fits(plan_hi, budget):
        return SearchResult(key, hi, plan_hi, budget)
    plan_lo = estimate_memory(with_cache_load_factor(inputs, lo))
    if not _fits(plan_lo, budget):
        return SearchResult(key, None, None, budget)
    best = plan_lo
    while hi - lo > tol:
        mid = (lo + hi) / 2
        plan = estimate_memory(with_cache_load_factor(inputs, mid))
        if _fits(plan, budget):
            lo, best = mid, plan
        else:
            hi = mid
    value = math.floor(lo / tol) * tol  # round down: memory grows with the load factor
    value = float(f"{value:.6g}") if value > 0 else lo
    return SearchResult(key, value, estimate_memory(with_cache_load_factor(inputs, value)) if value != lo else best, budget)


def min_prefetch_passes(inputs: PlannerInputs, budget_bytes: int | None = None, *, max_passes: int = 64) -> SearchResult:
    """Fewest passes in 1..max_passes at which every rank fits."""
    budget = budget_bytes or inputs.hbm_capacity_bytes
    key = "sharding.prefetch_passes"
    if not inputs.prefetch_pipeline:
        raise ValueError("min_prefetch_passes: multi-pass prefetch needs pipeline.name=prefetch with UVM-cached tables")
    prev = None
    for m in range(1, max_passes + 1):
        plan = estimate_memory(dataclasses.replace(inputs, prefetch_passes=m))
        if _fits(plan, budget):
            return SearchResult(key, m, plan, budget)
        peak = max(r.hbm_bytes for r in plan.ranks)
        if prev is not None and m > 8 and peak >= prev:  # scratch floor reached: more passes save nothing
            break
        prev = peak
    return SearchResult(key, None, None, budget)


__all__ = ["SearchResult", "fit_cache_load_factor", "min_prefetch_passes"]
