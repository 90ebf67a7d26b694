"""Markdown of the optional sections of a bench record: the hardware bound
(``--bound``), the multi-pass prefetch sweep (``--multipass``), weak scaling
(always: the planner's prediction; with ``--baseline``: efficiency), plots.
Each renderer reads the section's JSON dict, so ``bench.md`` never says more than
``bench.json`` holds. Missing numbers print as '-' with the reason beside them."""

from __future__ import annotations

from typing import Any

from recpipe.bench.report import grid

__all__ = ["render_sections"]

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
    lines = ["## Hardware bound: each stage alone", ""]
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
    lines += [f"**Bound: {bound['bound_ms']:.3f} ms per step, {bound['bound_resource']}-bound** "
              "(the main table's *x bound* = P50 / this).", ""]
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
    if "weak_scaling" in sections:
        lines += weak_scaling_md(sections["weak_scaling"])
    plots = sections.get("plots")
    if plots:
        written = ", ".join(f"`{p}`" for p in plots.get("written", [])) or "none"
        lines += [f"Plots: {written}" + (f" ({plots['reason']})" if plots.get("reason") else ""), ""]
    return lines
