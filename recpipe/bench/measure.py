"""Clocks, memory snapshots and statistics of one benchmark run (one pipeline).

Step time. On CUDA each ``progress()`` call is bracketed by a pair of
``torch.cuda.Event``s recorded on the current (compute) stream; they are read
after one ``synchronize()`` at the end of the run. The start event fires when the
compute stream reaches the call, i.e. when the previous step's compute work is
done, and the end event when this step's compute work (which fences on the
memcpy / dist / prefetch streams wherever it consumes their results) is done; so
consecutive steps tile the compute stream's timeline, host stalls inside a step
(the splits ``.tolist()``) included, the bench loop's own host work between calls
excluded. On CPU every call runs to completion, so the host wall time
(``time.perf_counter``) around the call is the step time.

Memory (CUDA only; ``None`` on CPU). The caching allocator's peaks are read at
three points with a reset after each: after building the model and pipeline
(``build``), after warm-up, after the timed steps. The whole-run peak is the
largest of the three (it includes the model); the step-only peak is the largest
peak of warm-up or timed steps minus what was allocated right after the build
(lazily created state, e.g. Adam's moments, counts as step memory). UVM tables
with ``uvm_host_mapped`` live in pinned host memory and are not in these numbers.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import torch

T = TypeVar("T")

__all__ = ["MemorySnapshot", "StepClock", "mean_leaves", "percentile", "summarize_ms", "free_device_memory",
           "time_stage"]

_GIB = 2**30


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), ``q`` in [0, 100]."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize_ms(values: list[float]) -> dict[str, float]:
    return {
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "mean": sum(values) / len(values) if values else math.nan,
        "min": min(values) if values else math.nan,
        "max": max(values) if values else math.nan,
    }


def mean_leaves(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """Key by key over dicts of the same shape (one per round): the mean of numbers
    (None if any round has None), recursively for dicts, else the first round's."""
    out: dict[str, Any] = {}
    for key, first in dicts[0].items():
        values = [d.get(key) for d in dicts]
        if isinstance(first, bool) or not all(isinstance(v, (int, float, dict)) for v in values):
            out[key] = None if any(v is None for v in values) and isinstance(first, (int, float)) else first
        elif all(isinstance(v, dict) for v in values):
            out[key] = mean_leaves(values)
        else:
            out[key] = sum(values) / len(values)
    return out


