"""Markdown of a bench record beyond the main table: per row, GPU busy time, host
time by phase and UVM-cache metrics (``rows_md``); the optional sections: stages
timed alone (``--bound``), the multi-pass prefetch sweep (``--multipass``), the
cache sweep (``--sweep-cache``), weak scaling (always: the planner's prediction;
with ``--baseline``: efficiency), plots.
Each renderer reads the section's JSON dict, so ``bench.md`` never says more than
``bench.json`` holds. Missing numbers print as '-' with the reason beside them."""

from __future__ import annotations

from typing import Any

from recpipe.bench.report import grid

__all__ = ["render_sections", "rows_md"]

MiB = float(1 << 20)


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _ms(stage: dict[str, Any], key: str) -> str:
    return "-" if not stage.get("ms") else f"{stage['ms'][key]:.3f}"


def _gbs(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}" if x >= 10 else f"{x:.3g}"


def _bytes(n: float) -> str:
    return f"{n / 1e6:,.2f} MB" if n >= 1e5 else f"{n / 1e3:,.1f} kB"


def _rate_line(label: str, rate: dict[str, Any] | None) -> str:
    if rate is None:
        return f"- {label}: n/a (stage not run)"
    if "reason" in rate:
        return f"- {label}: {rate['reason']}"
    line = (f"- {label}: {_bytes(rate['bytes'])} in {rate['p50_ms']:.3f} ms = "
            f"**{_gbs(rate['GB_per_s'])} GB/s** (rank {rate['rank']})")
    if "fraction_of_peak" in rate:
        line += f", {rate['fraction_of_peak']:.1%} of {rate['hbm_peak']} HBM peak ({rate['hbm_peak_GB_per_s']:,.0f} GB/s)"
    elif "hbm_peak_reason" in rate:
        line += f"; {rate['hbm_peak_reason']}"
    if "rows_in_per_batch" in rate:
        line += (f"; cache rows filled per batch {[round(x) for x in rate['rows_in_per_batch']]}, "
                 f"of them evictions {[round(x) for x in rate['rows_evicted_per_batch']]} (per rank)")
    return line + (f"; {rate['note']}" if "note" in rate else "")


def _prefetch_memory_line(pm: dict[str, Any]) -> str:
    """Stage (g)'s own memory (bytes in the JSON, MiB here)."""
    return (f"- cache prefetch memory: peak {_mib(pm['peak_alloc_bytes'])} MiB allocated above the allocation before "
            f"it (max over ranks {_mib(pm['peak_alloc_bytes_max'])}), prefetch stream holds "
            f"{_mib(pm['stream_reserved_bytes'])} MiB reserved "
            f"(max over ranks {_mib(pm['stream_reserved_bytes_max'])}); rank 0, largest over the timed chains")


def bound_md(bound: dict[str, Any]) -> list[str]:
    lines = ["## Stages timed alone (`--bound`): an estimate, not a bound", "",
             "Each stage is timed alone and the stages are summed per resource; a pipeline can step faster than "
             "this sum (stages run faster together than drained one by one), so it bounds nothing. The lower "
             "bound is the GPU busy time above.", ""]
    if bound.get("status") != "ok":
        return lines + [f"failed: {bound.get('reason')}", ""]
    chains = bound["chains"]
    lines += [
        f"{bound['method']}; {bound['timing']}; {chains['timed']} chains after {chains['warmup']} warm-up "
        f"({chains['kinds']}).",
        "",
    ]
    body = [[name, s["resource"] or "cross-check", _ms(s, "p50"), _ms(s, "p90"),
             s["what"] + (f" — {s['reason']}" if s.get("reason") else "")] for name, s in bound["stages"].items()]
    lines += [grid(("stage", "resource", "P50 ms", "P90 ms", "what"), body, markdown=True), ""]
    body = [[name, f"{r['ms']:.3f}", " + ".join(r["stages"])] for name, r in bound["resources"].items()]
    lines += [grid(("resource", "ms (sum of P50s)", "stages"), body, markdown=True), ""]
    lines += [f"**Stages alone: {bound['bound_ms']:.3f} ms per step, largest on {bound['bound_resource']}** "
              "(the main table's *x stages alone* = P50 / this).", ""]
    bw = bound["bandwidth"]
    lines += ["Achieved bandwidth (decimal GB/s, at the stage's P50, on the rank where it is slowest):", ""]
    lines.append(_rate_line("H2D copy of a batch", bw.get("h2d")))
    lines.append(_rate_line("TBE lookup (ids x dim x 4 B of rows read)", bw.get("tbe_lookup")))
    if "prefetch_h2d" in bw:
        lines.append(_rate_line("cache prefetch, rows filled from host memory", bw["prefetch_h2d"]))
    if "prefetch_memory" in bound:
        lines.append(_prefetch_memory_line(bound["prefetch_memory"]))
    lines.append(_rate_line("dense gradient all-reduce (bytes / time)", bw.get("dense_allreduce")))
    lines += [f"- note: {n}" for n in bound.get("notes", [])]
    return lines + [""]


