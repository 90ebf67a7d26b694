"""Markdown of each row's profiled steps beside the main table: GPU busy time, GPU time
by kernel class, host time by phase, host syncs, UVM-cache metrics (:func:`rows_md`).
Each renderer reads the row's JSON fields, so ``bench.md`` never says more than
``bench.json`` holds; a missing number prints as '-' with the reason beside it."""

from __future__ import annotations

from typing import Any

from recpipe.bench.report import grid
from recpipe.bench.trace import KERNEL_CLASSES

__all__ = ["kernel_classes_table", "rows_md"]


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


# ------------------------------------------------------------------ per row
def _row_name(r: Any) -> list[str]:
    return [r.pipeline, r.impl]


def _unmeasured(r: Any, header: tuple[str, ...], note: str) -> list[str]:
    """A row's cells when the section has no numbers for it: dashes and the reason."""
    return _row_name(r) + ["-"] * (len(header) - 3) + [note]


def busy_md(rows: list[Any]) -> list[str]:
    traced = [r for r in rows if r.status == "ok" and r.trace]
    if not traced:
        return []
    lines = ["## GPU busy time and host time (profiled steps)", "",
             "Per step, from a torch.profiler trace of the steps after the timed ones (`recpipe/bench/trace.py`): "
             "GPU busy = union of kernel/memcpy/memset intervals over all streams (NCCL kernels count while they "
             "wait); x GPU busy = P50 / GPU busy; host ms/call under the profiler beside the timed one; "
             "window = first call start to last kernel end, per step.", ""]
    header = ("pipeline", "impl", "P50 ms", "GPU busy ms", "x GPU busy", "NCCL busy ms", "device ops/step",
              "host ms/call (profiled)", "host ms/call (timed)", "window ms", "busy ms by stream", "note")
    body = []
    for r in traced:
        t = r.trace
        if t.get("status") != "ok":
            body.append(_unmeasured(r, header, f"trace {t.get('status')}: {t.get('reason')}"))
            continue
        streams = ", ".join(f"{s}: {ms:.2f}" for s, ms in (t.get("streams_busy_ms") or {}).items())
        body.append(_row_name(r) + [
            _f(r.step_ms.get("p50"), ".2f"), _f(t.get("gpu_busy_ms"), ".2f"), _f(r.x_busy, ".2f"),
            _f(t.get("nccl_busy_ms"), ".2f"), _f(t.get("device_ops_per_step"), ".0f"), _f(t.get("host_ms_p50"), ".2f"),
            _f(r.host_ms.get("p50"), ".2f"), _f(t.get("window_ms"), ".2f"), streams or "-",
            t.get("gpu_busy_reason", "")])
    return lines + [grid(header, body, markdown=True), ""]


def kernel_classes_table(rows: list[Any], markdown: bool = True) -> str:
    """GPU ms per step by kernel class (``trace.KERNEL_CLASSES``) and its share of the
    summed kernel time, for every row whose trace has kernels; '' if none has."""
    mine = [r for r in rows if r.status == "ok" and (r.trace or {}).get("kernel_classes_ms")]
    header = ("pipeline", "impl", "GPU busy ms", *KERNEL_CLASSES, "GEMM + TBE ms")
    body = []
    for r in mine:
        ms = r.trace["kernel_classes_ms"]
        total = sum(ms.values()) or 1.0
        floor = ms["gemm"] + ms["tbe_forward"] + ms["tbe_backward"]
        body.append(_row_name(r) + [_f(r.trace.get("gpu_busy_ms"), ".3f")]
                    + [f"{ms[c]:.3f} ({ms[c] / total:.0%})" for c in KERNEL_CLASSES] + [f"{floor:.3f}"])
    return grid(header, body, markdown) if body else ""


def kernel_classes_md(rows: list[Any]) -> list[str]:
    table = kernel_classes_table(rows)
    if not table:
        return []
    return ["## GPU time by kernel class (profiled steps)", "",
            "Per step, the summed device time of each class's kernels (copies: memcpy and memset; kernels on "
            "overlapping streams count in full, so the classes can add up to more than GPU busy), with its share "
            "of the sum. Classes by kernel name (`recpipe/bench/trace.py`): GEMM includes cuBLAS, CUTLASS and "
            "inductor's matmul templates; optimizer: multi-tensor (foreach, fused) kernels; GEMM + TBE is what "
            "no fusion removes. Rank 0.", "", table, ""]


