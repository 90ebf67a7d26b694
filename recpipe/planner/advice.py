"""What to change so that a configuration that does not fit does: ``advise(cfg)``.

A pure function over the config, like the rest of the planner: every candidate change is
a set of config overrides (``--set KEY=VALUE``), applied to the config and validated as
``--set`` would be, then planned again (:func:`recpipe.planner.plan_from_config`, at the
same GPU capacity). Only changes whose new plan fits are named, each with the memory it
frees: how far the most any rank needs drops.

The kinds of change, cheapest first (by what they cost the run, not by memory):

1. ``cache_load_factor``, ``prefetch_passes``: the knobs of a config that has UVM-cached
   tables or multi-pass prefetch (the largest load factor, the fewest passes that fit:
   :mod:`recpipe.planner.search`).
2. ``row_wise``: the largest table_wise / column_wise tables of the ranks over capacity
   split by rows over all ranks (several ranks only). The numbers trained are the same;
   each such table adds its rows' bucketize and all-to-all traffic to every rank.
3. ``fp16``: the largest fp32 tables of those ranks with fp16 weights, half their bytes
   (FBGEMM trains fp32 and fp16 weights, not bf16; fp16 updates round stochastically).
4. ``uvm_cache``: the largest tables of those ranks in host memory with an HBM cache
   (kernel ``fused_uvm_caching``) at the largest load factor (to 0.01) that fits; every
   cache miss costs a copy over PCIe.
5. ``row_wise_ranks``: when row_wise over the ranks there are does not fit (one GPU
   included), the fewest GPUs (``distributed.nproc``, up to 8 times as many) over which those
   tables split by rows fit, each rank's share planned at that world size.
6. ``more_ranks``: the fewest GPUs (``distributed.nproc``, up to 8 times as many) at which
   the same sharding fits.

Within a kind the fewest tables that fit are named: the tables ordered by the bytes they
hold on ranks over capacity, the shortest prefix found by bisection (memory falls as
tables are added) and the answer planned once more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from recpipe.config import ConfigError, RecpipeConfig, apply_override, config_from_dict
from recpipe.planner.estimate import estimate_memory
from recpipe.planner.from_config import plan_from_config, planner_inputs
from recpipe.planner.plan import MemoryPlan, fmt_bytes
from recpipe.planner.search import fit_cache_load_factor, min_prefetch_passes
from recpipe.planner.spec import CACHED, UVM_KERNELS

if TYPE_CHECKING:
    from recpipe.planner.spec import PlannerInputs

__all__ = ["Advice", "advice_lines", "advise"]

KINDS = ("cache_load_factor", "prefetch_passes", "row_wise", "fp16", "uvm_cache", "row_wise_ranks", "more_ranks")
MAX_RANK_FACTOR = 8  # more_ranks: up to this many times distributed.nproc


@dataclass(frozen=True)
class Advice:
    kind: str  # one of KINDS
    what: str  # the change in words
    overrides: dict[str, Any]  # config key -> value
    peak_before: int  # the most any rank needs, bytes: before and after the change
    peak_after: int
    capacity: int
    plan: MemoryPlan = field(repr=False, compare=False)

    @property
    def frees_bytes(self) -> int:
        return self.peak_before - self.peak_after

    def sets(self) -> str:
        return " ".join(f"--set {key}={_yaml(value)}" for key, value in self.overrides.items())

    @property
    def host_after(self) -> int:
        """The most host memory (DDR) a rank needs after the change, bytes."""
        return max(r.ddr_bytes for r in self.plan.ranks)

    def line(self) -> str:
        host = f"; host memory {fmt_bytes(self.host_after)} per rank" if self.kind == "uvm_cache" else ""
        return (f"{self.what}: the most a rank needs drops from {fmt_bytes(self.peak_before)} to "
                f"{fmt_bytes(self.peak_after)} of {fmt_bytes(self.capacity)} (frees {fmt_bytes(self.frees_bytes)})"
                f"{host}\n     {self.sets()}")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "what": self.what, "overrides": self.overrides, "frees_bytes": self.frees_bytes,
                "peak_hbm_bytes_before": self.peak_before, "peak_hbm_bytes_after": self.peak_after,
                "capacity_bytes": self.capacity, "peak_ddr_bytes_after": self.host_after}


def _yaml(value: Any) -> str:
    return "true" if value is True else "false" if value is False else str(value)


def _peak(plan: MemoryPlan) -> int:
    return max(r.hbm_bytes for r in plan.ranks)


def _fits(plan: MemoryPlan) -> bool:
    return all(r.fits for r in plan.ranks)


class _Planner:
    """Plans ``cfg`` with overrides at a fixed capacity; a config the overrides make
    invalid (a ConfigError, as ``--set`` would raise) plans to None."""

    def __init__(self, cfg: "RecpipeConfig", capacity: int) -> None:
        self.cfg, self.capacity = cfg, capacity

    def __call__(self, overrides: dict[str, Any]) -> MemoryPlan | None:
        raw = self.cfg.editable_dump()
        for key, value in overrides.items():
            apply_override(raw, key, value)
        try:
            changed = config_from_dict(raw, "the changed config")
            return plan_from_config(changed, hbm_capacity_bytes=self.capacity)
        except ConfigError:
            return None


def advise(cfg: "RecpipeConfig", plan: MemoryPlan | None = None, inputs: "PlannerInputs | None" = None,
           hbm_capacity_bytes: int | None = None) -> list[Advice]:
    """The changes that make ``cfg``'s plan fit, cheapest first (none when it fits).
    ``plan`` / ``inputs``: ``cfg``'s, computed when not given."""
    inputs = inputs or planner_inputs(cfg, hbm_capacity_bytes=hbm_capacity_bytes)
    plan = plan or estimate_memory(inputs)
    if _fits(plan):
        return []
    capacity = plan.ranks[0].capacity_bytes
    planner = _Planner(cfg, capacity)
    over = {r.rank for r in plan.ranks if not r.fits}
    held: dict[str, int] = {}  # table -> its HBM bytes on ranks over capacity
    for shard in plan.shards:
        if shard.rank in over:
            held[shard.table] = held.get(shard.table, 0) + shard.hbm_bytes
    tables = {t.name: t for t in inputs.tables}
    biggest = [name for name, _ in sorted(held.items(), key=lambda kv: (-kv[1], kv[0]))]
    key = {name: f"sharding.tables.{name}" for name in tables}

    out: list[Advice] = []

    def keep(kind: str, what: str, overrides: dict[str, Any]) -> None:
        after = planner(overrides)
        if after is not None and _fits(after):
            out.append(Advice(kind, what, overrides, _peak(plan), _peak(after), capacity, after))

    out += _knobs(inputs, planner, plan, capacity)
    movable = [n for n in biggest if tables[n].sharding_type in ("table_wise", "column_wise")]
    row_wise_here = None
    if inputs.world_size > 1:
        row_wise_here = _fewest(movable, lambda names: {f"{key[n]}.type": "row_wise" for n in names}, planner)
        if row_wise_here:
            keep("row_wise", f"row_wise over the {inputs.world_size} ranks for {_names(row_wise_here)}",
                 {f"{key[n]}.type": "row_wise" for n in row_wise_here})
    halvable = [n for n in biggest if tables[n].weights_precision == "fp32" and tables[n].sharding_type != "data_parallel"]
    found = _fewest(halvable, lambda names: {f"{key[n]}.weights_precision": "fp16" for n in names}, planner)
    if found:
        keep("fp16", f"fp16 weights for {_names(found)}", {f"{key[n]}.weights_precision": "fp16" for n in found})
    cacheable = [n for n in biggest if tables[n].kernel not in UVM_KERNELS and tables[n].sharding_type != "data_parallel"]

    def cached(names: list[str], load_factor: float = 0.01) -> dict[str, Any]:
        return {k: v for n in names for k, v in ((f"{key[n]}.kernel", CACHED),
                                                 (f"{key[n]}.cache_load_factor", load_factor))}

    found = _fewest(cacheable, cached, planner)
    if found:
        load_factor = _largest_load_factor(lambda lf: cached(found, lf), planner)
        keep("uvm_cache", f"a UVM cache (kernel {CACHED}) at load factor {load_factor} for {_names(found)}",
             cached(found, load_factor))
    if movable and not row_wise_here:
        out += _row_wise_over_more_ranks(movable, key, inputs.world_size, planner, _peak(plan))
    for n in range(inputs.world_size + 1, MAX_RANK_FACTOR * inputs.world_size + 1):
        after = planner({"distributed.nproc": n})
        if after is not None and _fits(after):
            keep("more_ranks", f"{n} ranks instead of {inputs.world_size}", {"distributed.nproc": n})
            break
    return out