def _mib(n_bytes: float | None) -> str:
    return "-" if n_bytes is None else f"{n_bytes / MiB:,.1f}"


def _gib_as_mib(gib: float | None) -> str:
    return "-" if gib is None else f"{gib * 1024:,.1f}"


def multipass_md(sweep: dict[str, Any]) -> list[str]:
    lines = ["## Multi-pass prefetch sweep", ""]
    if sweep.get("status") != "ok":
        body = [[",".join(map(str, sweep.get("passes", []))), f"skipped: {sweep.get('reason')}"]]
        return lines + [grid(("passes", "status"), body, markdown=True), ""]
    lines += [
        f"{sweep['pipeline']}; sharding.prefetch_min_pass_size={sweep['prefetch_min_pass_size']} (below it FBGEMM "
        "does not split). Measured: " + sweep["measured"] + " (rank 0). Predicted: " + sweep["predicted"] + ". MiB.",
        "",
    ]
    header = ("passes", "passes that happen (planner)", "step P50 ms", "prefetch P50 ms", "prefetch P90 ms",
              "step +MiB alloc", "step +MiB reserved", "planner prefetch terms", "planner per-step",
              "planner per-step + allocator", "status")
    body = []
    for p in sweep["points"]:
        plan, mem = p.get("planner", {}), p.get("memory_rank0") or {}
        eff = plan.get("passes_effective")
        pf = p.get("prefetch_ms") or {}
        body.append([
            str(p["passes"]), ", ".join(f"{k}: {v}" for k, v in eff.items()) if eff else plan.get("reason", "-"),
            _f((p.get("step_ms") or {}).get("p50"), ".3f"), _f(pf.get("p50"), ".3f"), _f(pf.get("p90"), ".3f"),
            _gib_as_mib(mem.get("step_peak_alloc_above_build_gib")),
            _gib_as_mib(mem.get("step_peak_reserved_above_build_gib")),
            _mib(plan.get("prefetch_terms_bytes")), _mib(plan.get("per_step_bytes")),
            _mib(plan.get("per_step_plus_allocator_bytes")),
            p["status"] + (f": {p['reason']}" if p.get("reason") else "") + (
                f" ({p['memory_reason']})" if p.get("memory_reason") else ""),
        ])
    lines += [grid(header, body, markdown=True), ""]
    lines += _prefetch_alone_md(sweep)
    warned = dict.fromkeys(w for p in sweep["points"] for w in p.get("planner", {}).get("warnings", []))
    return lines + [f"- planner: {w}" for w in warned] + ([""] if warned else [])