def phases_md(rows: list[Any]) -> list[str]:
    """Host ms per step by phase, one table per implementation (their phases differ)."""
    lines: list[str] = []
    for impl in dict.fromkeys(r.impl for r in rows):
        mine = [r for r in rows if r.impl == impl and r.status == "ok" and r.trace.get("status") == "ok"]
        names = list(dict.fromkeys(p for r in mine for p in r.trace.get("phases_ms", {})))
        if not mine:
            continue
        if not lines:
            lines = ["## Host time by phase (profiled steps)", "",
                     "Host ms per step inside each phase's ranges (recpipe: `recpipe.<step>`; TorchRec: its train "
                     "pipelines' `## name ##` ranges). Phases can nest, so they may add up to more than the call. "
                     "Last column: the largest ranges TorchRec's sharded modules open (under both implementations).",
                     ""]
        header = ("pipeline", "host ms/call", *names, "outside phases", "TorchRec module ranges, ms", "note")
        body = [[r.pipeline, _f(r.trace.get("host_ms_p50"), ".3f"),
                 *(_f(r.trace["phases_ms"].get(p), ".3f") for p in names), _f(r.trace.get("outside_phases_ms"), ".3f"),
                 "; ".join(f"{k} {_f(v, '.3f')}" for k, v in list(r.trace.get("library_ms", {}).items())[:4]),
                 r.trace.get("phases_reason", "")] for r in mine]
        lines += [f"{impl}:", "", grid(header, body, markdown=True), ""]
    return lines


def host_syncs_md(rows: list[Any]) -> list[str]:
    """The blocking CUDA calls per step of each traced row, by site (recpipe/bench/trace.py)."""
    traced = [r for r in rows if r.status == "ok" and r.trace.get("status") == "ok" and r.trace.get("host_syncs")]
    if not traced:
        return []
    lines = ["## Host syncs (profiled steps)", "",
             "CUDA calls inside `progress()` that block the host until the device catches up (stream, event or "
             "device synchronize, a synchronous copy, a copy to pageable host memory: `.item()`, `.tolist()`, "
             "`.cpu()`), per step, with the host time blocked in them. Site: the pipeline phase around the call, "
             "then the outermost and innermost CPU ops of its thread that hold it. Rank 0.", ""]
    header = ("pipeline", "impl", "syncs/step", "blocked ms/step", "sites (syncs/step, blocked ms/step)")
    body = []
    for r in traced:
        hs = r.trace["host_syncs"]
        sites = "; ".join(f"{site} ({v['per_step']:.1f}, {v['blocked_ms']:.3f})"
                          for site, v in list(hs["by_site"].items())[:5] if v["per_step"] > 0)
        body.append(_row_name(r) + [_f(hs["per_step"], ".1f"), _f(hs["blocked_ms"], ".3f"), sites or "-"])
    return lines + [grid(header, body, markdown=True), ""]


def cache_md(rows: list[Any]) -> list[str]:
    cached = [r for r in rows if r.status == "ok" and r.cache]
    if not cached:
        return []
    lines = ["## UVM cache (prefetch and the same cached tables without it)", "",
             "FBGEMM's cache counters over the timed steps (`recpipe/bench/uvm_cache.py`): hit rate = 1 - unique "
             "misses / unique ids; rows fetched = rows copied into the cache per step; UVM lookups = ids read from "
             "host memory (no free cache slot). Cache full: share of slots holding a row after the timed steps (a "
             "cache that is not full evicts nothing: its size does not matter yet). Cache work = device time of "
             "FBGEMM's cache ops in the profiled steps, overlapped with other device work (in brackets: with "
             "compute kernels) or alone (exposed). H2D GB/s = bytes fetched / GPU time of lru_cache_populate (all "
             "its kernels), or of its insert kernels (the copy). Per rank: the rank that fetches most.", ""]
    header = ("pipeline", "impl", "hit rate", "rows fetched/step", "MB fetched/step", "UVM lookups/step",
              "cache full", "evicted/step", "cache work ms", "overlapped ms (with compute)", "exposed ms",
              "H2D GB/s (populate)",
              "H2D GB/s (insert)", "note")
    body = []
    for r in cached:
        c = r.cache
        if "hit_rate" not in c:
            body.append(_unmeasured(r, header, c.get("reason", "")))
            continue
        body.append(_row_name(r) + [
            _f(c["hit_rate"], ".3f"), _f(c.get("rows_fetched_per_step"), ",.0f"),
            _f(c["bytes_fetched_per_step"] / 1e6, ",.2f"), _f(c.get("uvm_lookups_per_step"), ",.0f"),
            _pct(c.get("occupancy")), _f(c.get("evicted_per_step"), ",.0f"), _f(c.get("gpu_ms"), ".3f"),
            f"{_f(c.get('overlap_ms'), '.3f')} ({_f(c.get('overlap_compute_ms'), '.3f')})", _f(c.get("exposed_ms"), ".3f"),
            _f(c.get("h2d_GB_per_s_populate"), ",.1f"), _f(c.get("h2d_GB_per_s_insert"), ",.1f"),
            "" if "gpu_ms" in c else "no cache work in the trace"])
    return lines + [grid(header, body, markdown=True), ""]


def rows_md(rows: list[Any]) -> list[str]:
    """The per-row sections that follow the main table."""
    return busy_md(rows) + kernel_classes_md(rows) + phases_md(rows) + host_syncs_md(rows) + cache_md(rows)