class StepClock:
    """Times ``progress()`` calls; see the module docstring for what is measured."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._host: list[float] = []
        self._host_call: list[float] = []
        self._h0 = 0.0
        self._t0 = 0.0
        self._event0: torch.cuda.Event | None = None

    @property
    def method(self) -> str:
        return "cuda_events_per_progress_call" if self.cuda else "host_wall_per_progress_call"

    def start(self) -> None:
        self._h0 = time.perf_counter()
        if self.cuda:
            self._event0 = torch.cuda.Event(enable_timing=True)
            self._event0.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            assert self._event0 is not None
            self._pairs.append((self._event0, end))
            self._event0 = None
        else:
            self._host.append((time.perf_counter() - self._t0) * 1e3)
        self._host_call.append((time.perf_counter() - self._h0) * 1e3)

    def host_ms(self) -> list[float]:
        """Host milliseconds spent inside each call (CUDA: launch + host syncs only)."""
        return list(self._host_call)

    def times_ms(self) -> list[float]:
        """Per-step milliseconds. Host sync on CUDA: waits for every recorded event."""
        if not self.cuda:
            return list(self._host)
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in self._pairs]


@dataclass
class MemorySnapshot:
    """Allocator numbers of one run on one rank, in bytes (all zero/None on CPU)."""

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
            self.after_build = torch.cuda.memory_allocated()
            self.reserved_after_build = torch.cuda.memory_reserved()
            self._close_phase("build")

    def phase_done(self, phase: str) -> None:
        """Record the peak since the last reset under ``phase`` and reset it."""
        if self.cuda:
            torch.cuda.synchronize()
            self._close_phase(phase)

    def _close_phase(self, phase: str) -> None:
        self.peaks[phase] = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()

    def as_gib(self) -> dict[str, float | None]:
        if not self.cuda or not self.peaks:
            return {}
        alloc = max(a for a, _ in self.peaks.values())
        reserved = max(r for _, r in self.peaks.values())
        step_phases = [p for p in ("warmup", "timed") if p in self.peaks]
        step_alloc = max((self.peaks[p][0] for p in step_phases), default=self.after_build)
        step_reserved = max((self.peaks[p][1] for p in step_phases), default=self.reserved_after_build)
        timed_alloc = self.peaks.get("timed", (self.after_build, 0))[0]
        return {
            "peak_alloc_gib": alloc / _GIB,
            "peak_reserved_gib": reserved / _GIB,
            "reserved_over_alloc": reserved / alloc if alloc else None,
            "step_peak_alloc_above_build_gib": (step_alloc - self.after_build) / _GIB,
            "step_peak_reserved_above_build_gib": (step_reserved - self.reserved_after_build) / _GIB,
            "timed_peak_alloc_above_build_gib": (timed_alloc - self.after_build) / _GIB,
            "alloc_after_build_gib": self.after_build / _GIB,
            "alloc_before_build_gib": self.before_build / _GIB,
        }


def segments_by_stream(device: torch.device) -> dict[int, tuple[int, int]]:
    """Per CUDA stream (its ``cuda_stream`` handle): bytes reserved by the caching
    allocator's segments the stream allocated, and bytes of them live now
    (``torch.cuda.memory_snapshot()``: a segment belongs to the stream that allocated
    it, and only that stream reuses its free blocks)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    out: dict[int, tuple[int, int]] = {}
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device", index) == index:
            reserved, active = out.get(seg["stream"], (0, 0))
            out[seg["stream"]] = (reserved + seg["total_size"], active + seg["active_size"])
    return out


def reserved_by_stream(device: torch.device, pipe: Any) -> dict[str, list[float]]:
    """``{stream role: [reserved GiB, live GiB]}`` now, for a recpipe pipeline (roles of
    its ``streams``) or a TorchRec one (its ``*_stream`` attributes); the current
    stream is ``compute``, unnamed streams are ``other``. Where the allocator's
    reserved memory above the allocated sits, by stream."""
    names = {torch.cuda.current_stream(device).cuda_stream: "compute"}
    roles = getattr(pipe, "streams", None)
    pairs = list(vars(roles).items()) if roles is not None and hasattr(roles, "__dataclass_fields__") else []
    pairs += [(k.strip("_").removesuffix("_stream"), v) for k, v in vars(pipe).items() if k.endswith("_stream")]
    for role, stream in pairs:
        if isinstance(getattr(stream, "cuda_stream", None), int):  # a torch.cuda.Stream
            names.setdefault(stream.cuda_stream, role)
    out: dict[str, list[float]] = {}
    for handle, (reserved, active) in segments_by_stream(device).items():
        entry = out.setdefault(names.get(handle, "other"), [0.0, 0.0])
        entry[0] += reserved / _GIB
        entry[1] += active / _GIB
    return out


def time_stage(device: torch.device, fn: Callable[[], T]) -> tuple[float, T]:
    """Milliseconds of ``fn()`` run alone, and its result (the hardware bound's stages).

    CUDA: the device is drained first (``synchronize``), then a pair of events on the
    current stream brackets ``fn``; the host waits for the end event before reading
    it. Work ``fn`` issues on other streams counts only where the current stream
    waits for it (collectives' ``wait()``), which every stage here does before it
    returns. Host syncs inside ``fn`` (the splits ``.tolist()``) are included.
    CPU: host wall time; every op has finished when ``fn`` returns."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t0) * 1e3, out
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()  # host sync: the clock is read only once the stage is done
    return start.elapsed_time(end), out


def free_device_memory(device: torch.device) -> None:
    """Between runs: drop unreachable objects (pipelines hold reference cycles) and
    hand cached blocks back, so the next run's reserved memory starts from its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
