"""Markdown of each row's profiled steps beside the main table (docs/benchmarking.md, "Profiled
steps"): GPU time with its kernel classes, host time by phase, host syncs, the UVM cache.
Each reads the row's JSON fields; a missing number prints as '-' with the reason beside it."""

from __future__ import annotations

from typing import Any

from recpipe.bench.report import grid
from recpipe.bench.trace import KERNEL_CLASSES

__all__ = ["gpu_time_table", "rows_md"]


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _traced(rows: list[Any], key: str = "status") -> list[Any]:
    return [r for r in rows if r.status == "ok" and (r.trace or {}).get("status") == "ok" and r.trace.get(key)]


def gpu_time_table(rows: list[Any], markdown: bool = True) -> str:
    """Per traced row: GPU busy, NCCL busy, the window and busy time by stream, then GPU ms
    by kernel class with its share of the summed kernel time; '' when no row has kernels."""
    mine = _traced(rows, "kernel_classes_ms")
    header = ("pipeline", "impl", "GPU busy ms", "NCCL busy ms", "window ms", "busy ms by stream", *KERNEL_CLASSES,
              "GEMM + TBE ms")
    body = []
    for r in mine:
        t, ms = r.trace, r.trace["kernel_classes_ms"]
        total = sum(ms.values()) or 1.0
        streams = ", ".join(f"{s}: {v:.2f}" for s, v in t["streams_busy_ms"].items())
        classes = [f"{ms[c]:.3f} ({ms[c] / total:.0%})" for c in KERNEL_CLASSES]
        floor = ms["gemm"] + ms["tbe_forward"] + ms["tbe_backward"]
        body.append([r.pipeline, r.impl, _f(t["gpu_busy_ms"], ".3f"), _f(t["nccl_busy_ms"], ".3f"),
                     _f(t["window_ms"], ".2f"), streams, *classes, f"{floor:.3f}"])
    return grid(header, body, markdown) if body else ""


def _gpu_time_md(rows: list[Any]) -> list[str]:
    table = gpu_time_table(rows)
    return ["## GPU time by kernel class (profiled steps)", "",
            "Per step: GPU busy (the union of device intervals over all streams; NCCL kernels count while they wait), "
            "then each kernel class's summed device time and its share of the sum (kernels on overlapping streams "
            "count in full). GEMM + TBE is what no fusion removes. Rank 0's classes.", "", table, ""] if table else []


def _phases_md(rows: list[Any]) -> list[str]:
    """Host ms per step by phase, one table per implementation (their phases differ)."""
    lines: list[str] = []
    for impl in dict.fromkeys(r.impl for r in rows):
        mine = [r for r in _traced(rows) if r.impl == impl]
        names = list(dict.fromkeys(p for r in mine for p in r.trace["phases_ms"]))
        body = [[r.pipeline, _f(r.trace["host_ms_p50"], ".3f"), *(_f(r.trace["phases_ms"].get(p), ".3f")
                                                                    for p in names),
                 _f(r.trace["outside_phases_ms"], ".3f"), r.trace.get("phases_reason", "")] for r in mine]
        if body:
            header = ("pipeline", "host ms/call (profiled)", *names, "outside phases", "note")
            lines += [f"{impl}:", "", grid(header, body, markdown=True), ""]
    intro = ["## Host time by phase (profiled steps)", "", "Host ms per step inside each phase's ranges (recpipe: "
             "`recpipe.<step>`; TorchRec: its train pipelines' `## name ##` ranges). Phases can nest.", ""]
    return intro + lines if lines else []


def _host_syncs_md(rows: list[Any]) -> list[str]:
    body = []
    for r in _traced(rows, "host_syncs"):
        hs = r.trace["host_syncs"]
        sites = "; ".join(f"{site} ({v['per_step']:.1f}, {v['blocked_ms']:.3f})"
                          for site, v in list(hs["by_site"].items())[:5] if v["per_step"] > 0)
        body.append([r.pipeline, r.impl, _f(hs["per_step"], ".1f"), _f(hs["blocked_ms"], ".3f"), sites or "-"])
    header = ("pipeline", "impl", "syncs/step", "blocked ms/step", "sites (syncs/step, blocked ms/step)")
    return ["## Host syncs (profiled steps)", "",
            "CUDA calls inside `progress()` that block the host until the device catches up (synchronize, a "
            "synchronous copy, a copy to pageable memory: `.item()`, `.tolist()`), per step, with the time blocked. "
            "Site: the pipeline phase, then the outermost and innermost CPU ops holding the call. Rank 0.", "",
            grid(header, body, markdown=True), ""] if body else []


def _cache_md(rows: list[Any]) -> list[str]:
    header = ("pipeline", "impl", "hit rate", "rows fetched/step", "MB fetched/step", "UVM lookups/step",
              "cache full", "evicted/step", "cache work ms", "overlapped ms (with compute)", "exposed ms",
              "H2D GB/s (insert op)", "H2D GB/s (row moves)", "note")
    body = []
    for r in (r for r in rows if r.status == "ok" and r.cache):
        c = r.cache
        if "hit_rate" not in c:
            body.append([r.pipeline, r.impl] + ["-"] * (len(header) - 3) + [c.get("reason", "")])
            continue
        body.append([r.pipeline, r.impl, _f(c["hit_rate"], ".3f"), _f(c["rows_fetched_per_step"], ",.0f"),
                     _f(c["bytes_fetched_per_step"] / 1e6, ",.2f"), _f(c["uvm_lookups_per_step"], ",.0f"),
                     _f(c["occupancy"], ".1%"), _f(c["evicted_per_step"], ",.0f"), _f(c.get("gpu_ms"), ".3f"),
                     f"{_f(c.get('overlap_ms'), '.3f')} ({_f(c.get('overlap_compute_ms'), '.3f')})",
                     _f(c.get("exposed_ms"), ".3f"), _f(c.get("h2d_GB_per_s_populate"), ",.1f"),
                     _f(c.get("h2d_GB_per_s_insert"), ",.1f"),
                     c.get("populate_op", "") if "gpu_ms" in c else "no cache work in the trace"])
    return ["## UVM cache", "",
            "FBGEMM's cache counters over the timed steps, the cache work in the profiled steps (overlapped with "
            "other device work, in brackets with compute kernels, or exposed), and bytes fetched over the GPU time "
            "of the cache insert (note: its op) or of its row moves; the rank that fetches most (docs/benchmarking.md).",
            "", grid(header, body, markdown=True), ""] if body else []


def rows_md(rows: list[Any]) -> list[str]:
    """The per-row sections that follow the main table."""
    return _gpu_time_md(rows) + _phases_md(rows) + _host_syncs_md(rows) + _cache_md(rows) + _first_step_md(rows)


def _first_step_md(rows: list[Any]) -> list[str]:
    """The first step of each run (its first round): what compiling and capturing cost."""
    body = [[r.pipeline, r.impl, _f(r.first_step_s, ".2f"),
             ", ".join(f"{x:.2f}" for x in getattr(r, "first_step_s_rounds", [])[1:]) or "-", _f(r.build_s, ".1f")]
            for r in rows if getattr(r, "first_step_s", None)]
    if not body:
        return []
    return ["## First step", "", "Seconds of the first `progress()` call (to the device's end) of each run's first "
            "round (later rounds, in the same process, find the compiled kernels in inductor's cache): "
            "`pipeline.compile` compiles there, CUDA graphs are captured there; and the model's build.", "",
            grid(("pipeline", "impl", "first step s", "later rounds' first step s", "build s"), body, markdown=True), ""]
