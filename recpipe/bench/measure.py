"""What a run reads around its timed steps: the bench's one clock, the allocator's peaks, FBGEMM's
UVM-cache counters (with the cache work from the trace), and statistics. What each number means:
docs/benchmarking.md, "Clocks and memory" and "UVM cache"."""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from recpipe.config import RecpipeConfig
from recpipe.pipelines.prefetch import cached_tbes
from recpipe.speedups.cache_fill import CacheFill

__all__ = ["COUNTERS", "MemorySnapshot", "StepClock", "cache_metrics", "cached_tables", "counter_delta",
           "free_device_memory", "percentile", "populate_op", "prefetch_unavailable", "read_counters",
           "summarize_ms", "synchronize"]

_GIB = 2**30


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile, ``q`` in [0, 100]; NaN of nothing."""
    return float(np.percentile(values, q)) if len(values) else math.nan


def summarize_ms(values: list[float]) -> dict[str, float]:
    if not len(values):
        return dict.fromkeys(("p50", "p90", "mean", "min", "max"), math.nan)
    return {"p50": percentile(values, 50), "p90": percentile(values, 90), "mean": float(np.mean(values)),
            "min": float(min(values)), "max": float(max(values))}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()  # host sync: every queued kernel is done


class StepClock:
    """Times calls. CUDA: a pair of events on the current (compute) stream around each call, read after one
    synchronize, so consecutive calls tile the compute stream's timeline (host stalls inside a call included,
    the caller's work between calls not). CPU: the host's wall time. Always: the host time inside each call,
    without the time the pipeline waited for the device to catch up (``waited()``: its ``host_wait_s``,
    ``pipeline.steps_ahead``): the host's own work."""

    def __init__(self, device: torch.device, waited: Callable[[], float] = lambda: 0.0) -> None:
        self.cuda = device.type == "cuda"
        self._waited, self._w0 = waited, 0.0
        self.method = "cuda_events_per_progress_call" if self.cuda else "host_wall_per_progress_call"
        self._events: list[torch.cuda.Event] = []  # CUDA: start, end of every call
        self._host: list[float] = []
        self._t0 = 0.0

    def _record(self) -> None:
        if self.cuda:
            self._events.append(torch.cuda.Event(enable_timing=True))
            self._events[-1].record()

    def start(self) -> None:
        self._t0, self._w0 = time.perf_counter(), self._waited()
        self._record()

    def stop(self) -> None:
        self._record()
        self._host.append((time.perf_counter() - self._t0 - (self._waited() - self._w0)) * 1e3)

    def host_ms(self) -> list[float]:
        """Host milliseconds spent inside each call (CUDA: launch work and host syncs, not the waits for the
        device to catch up)."""
        return list(self._host)

    def times_ms(self) -> list[float]:
        """Milliseconds of each call. Host sync on CUDA: waits for every recorded event."""
        if not self.cuda:
            return list(self._host)
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in zip(self._events[::2], self._events[1::2])]


