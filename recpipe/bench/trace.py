"""What a torch.profiler trace of a few steady-state ``progress()`` calls says about one bench
row: GPU busy time, GPU time by kernel class, host time per call and by phase, host syncs by
site, and the device work of the UVM cache's ops (docs/benchmarking.md, "Profiled steps")."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from recpipe.bench.measure import percentile

__all__ = ["KERNEL_CLASSES", "PROGRESS_RANGE", "Event", "Trace", "combine_ranks", "intersection_length",
           "kernel_class", "merge_intervals", "parse_chrome_trace", "phase_name", "profile_progress",
           "summarize_trace", "union_length"]

PROGRESS_RANGE = "bench.progress"
LIBRARY_TOP = 8  # library ranges kept per row
_RANGE = re.compile(r"^## (.+) ##$")
_RECORD_FUNCTION = re.compile(r'record_function\(\s*f?"(## .*? ##)"', re.DOTALL)
_CACHE_OP = re.compile(r"^(fbgemm|recpipe)::.*cache")  # FBGEMM's cache ops, recpipe's populate (cache_fill)
_ROW_MOVES = re.compile(r"lru_cache_insert|_move_kernel")  # the kernels that move cache rows
# CUDA calls that return only once the device has caught up (runtime and driver names)
_BLOCKING = frozenset({"cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
                       "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize"})

Interval = tuple[float, float]

# GPU time by kernel class: (class, pattern searched in the kernel's name), the first match wins;
# memcpy and memset records are "copies", a kernel no pattern matches is "other". Inductor names its
# Triton kernels by template: poi(ntwise), red(uction), per(sistent reduction), tem(plate: matmuls).
_KERNEL_PATTERNS = tuple((cls, re.compile(p)) for cls, p in (
    ("communication", r"\bnccl"), ("tbe_forward", r"embedding\w*_codegen_forward"),
    ("tbe_backward", r"embedding\w*_backward_codegen"), ("optimizer", r"multi_tensor_apply_kernel"),
    ("gemm", r"\btriton_(tem|mm)|gemm|gemv|cutlass|cublas|nvjet|xmma"),
    ("reduction", r"\btriton_(red|per)_|reduce_kernel"), ("elementwise", r"\btriton_poi_|elementwise_kernel"),
))
KERNEL_CLASSES = ("elementwise", "gemm", "tbe_forward", "tbe_backward", "optimizer", "communication", "copies",
                  "reduction", "other")  # the report's column order


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points (touching ones merged)."""
    out: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def union_length(intervals: Iterable[Interval]) -> float:
    return sum(b - a for a, b in merge_intervals(intervals))


