"""UVM-cache metrics of a bench row: FBGEMM's cache counters read around the timed steps
(hit rate, rows and bytes fetched per step, cache occupancy, evictions), the cache work's
GPU time and overlap from the trace, and the achieved host-to-HBM bandwidth (docs/benchmarking.md,
"UVM cache"). The counters need ``gather_uvm_cache_stats=True`` on every cached TBE
(:func:`stats_fused_params`, a TBE argument torchrec passes through; fbgemm-gpu 1.6, 1.8):
a few atomics in FBGEMM's cache kernels, on every row of a cached config alike.
"""

from __future__ import annotations

from typing import Any

import torch

from recpipe.config import RecpipeConfig
from recpipe.pipelines.prefetch import cached_tbes
from recpipe.speedups.cache_fill import CacheFill

__all__ = ["COUNTERS", "cache_metrics", "cached_tables", "populate_op", "prefetch_unavailable", "read_counters",
           "stats_fused_params", "unavailable"]

# UVMCacheStatsIndex order (fbgemm_gpu.split_table_batched_embeddings_ops_training)
COUNTERS = ("calls", "requested", "unique", "unique_misses", "conflict_unique_misses", "conflict_misses")
GB = 1e9


def cached_tables(cfg: RecpipeConfig) -> list[str]:
    """Tables with a UVM cache (``fused_uvm_caching``)."""
    return [t for t, s in cfg.table_sharding().items() if s.kernel == "fused_uvm_caching"]


def prefetch_unavailable(cfg: RecpipeConfig) -> str:
    """Why the prefetch pipeline cannot run on ``cfg``'s tables ('' if it can)."""
    if cached_tables(cfg):
        return ""
    return "needs a fused_uvm_caching table (the prefetch pipeline prefetches into UVM caches; none is configured)"


def stats_fused_params(cfg: RecpipeConfig) -> dict[str, Any]:
    """TBE keyword arguments for the bench's models: the cache counters, where there is a cache."""
    return {"gather_uvm_cache_stats": True} if cached_tables(cfg) else {}


def unavailable(cfg: RecpipeConfig, device: torch.device) -> str:
    """Why a run has no cache metrics ('' when it can have them)."""
    if not cached_tables(cfg):
        return "n/a: no fused_uvm_caching table (no UVM cache)"
    if device.type != "cuda":
        return "n/a: CPU run (no UVM cache)"
    return ""


def read_counters(model: torch.nn.Module) -> list[dict[str, int]]:
    """Every cached TBE's counters and its cache row's bytes. Host sync (``tolist``)."""
    out = []
    for tbe in cached_tbes(model, locked=False):
        stats = tbe.get_uvm_cache_stats().tolist()
        weights, state = tbe.lxu_cache_weights, tbe.lxu_cache_state
        out.append({**dict(zip(COUNTERS, stats)), "occupied": int((state >= 0).sum()), "slots": state.numel(),
                    "row_bytes": weights.shape[1] * weights.element_size()})
    return out


def counter_delta(before: list[dict[str, int]], after: list[dict[str, int]]) -> list[dict[str, int]]:
    """Per TBE, what the counters and the occupied slots grew by (slots and row bytes
    as after; ``occupied`` = the slots holding a row at the end)."""
    return [{**{k: a[k] - b[k] for k in COUNTERS}, "filled": a["occupied"] - b["occupied"], "occupied": a["occupied"],
             "slots": a["slots"], "row_bytes": a["row_bytes"]} for b, a in zip(before, after)]


def populate_op(pipe: Any) -> str:
    """The profiler name of the cache insert ``pipe`` runs: recpipe's (the prefetch
    pipeline's ``cache_fill``, a record_function range) or FBGEMM's op."""
    recpipe_insert = any(isinstance(a, CacheFill) for a in getattr(pipe, "applied", ()))
    return "recpipe::lru_cache_populate" if recpipe_insert else "fbgemm::lru_cache_populate"


def _rank_numbers(delta: list[dict[str, int]], steps: int) -> dict[str, float]:
    fetched = sum(d["unique_misses"] - d["conflict_unique_misses"] for d in delta)
    nbytes = sum((d["unique_misses"] - d["conflict_unique_misses"]) * d["row_bytes"] for d in delta)
    slots = sum(d["slots"] for d in delta)
    return {"rows_fetched_per_step": fetched / steps, "bytes_fetched_per_step": nbytes / steps,
            "occupancy": sum(d["occupied"] for d in delta) / slots if slots else None,
            "evicted_per_step": (fetched - sum(d["filled"] for d in delta)) / steps,
            "uvm_lookups_per_step": sum(d["conflict_misses"] for d in delta) / steps,
            "requested_per_step": sum(d["requested"] for d in delta) / steps,
            "unique_per_step": sum(d["unique"] for d in delta) / steps}


def _bandwidth(nbytes: float, ms: float | None) -> float | None:
    return nbytes / (ms / 1e3) / GB if ms else None


def cache_metrics(deltas: list[list[dict[str, int]]], steps: int, traced: list[dict[str, Any] | None],
                  populate: str = "fbgemm::lru_cache_populate") -> dict[str, Any]:
    """The row's ``cache`` section from every rank's counter deltas over ``steps`` timed
    steps and every rank's traced cache work (``summarize_trace``'s ``cache``, None where
    the trace had none); ``populate``: the insert's op (:func:`populate_op`), whose GPU time
    gives the bandwidth. Numbers of the rank that fetches most."""
    unique = sum(d["unique"] for rank in deltas for d in rank)
    misses = sum(d["unique_misses"] for rank in deltas for d in rank)
    per_rank = [_rank_numbers(rank, steps) for rank in deltas]
    for numbers, work in zip(per_rank, traced):
        if work:
            numbers.update(gpu_ms=work["gpu_ms"], overlap_ms=work["overlap_ms"], exposed_ms=work["exposed_ms"],
                           overlap_compute_ms=work.get("overlap_compute_ms"),
                           overlap_fraction=work["overlap_fraction"], by_op_ms=work["by_op_ms"],
                           h2d_GB_per_s_populate=_bandwidth(numbers["bytes_fetched_per_step"],
                                                            work["by_op_ms"].get(populate)),
                           h2d_GB_per_s_insert=_bandwidth(numbers["bytes_fetched_per_step"],
                                                          work["insert_kernels_ms"]))
    top = max(range(len(per_rank)), key=lambda r: per_rank[r]["bytes_fetched_per_step"])
    return {"hit_rate": 1.0 - misses / unique if unique else None, "populate_op": populate, **per_rank[top],
            "per_rank": per_rank}