def _row_wise_over_more_ranks(movable: list[str], key: dict[str, str], world_size: int, planner: "_Planner",
                              peak_before: int) -> list[Advice]:
    """``row_wise_ranks``: the fewest ranks (up to ``MAX_RANK_FACTOR`` times ``world_size``)
    at which ``movable`` split by rows fit, planned at that world size, and the fewest of
    those tables that fit there."""
    def overrides(nproc: int, names: list[str]) -> dict[str, Any]:
        return {"distributed.nproc": nproc, **{f"{key[n]}.type": "row_wise" for n in names}}

    for nproc in range(world_size + 1, MAX_RANK_FACTOR * world_size + 1):
        found = _fewest(movable, lambda names: overrides(nproc, names), planner)
        if found:
            changes = overrides(nproc, found)
            after = planner(changes)
            return [Advice("row_wise_ranks", f"row_wise over {nproc} GPUs (distributed.nproc {world_size} -> {nproc}) "
                           f"for {_names(found)}", changes, peak_before, _peak(after), planner.capacity, after)]
    return []


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"{shown} ({len(names)} table{'s' if len(names) != 1 else ''})"


def _fewest(candidates: list[str], overrides: Callable[[list[str]], dict[str, Any]],
            planner: _Planner) -> list[str] | None:
    """The shortest prefix of ``candidates`` whose change fits (bisection: memory falls as
    tables are added), or None when even all of them do not."""
    def fits(k: int) -> bool:
        after = planner(overrides(candidates[:k]))
        return after is not None and _fits(after)

    if not candidates or not fits(len(candidates)):
        return None
    lo, hi = 1, len(candidates)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return candidates[:lo]