def _prefetch_alone_md(sweep: dict[str, Any]) -> list[str]:
    """The prefetch measured alone beside the planner's prediction, and the target line
    (records written before the measurement existed have neither)."""
    if "prefetch_memory" not in sweep:
        return []
    lines = ["Prefetch alone: " + sweep["prefetch_memory"] + ". MiB; rank 0 unless marked.", ""]
    header = ("passes", "prefetch alone P50 ms", "peak +MiB alloc", "peak +MiB alloc (max over ranks)",
              "prefetch stream MiB reserved", "predicted peak MiB", "measured / predicted",
              "measured / predicted (worst rank)", "status")
    body = []
    for p in sweep["points"]:
        pm = p.get("prefetch_memory") or {}
        per_rank = [x for x in pm.get("measured_over_predicted_per_rank") or [] if x is not None]
        worst = max(per_rank, key=lambda x: abs(x - 1.0), default=None)
        body.append([
            str(p["passes"]), _f((pm.get("ms") or {}).get("p50"), ".3f"), _mib(pm.get("peak_alloc_bytes")),
            _mib(pm.get("peak_alloc_bytes_max")), _mib(pm.get("stream_reserved_bytes")),
            _mib(pm.get("predicted_peak_bytes")), _f(pm.get("measured_over_predicted"), ".3f"), _f(worst, ".3f"),
            pm.get("status", p["status"]) + (f": {pm['reason']}" if pm.get("reason") else ""),
        ])
    lines += [grid(header, body, markdown=True), ""]
    target = sweep["prefetch_memory_target"]
    verdict = "**holds**" if target["holds"] else "**does not hold**"
    line = (f"- Target: measured prefetch peak within {target['tolerance']:.0%} of the planner's prediction "
            f"at every P, on every rank: {verdict}")
    if target["worst_ratio"] is not None:
        line += f" (worst measured/predicted {target['worst_ratio']:.3f} at P={target['worst_passes']})"
    if target["not_compared"]:
        line += f"; not compared at P={', '.join(map(str, target['not_compared']))} (no measurement or prediction)"
    return lines + [line, ""]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _recommendation_md(rec: dict[str, Any]) -> list[str]:
    if "reason" in rec:
        return [f"- recommendation: none ({rec['reason']})", ""]
    lines = [f"- prefetch was at least {rec['margin']:.0%} faster than sparse_dist at {rec['prefetch_wins']} of "
             f"{rec['points']} points" + (f", at sparse_dist hit rates up to {rec['prefetch_won_up_to_hit_rate']:.3f}"
                                          if "prefetch_won_up_to_hit_rate" in rec else "")
             + (f"; sparse_dist was as fast or faster from hit rate {rec['sparse_dist_won_from_hit_rate']:.3f}"
                if "sparse_dist_won_from_hit_rate" in rec else "") + "."]
    mine = rec.get("for_this_config")
    if mine:
        lines.append(f"- **For this config** (load factor {mine['cache_load_factor']}, Zipf {mine['zipf_alpha']}): "
                     f"nearest point {mine['nearest_point']}: **use {mine['pipeline']}** (prefetch / sparse_dist "
                     f"{mine['prefetch_over_sparse_dist']:.3f}, hit rate {_f(mine['hit_rate'], '.3f')}).")
        if mine.get("occupancy") is not None and mine["occupancy"] < 0.99:
            lines.append(f"- That point's cache was {mine['occupancy']:.0%} full after the timed steps: a long run "
                         "fills it and keeps more rows, so its hit rate is higher; compare training's own hit rate "
                         "(FBGEMM's uvm cache stats) with the hit rates above.")
    never, heavy = rec["targets"]["never_slower_by_2pct"], rec["targets"]["faster_by_10pct_where_misses_cost_15pct"]
    lines.append(f"- Target: prefetch never more than 2 % slower: {'**met**' if never['met'] else '**not met**'} "
                 f"(worst {never['worst']:.3f} at load factor, Zipf = {never['at']}).")
    short = [r for r in heavy["ratios"] if r > 0.90]
    verdict = "no point has cache work >= 15 % of sparse_dist's step" if heavy["met"] is None else (
        ("**met** at all" if heavy["met"] else f"**not met** at {len(short)} of") + f" {heavy['points']} such points "
        "(prefetch / sparse_dist " + ", ".join(f"{r:.3f}" for r in heavy["ratios"]) + ")")
    lines.append(f"- Target: prefetch at least 10 % faster where cache misses cost sparse_dist >= 15 %: {verdict}.")
    return lines + [""]


def sweep_md(sweep: dict[str, Any]) -> list[str]:
    lines = ["## Prefetch vs sparse_dist over cache load factor and Zipf alpha", ""]
    values = f"load factors {sweep['cache_load_factors']}, Zipf alphas {sweep['zipf_alphas']}"
    if sweep.get("status") != "ok":
        return lines + [f"Not measured ({values}): {sweep.get('reason')}", ""]
    lines += [f"{values}; {sweep['segments']}. Hit rate and rows fetched per step: sparse_dist's (the cache's "
              "behaviour on these ids; prefetch's in bench.json). Miss share: sparse_dist's exposed cache work / its "
              "P50. Cache full: share of slots holding a row at the end of the timed steps; below 100 % nothing was "
              "evicted and the load factor did not matter yet (raise --warmup to reach a full cache). Use: prefetch "
              "where it is at least 2 % faster.", ""]
    header = ("load factor", "Zipf", "prefetch P50 ms", "sparse_dist P50 ms", "prefetch / sparse_dist", "hit rate",
              "rows fetched/step", "cache full", "prefetch cache work ms (exposed)",
              "sparse_dist cache work ms (exposed)", "miss share", "use")
    body = []
    for p in sweep["points"]:
        pf, sd = p["prefetch"], p["sparse_dist"]

        def work(x: dict[str, Any]) -> str:
            return f"{_f(x.get('cache_gpu_ms'), '.2f')} ({_f(x.get('cache_exposed_ms'), '.2f')})"

        body.append([str(p["cache_load_factor"]), str(p["zipf_alpha"]),
                     _f((pf.get("step_ms") or {}).get("p50"), ".2f") if pf["status"] == "ok" else pf["status"],
                     _f((sd.get("step_ms") or {}).get("p50"), ".2f") if sd["status"] == "ok" else sd["status"],
                     _f(p.get("prefetch_over_sparse_dist"), ".3f"), _f(sd.get("hit_rate"), ".3f"),
                     _f(sd.get("rows_fetched_per_step"), ",.0f"), _pct(sd.get("occupancy")), work(pf), work(sd),
                     _pct(p.get("sparse_dist_miss_share")), p.get("winner", "-")])
    return lines + [grid(header, body, markdown=True), ""] + _recommendation_md(sweep["recommendation"])