def intersection_length(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """Length of the points in both unions (two-pointer walk over the merged lists)."""
    x, y = merge_intervals(a), merge_intervals(b)
    i, j, total = 0, 0, 0.0
    while i < len(x) and j < len(y):
        total += max(0.0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


class Event(NamedTuple):
    """A device op (``cat`` kernel, gpu_memcpy or gpu_memset; ``tid``: its stream), a host range (user_annotation,
    cpu_op) or a CUDA runtime or driver call (with the correlation id of its launch). Microseconds."""

    name: str
    start: float
    end: float
    tid: Any  # the host thread, or a device op's stream
    cat: str
    correlation: int | None = None


@dataclass
class Trace:
    device_ops: list[Event] = field(default_factory=list)
    ranges: list[Event] = field(default_factory=list)
    runtime: list[Event] = field(default_factory=list)

    @property
    def launches(self) -> dict[int, tuple[Any, float]]:
        """correlation -> (host thread, time) of the call that launched it."""
        return {c.correlation: (c.tid, c.start) for c in self.runtime if c.correlation is not None}


def parse_chrome_trace(trace: dict[str, Any] | list[dict[str, Any]]) -> Trace:
    """The events this module reads from a Chrome trace (``export_chrome_trace``)."""
    out = Trace()
    for e in trace["traceEvents"] if isinstance(trace, dict) else trace:
        if e.get("ph") != "X":
            continue
        cat, args, name, tid = str(e.get("cat", "")).lower(), e.get("args") or {}, str(e.get("name", "")), e.get("tid")
        start, end, corr = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), args.get("correlation")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            stream = args.get("stream", tid)
            out.device_ops.append(Event(name, start, end, int(stream) if str(stream).isdigit() else -1, cat, corr))
        elif cat in ("cuda_runtime", "cuda_driver"):
            out.runtime.append(Event(name, start, end, tid, cat, None if corr is None else int(corr)))
        elif cat in ("user_annotation", "cpu_op"):
            out.ranges.append(Event(name, start, end, tid, cat))
    return out


@functools.lru_cache(maxsize=1)
def torchrec_phase_templates() -> tuple[tuple[re.Pattern[str], str], ...]:
    """The ``## ... ##`` ranges TorchRec's train pipelines open, read from its sources, as (regex
    of their names, phase name): ``## forward {self.contexts[0].index} ##`` -> (``## forward .+? ##``,
    ``forward``). Literal names come first (``## backward ##`` before ``## backward {i} ##``)."""
    spec = importlib.util.find_spec("torchrec.distributed.train_pipeline")
    found: dict[str, None] = {}
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for path in sorted(Path(folder).glob("*.py")):
            found.update(dict.fromkeys(_RECORD_FUNCTION.findall(path.read_text())))
    out = []
    for template in sorted(found, key=lambda t: "{" in t):
        parts = re.split(r"\{[^}]*\}", template)
        name = re.sub(r"\s+", " ", "".join(parts).strip("# ")).replace(" :", ":").strip(" :")
        out.append((re.compile(".+?".join(re.escape(part) for part in parts) + "$"), name))
    return tuple(out)


def phase_name(name: str) -> tuple[str, str] | None:
    """(source, phase) of a host range that names a phase, else None: ("recpipe", step) for ``recpipe.<step>``,
    ("torchrec", phase) for TorchRec's train pipelines' ranges, ("library", name) for other ``## name ##``."""
    if name.startswith("recpipe."):
        return "recpipe", name[len("recpipe."):]
    if not _RANGE.match(name):
        return None
    for pattern, phase in torchrec_phase_templates():
        if pattern.match(name):
            return "torchrec", phase
    return "library", re.sub(r"\s+", " ", re.sub(r"\b\d+\b", "", _RANGE.match(name).group(1))).strip()


def kernel_class(name: str, kind: str = "kernel") -> str:
    """The class of a device record of the trace (``KERNEL_CLASSES``)."""
    if kind != "kernel":
        return "copies"
    return next((cls for cls, pattern in _KERNEL_PATTERNS if pattern.search(name)), "other")


def _per_step(x: float, steps: int) -> float:
    return x / 1e3 / steps  # microseconds in the trace -> milliseconds per step


def _phases(trace: Trace, calls: list[Interval], steps: int) -> dict[str, Any]:
    by_phase: dict[str, list[Interval]] = {}
    library: dict[str, list[Interval]] = {}
    sources: set[str] = set()
    for r in trace.ranges:
        named = phase_name(r.name) if r.cat == "user_annotation" else None
        if named:
            sources.update({named[0]} - {"library"})
            (library if named[0] == "library" else by_phase).setdefault(named[1], []).append((r.start, r.end))

    def per_step(ranges: dict[str, list[Interval]]) -> dict[str, float]:
        ms = {p: _per_step(intersection_length(iv, calls), steps) for p, iv in ranges.items()}
        return dict(sorted(ms.items(), key=lambda kv: -kv[1]))

    in_any = intersection_length([i for iv in by_phase.values() for i in iv], calls)
    out: dict[str, Any] = {"phases_ms": per_step(by_phase),
                           "outside_phases_ms": _per_step(union_length(calls) - in_any, steps),
                           "library_ms": dict(list(per_step(library).items())[:LIBRARY_TOP])}
    if not by_phase:
        out["phases_reason"] = ("no phase ranges in the trace (recpipe.<step> or TorchRec's pipeline ## name ##): "
                                "the pipeline opens none")
    return dict(out, phase_source=", ".join(sorted(sources)) or None)


def _cache_work(trace: Trace, steps: int) -> dict[str, Any] | None:
    """Device work launched in FBGEMM's cache ops and recpipe's populate (a record_function), by op; its overlap."""
    cache_ranges = [r for r in trace.ranges if _CACHE_OP.match(r.name)]
    # correlation -> the outermost cache op around the launch (lru_cache_populate, not what it calls inside)
    owner: dict[int, str] = {}
    for corr, (tid, t) in trace.launches.items():
        holding = [r for r in cache_ranges if r.tid == tid and r.start <= t <= r.end]
        if holding:
            owner[corr] = max(holding, key=lambda r: r.end - r.start).name
    mine = [op for op in trace.device_ops if op.correlation in owner]
    if not mine:
        return None
    others = [op for op in trace.device_ops if op.correlation not in owner]
    compute = [(op.start, op.end) for op in others if op.cat == "kernel" and not op.name.startswith("nccl")]
    spans = [(op.start, op.end) for op in mine]
    by_op: dict[str, list[Interval]] = {}
    for op in mine:
        by_op.setdefault(owner[op.correlation], []).append((op.start, op.end))
    gpu, overlap = union_length(spans), intersection_length(spans, [(op.start, op.end) for op in others])
    moves = union_length((op.start, op.end) for op in mine if _ROW_MOVES.search(op.name))
    return {"gpu_ms": _per_step(gpu, steps), "overlap_ms": _per_step(overlap, steps),
            "overlap_compute_ms": _per_step(intersection_length(spans, compute), steps),
            "exposed_ms": _per_step(gpu - overlap, steps), "overlap_fraction": overlap / gpu if gpu else None,
            "by_op_ms": {name: _per_step(union_length(iv), steps) for name, iv in sorted(by_op.items())},
            "insert_kernels_ms": _per_step(moves, steps), "kernels_per_step": len(mine) / steps,
            "streams": sorted({op.tid for op in mine})}


def _host_syncs(trace: Trace, calls: list[Interval], steps: int) -> dict[str, Any]:
    """The blocking CUDA calls inside ``calls`` (a synchronize, or a copy to pageable memory),
    per step and by site: the innermost phase, and the outermost and innermost CPU ops around it."""
    pageable = {op.correlation for op in trace.device_ops if op.cat == "gpu_memcpy" and "Pageable" in op.name
                and ("DtoH" in op.name or "Device -> Pageable" in op.name)}
    syncs = [c for c in trace.runtime
             if (c.name in _BLOCKING or (c.name.startswith(("cudaMemcpy", "cuMemcpy")) and c.correlation in pageable))
             and any(a <= c.start <= b for a, b in calls)]
    phases = [r for r in trace.ranges if r.cat == "user_annotation" and (phase_name(r.name) or ("", ""))[0]
              in ("recpipe", "torchrec")]
    ops = [r for r in trace.ranges if r.cat == "cpu_op"]
    by_site: dict[str, list[float]] = {}
    for c in syncs:
        holding = [r for r in phases if r.start <= c.start <= r.end]
        phase = phase_name(min(holding, key=lambda r: r.end - r.start).name)[1] if holding else "outside phases"
        mine = sorted((r for r in ops if r.tid == c.tid and r.start <= c.start <= r.end), key=lambda r: r.start - r.end)
        where = (mine[0].name if len(mine) == 1 else f"{mine[0].name} > {mine[-1].name}") if mine else c.name
        by_site.setdefault(f"{phase}: {where}", []).append(c.end - c.start)
    return {"per_step": len(syncs) / steps, "blocked_ms": _per_step(sum(c.end - c.start for c in syncs), steps),
            "by_site": {site: {"per_step": len(d) / steps, "blocked_ms": _per_step(sum(d), steps)}
                        for site, d in sorted(by_site.items(), key=lambda kv: -sum(kv[1]))}}


def summarize_trace(trace: Trace, steps: int, device_type: str) -> dict[str, Any]:
    """Per-step numbers of one rank's trace of ``steps`` calls (module docstring)."""
    calls = [(r.start, r.end) for r in trace.ranges if r.name == PROGRESS_RANGE]
    if len(calls) != steps:
        raise ValueError(f"expected {steps} {PROGRESS_RANGE!r} ranges in the trace, found {len(calls)}")
    host = [(b - a) / 1e3 for a, b in calls]
    ops = trace.device_ops
    window = max([b for _, b in calls] + [op.end for op in ops]) - min(a for a, _ in calls)
    out = {"steps": steps, "host_ms_per_call": host, "host_ms_p50": percentile(host, 50),
           "window_ms": _per_step(window, steps), **_phases(trace, calls, steps)}
    if not ops:
        reason = ("n/a: CPU run (no device kernels in the trace)" if device_type != "cuda"
                  else "n/a: no kernel in the trace (CUDA activity not recorded)")
        return dict(out, gpu_busy_ms=None, gpu_busy_reason=reason)
    streams: dict[int, list[Interval]] = {}
    classes = dict.fromkeys(KERNEL_CLASSES, 0.0)
    for op in ops:
        streams.setdefault(op.tid, []).append((op.start, op.end))
        classes[kernel_class(op.name, op.cat)] += op.end - op.start
    return dict(
        out,
        gpu_busy_ms=_per_step(union_length((op.start, op.end) for op in ops), steps),
        nccl_busy_ms=_per_step(union_length((op.start, op.end) for op in ops if op.name.startswith("nccl")), steps),
        # the device's work outside NCCL's kernels (which count while they wait for peers): the floor's compute
        compute_busy_ms=_per_step(union_length((op.start, op.end) for op in ops if not op.name.startswith("nccl")),
                                  steps),
        device_ops_per_step=len(ops) / steps,
        streams_busy_ms={str(s): _per_step(union_length(iv), steps) for s, iv in sorted(streams.items())},
        kernel_classes_ms={c: _per_step(t, steps) for c, t in classes.items()},  # summed, overlap counted twice
        cache=_cache_work(trace, steps),
        host_syncs=_host_syncs(trace, calls, steps),
    )


@contextlib.contextmanager
def kineto_markers_dropped() -> Iterator[None]:
    """Without kineto's marker lines on stderr: torch's profiler library prints
    ``USDT:... SyncActivityProfilerHandler.cpp:52] profiler_start`` (and ``profiler_stop``) at
    each start and stop of a CPU-only profile (torch 2.13), at a log level above its errors,
    so ``KINETO_LOG_LEVEL`` cannot hide them without hiding its errors. The process's stderr
    (file descriptor 2) goes to a temporary file for the block; every other line is written
    back after it."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().splitlines(keepends=True) if not line.startswith(b"USDT:")]
            if kept:
                os.write(2, b"".join(kept))


def profile_progress(step: Callable[[], Any], steps: int, device: torch.device,
                     op_tables: tuple[str, str] | None = None) -> dict[str, Any]:
    """:func:`summarize_trace` of ``steps`` calls of ``step()`` (one ``pipe.progress(it)`` each) under
    torch.profiler; ``op_tables`` = (file, title): also append its op tables there, by self and total CPU
    time (on CUDA also device time)."""
    cuda = device.type == "cuda"
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    with kineto_markers_dropped():
        prof.start()
    try:
        for _ in range(steps):
            with record_function(PROGRESS_RANGE):
                step()
        if cuda:
            torch.cuda.synchronize()  # host sync: every launched kernel ends inside the window
    finally:
        with kineto_markers_dropped():
            prof.stop()
    if op_tables is not None:
        path, title = op_tables
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        sorts = [("self_cpu_time_total", 25), ("cpu_time_total", 40), ("self_device_time_total", 40)][:3 if cuda else 2]
        averages = prof.key_averages()
        tables = "\n".join(averages.table(sort_by=key, row_limit=n) for key, n in sorts)
        with open(path, "a") as f:
            f.write(f"\n===== {title}: {steps} steps =====\n{tables}\n")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = parse_chrome_trace(json.loads(path.read_text()))
    return summarize_trace(trace, steps, device.type)


_SLOWEST = ("gpu_busy_ms", "compute_busy_ms", "host_ms_p50", "window_ms")  # per row: the slowest rank's


def combine_ranks(per_rank: list[dict[str, Any] | None]) -> dict[str, Any]:
    """The row's trace: busy time, host time per call and window of the slowest rank (it sets the step);
    phases, streams, cache work and host syncs of rank 0; each rank's headline numbers under ``per_rank``."""
    if bad := [f"rank {r}: {t.get('reason', '?') if t else 'no trace'}" for r, t in enumerate(per_rank)
               if not t or t.get("status") != "ok"]:
        return {"status": "failed", "reason": " | ".join(bad)}
    out = {k: v for k, v in per_rank[0].items() if k != "host_ms_per_call"}
    for key in _SLOWEST:
        values = [t[key] for t in per_rank if t.get(key) is not None]
        out[key] = max(values) if values else None
    out["per_rank"] = [{k: t.get(k) for k in (*_SLOWEST, "nccl_busy_ms", "device_ops_per_step")} for t in per_rank]
    return out