@dataclass
class MemorySnapshot:
    """The allocator's peaks of one run on one rank (bytes; none on CPU), reset after build, warm-up, timed steps."""

    cuda: bool
    before_build: int = 0  # allocated before the model was built: leftovers of earlier runs
    after_build: int = 0
    reserved_after_build: int = 0
    peaks: dict[str, tuple[int, int]] = field(default_factory=dict)  # phase -> (allocated, reserved)

    @classmethod
    def begin(cls, device: torch.device) -> "MemorySnapshot":
        snap = cls(cuda=device.type == "cuda")
        if snap.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            snap.before_build = torch.cuda.memory_allocated()
        return snap

    def built(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.after_build, self.reserved_after_build = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            self.phase_done("build")

    def phase_done(self, phase: str) -> None:
        """Record the peak since the last reset under ``phase`` and reset it (host sync)."""
        if self.cuda:
            torch.cuda.synchronize()
            self.peaks[phase] = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()

    def as_gib(self) -> dict[str, float | None]:
        if not self.cuda or not self.peaks:
            return {}
        alloc, reserved = (max(p[i] for p in self.peaks.values()) for i in (0, 1))
        steps = [self.peaks[p] for p in ("warmup", "timed") if p in self.peaks]
        step_alloc = max((a for a, _ in steps), default=self.after_build)
        step_reserved = max((r for _, r in steps), default=self.reserved_after_build)
        timed_alloc = self.peaks.get("timed", (self.after_build, 0))[0]
        return {"peak_alloc_gib": alloc / _GIB, "peak_reserved_gib": reserved / _GIB,
                "reserved_over_alloc": reserved / alloc if alloc else None,
                "step_peak_alloc_above_build_gib": (step_alloc - self.after_build) / _GIB,
                "step_peak_reserved_above_build_gib": (step_reserved - self.reserved_after_build) / _GIB,
                "timed_peak_alloc_above_build_gib": (timed_alloc - self.after_build) / _GIB,
                "alloc_after_build_gib": self.after_build / _GIB, "alloc_before_build_gib": self.before_build / _GIB}


def free_device_memory(device: torch.device) -> None:
    """Between runs: drop unreachable objects (pipelines hold reference cycles) and hand
    cached blocks back, so the next run's reserved memory starts from its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# UVMCacheStatsIndex order (fbgemm_gpu.split_table_batched_embeddings_ops_training)
COUNTERS = ("calls", "requested", "unique", "unique_misses", "conflict_unique_misses", "conflict_misses")


def cached_tables(cfg: RecpipeConfig) -> list[str]:
    """Tables with a UVM cache (``fused_uvm_caching``)."""
    return [t for t, s in cfg.table_sharding().items() if s.kernel == "fused_uvm_caching"]


def prefetch_unavailable(cfg: RecpipeConfig) -> str:
    """Why the prefetch pipeline cannot run on ``cfg``'s tables ('' if it can)."""
    return "" if cached_tables(cfg) else ("needs a fused_uvm_caching table (the prefetch pipeline prefetches into "
                                          "UVM caches; none is configured)")


def read_counters(model: torch.nn.Module) -> list[dict[str, int]]:
    """Every cached TBE's counters and its cache row's bytes. Host sync (``tolist``)."""
    out = []
    for tbe in cached_tbes(model, locked=False):
        weights, state = tbe.lxu_cache_weights, tbe.lxu_cache_state
        out.append({**dict(zip(COUNTERS, tbe.get_uvm_cache_stats().tolist())), "occupied": int((state >= 0).sum()),
                    "slots": state.numel(), "row_bytes": weights.shape[1] * weights.element_size()})
    return out


def counter_delta(before: list[dict[str, int]], after: list[dict[str, int]]) -> list[dict[str, int]]:
    """Per TBE, what the counters and the occupied slots (``filled``) grew by; the rest as after."""
    return [{**{k: a[k] - b[k] for k in COUNTERS}, "filled": a["occupied"] - b["occupied"], "occupied": a["occupied"],
             "slots": a["slots"], "row_bytes": a["row_bytes"]} for b, a in zip(before, after)]


def populate_op(pipe: Any) -> str:
    """The profiler name of the cache insert ``pipe`` runs: recpipe's (``cache_fill``) or FBGEMM's."""
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


def _gb_per_s(nbytes: float, ms: float | None) -> float | None:
    return nbytes / (ms / 1e3) / 1e9 if ms else None


def cache_metrics(deltas: list[list[dict[str, int]]], steps: int, traced: list[dict[str, Any] | None],
                  populate: str = "fbgemm::lru_cache_populate") -> dict[str, Any]:
    """The row's ``cache`` section (the rank that fetches most) from every rank's counter deltas and traced
    cache work (or None); the GPU time of ``populate``, the insert's op, gives the bandwidth."""
    unique = sum(d["unique"] for rank in deltas for d in rank)
    misses = sum(d["unique_misses"] for rank in deltas for d in rank)
    per_rank = [_rank_numbers(rank, steps) for rank in deltas]
    for numbers, work in zip(per_rank, traced):
        if work:
            nbytes = numbers["bytes_fetched_per_step"]
            numbers.update({k: work.get(k) for k in ("gpu_ms", "overlap_ms", "exposed_ms", "overlap_compute_ms",
                                                     "overlap_fraction", "by_op_ms")},
                           h2d_GB_per_s_populate=_gb_per_s(nbytes, work["by_op_ms"].get(populate)),
                           h2d_GB_per_s_insert=_gb_per_s(nbytes, work["insert_kernels_ms"]))
    top = max(range(len(per_rank)), key=lambda r: per_rank[r]["bytes_fetched_per_step"])
    return {"hit_rate": 1.0 - misses / unique if unique else None, "populate_op": populate, **per_rank[top],
            "per_rank": per_rank}