def weak_scaling_md(ws: dict[str, Any]) -> list[str]:
    lines = ["## Weak scaling", ""]
    pred = ws.get("prediction", {})
    if "samples_per_s_per_gpu" in pred:
        lines.append(
            f"Planner model at world size {ws['world_size']} (`predict_scaling`, not a measurement; GPU model "
            f"{pred.get('gpu_model')}): bound {_f(pred.get('bound_ms'), '.3f')} ms ({pred.get('bound_resource', '?')}), "
            f"{pred['samples_per_s_per_gpu']:,.0f} samples/s per GPU.")
    else:
        lines.append(f"Planner model: {pred.get('reason', 'n/a')}")
    if "baseline" in ws:
        lines.append(f"Baseline `{ws['baseline']}`: {ws['baseline_world_size']} x {ws.get('baseline_gpu')}, "
                     f"{ws.get('baseline_date')}; efficiency = samples/s per GPU here / in the baseline (1 = perfect).")
    else:
        lines.append("No `--baseline` given: no efficiency columns.")
    lines.append("")
    if not ws["rows"]:
        return lines + ["No pipeline was measured.", ""]
    with_base = "baseline" in ws
    header = ["pipeline", "impl", "GPUs", "samples/s/GPU", "predicted samples/s/GPU", "measured/predicted"]
    header += ["baseline GPUs", "baseline samples/s/GPU", "efficiency"] if with_base else []
    body = []
    for r in ws["rows"]:
        cells = [r["pipeline"], r["impl"], str(r["world_size"]), _f(r["samples_per_s_per_gpu"], ",.0f"),
                 _f(r.get("predicted_samples_per_s_per_gpu"), ",.0f"), _f(r.get("measured_over_predicted"), ".3f")]
        if with_base:
            cells += [_f(r.get("baseline_world_size"), "d"), _f(r.get("baseline_samples_per_s_per_gpu"), ",.0f"),
                      _f(r.get("efficiency"), ".3f")]
        body.append(cells)
    lines += [grid(header, body, markdown=True), ""]
    return lines + ([ws["reason"], ""] if ws.get("reason") else [])


def render_sections(sections: dict[str, Any]) -> list[str]:
    """Markdown lines of every section present, in a fixed order."""
    lines: list[str] = []
    if "bound" in sections:
        lines += bound_md(sections["bound"])
    if "multipass" in sections:
        lines += multipass_md(sections["multipass"])
    if "cache_sweep" in sections:
        lines += sweep_md(sections["cache_sweep"])
    if "weak_scaling" in sections:
        lines += weak_scaling_md(sections["weak_scaling"])
    plots = sections.get("plots")
    if plots:
        written = ", ".join(f"`{p}`" for p in plots.get("written", [])) or "none"
        lines += [f"Plots: {written}" + (f" ({plots['reason']})" if plots.get("reason") else ""), ""]
    return lines


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


def streams_md(rows: list[Any]) -> list[str]:
    """Reserved memory by the stream whose segments hold it (``measure.reserved_by_stream``)."""
    mine = [r for r in rows if r.status == "ok" and r.memory.get("reserved_by_stream")]
    if not mine:
        return []
    lines = ["## Reserved memory by stream (after the timed steps)", "",
             "The caching allocator keeps freed blocks for the stream that allocated them, so memory reserved by one "
             "stream and free there is unusable by the others: per stream, GiB reserved (GiB live now), per rank. "
             "Reserved/alloc is the row's peak ratio.", ""]
    header = ("pipeline", "impl", "reserved/alloc", "rank", "reserved (live) GiB by stream")
    body = []
    for r in mine:
        for rank, streams in enumerate(r.memory["reserved_by_stream"]):
            cells = ", ".join(f"{name} {gib[0]:.2f} ({gib[1]:.2f})" for name, gib in
                              sorted(streams.items(), key=lambda kv: -kv[1][0]))
            body.append(_row_name(r) + [_f(r.memory.get("reserved_over_alloc"), ".3f"), str(rank), cells or "-"])
    return lines + [grid(header, body, markdown=True), ""]


def rows_md(rows: list[Any]) -> list[str]:
    """The per-row sections that follow the main table."""
    return busy_md(rows) + phases_md(rows) + host_syncs_md(rows) + cache_md(rows) + streams_md(rows)
