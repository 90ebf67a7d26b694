"""The bench's one clock (:class:`StepClock`), allocator snapshots and statistics. What each
number means: docs/benchmarking.md, "Clocks and memory"."""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["MemorySnapshot", "StepClock", "free_device_memory", "percentile", "summarize_ms", "synchronize"]

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
    the caller's work between calls not). CPU: the host's wall time. Always: the host time inside each call."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.method = "cuda_events_per_progress_call" if self.cuda else "host_wall_per_progress_call"
        self._events: list[torch.cuda.Event] = []  # CUDA: start, end of every call
        self._host: list[float] = []
        self._t0 = 0.0

    def _record(self) -> None:
        if self.cuda:
            self._events.append(torch.cuda.Event(enable_timing=True))
            self._events[-1].record()

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._record()

    def stop(self) -> None:
        self._record()
        self._host.append((time.perf_counter() - self._t0) * 1e3)

    def host_ms(self) -> list[float]:
        """Host milliseconds spent inside each call (CUDA: launch work and host syncs only)."""
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