def _largest_load_factor(overrides: Callable[[float], dict[str, Any]], planner: _Planner) -> float:
    """The largest load factor in hundredths, at least 0.01, at which the plan fits
    (memory grows with the load factor)."""
    def fits(hundredths: int) -> bool:
        after = planner(overrides(hundredths / 100))
        return after is not None and _fits(after)

    lo, hi = 1, 100
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo / 100


def _knobs(inputs: "PlannerInputs", planner: _Planner, plan: MemoryPlan, capacity: int) -> list[Advice]:
    """The knobs a config already has: the cached tables' load factor, the prefetch passes."""
    out = []
    candidates = []
    cached_tables = [t.name for t in inputs.tables if t.cached]
    if cached_tables:
        found = fit_cache_load_factor(inputs, capacity)
        if found.value is not None:
            candidates.append(("cache_load_factor", f"cache_load_factor {found.value} for the cached tables "
                               f"{_names(cached_tables)}",
                               {f"sharding.tables.{n}.cache_load_factor": found.value for n in cached_tables}))
    if inputs.prefetch_pipeline:
        found = min_prefetch_passes(inputs, capacity)
        if found.value is not None:
            candidates.append(("prefetch_passes", f"{found.value} prefetch passes",
                               {"sharding.prefetch_passes": found.value}))
    for kind, what, overrides in candidates:
        after = planner(overrides)  # the search ran on the planner's inputs; the config must agree
        if after is not None and _fits(after):
            out.append(Advice(kind, what, overrides, _peak(plan), _peak(after), capacity, after))
    return out


def advice_lines(advice: list[Advice]) -> str:
    """What ``recpipe plan`` and ``recpipe train``'s refusal say about :func:`advise`'s changes."""
    if not advice:
        return ("no single change recpipe tries makes it fit (row_wise, fp16 weights, a UVM cache, row_wise or "
                "the same sharding over up to "
                f"{MAX_RANK_FACTOR} times the ranks); lower data.batch_size or the table sizes")
    return "\n".join(["to fit, each checked by planning the changed config (cheapest first):"]
                     + [f"  {i}. {a.line()}" for i, a in enumerate(advice, 1)])
