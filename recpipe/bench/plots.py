"""PNG plots of a bench record (matplotlib, Agg backend; rank 0 only).

At most three files per run, unless it also sweeps the cache (a GPU machine returns few files per run):

* ``bench_step_time.png``: P50 step time per pipeline, recpipe beside TorchRec, with
  a whisker up to P90, each round's P50 as a dot (``--rounds``), the GPU busy time
  per step as a black line across each bar (the lower bound, from the profiled
  steps), the host time per call as a triangle, and the sum of the stages timed
  alone (``--bound``) as a dashed line;
* ``bench_memory.png``: peak allocated vs reserved per pipeline and implementation
  (not on CPU, where the allocator has no numbers);
* ``multipass.png``: the multi-pass sweep vs passes: the prefetch's own peak memory
  measured alone (allocated; the prefetch stream's reserved) beside the planner's
  prediction, measured step memory beside the planner's per-step terms, and the
  prefetch (in the pipeline and alone) and step times.

* ``cache_sweep.png`` (``--sweep-cache`` / ``--sweep-zipf``): step time of prefetch
  (solid) and sparse_dist (dashed) against Zipf alpha, one colour per cache load
  factor, each point labelled with its hit rate; and prefetch / sparse_dist against
  the hit rate (below 1: prefetch pays).

Plotting never fails the bench: errors (matplotlib missing, ...) become the reason
recorded in the ``plots`` section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["CACHE_SWEEP", "MEMORY", "MULTIPASS", "STEP_TIME", "write_plots"]

STEP_TIME, MEMORY, MULTIPASS, CACHE_SWEEP = "bench_step_time.png", "bench_memory.png", "multipass.png", "cache_sweep.png"
_COLORS = {"recpipe": "tab:blue", "torchrec": "tab:orange"}


def _step_time(plt: Any, path: Path, rows: list[Any], bound: dict[str, Any] | None) -> str:
    pipelines = list(dict.fromkeys(r.pipeline for r in rows))
    impls = [i for i in _COLORS if any(r.impl == i for r in rows)]
    width = 0.8 / len(impls)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(pipelines)), 4.5))
    labeled: set[str] = set()
    for k, impl in enumerate(impls):
        for x, name in enumerate(pipelines):
            row = next((r for r in rows if r.pipeline == name and r.impl == impl), None)
            pos = x + (k - (len(impls) - 1) / 2) * width
            if row is None or row.status != "ok":
                if row is not None:
                    ax.text(pos, 0, row.status, rotation=90, ha="center", va="bottom", fontsize=8, color="gray")
                continue
            p50, p90 = row.step_ms["p50"], row.step_ms["p90"]
            ax.bar(pos, p50, width, color=_COLORS[impl], yerr=[[0.0], [p90 - p50]], capsize=3,
                   label=None if impl in labeled else impl)
            labeled.add(impl)
            if row.gpu_busy_ms:  # the lower bound: the step cannot be shorter than its GPU busy time
                ax.hlines(row.gpu_busy_ms, pos - width / 2, pos + width / 2, colors="black", linewidth=2.5,
                          label=None if "busy" in labeled else "GPU busy per step (profiled)")
                labeled.add("busy")
            if row.host_ms.get("p50"):
                ax.scatter([pos], [row.host_ms["p50"]], marker="v", s=25, color="dimgray", zorder=3,
                           label=None if "host" in labeled else "host ms per progress() call")
                labeled.add("host")
            rounds = getattr(row, "round_p50_ms", None) or []
            if len(rounds) > 1:  # each round's own P50 (``--rounds``): the spread behind the bar
                ax.scatter([pos] * len(rounds), rounds, s=12, color="black", zorder=3,
                           label=None if "rounds" in labeled else "P50 of each round")
                labeled.add("rounds")
    if bound and bound.get("status") == "ok":
        ax.axhline(bound["bound_ms"], color="gray", linestyle="--",
                   label=f"stages alone (--bound) {bound['bound_ms']:.2f} ms: an estimate, not a bound")
    ax.set_xticks(range(len(pipelines)), pipelines)
    ax.set_ylabel("step time, ms (bar P50, whisker P90)")
    ax.set_title("recpipe bench: step time per pipeline")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path.name


def _memory(plt: Any, path: Path, rows: list[Any]) -> str:
    measured = [r for r in rows if r.status == "ok" and r.memory.get("peak_alloc_gib") is not None]
    labels = [f"{r.pipeline}\n{r.impl}" for r in measured]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(measured)), 4.5))
    xs = range(len(measured))
    ax.bar([x - 0.2 for x in xs], [r.memory["peak_alloc_gib"] for r in measured], 0.4, label="peak allocated")
    ax.bar([x + 0.2 for x in xs], [r.memory["peak_reserved_gib"] for r in measured], 0.4, label="peak reserved")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("GiB (max over ranks, model included)")
    ax.set_title("recpipe bench: peak GPU memory")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path.name


def _prefetch_alone(ax: Any, points: list[dict[str, Any]], tolerance: float | None) -> None:
    """The prefetch measured alone (peak allocated, prefetch stream reserved; rank 0)
    beside the planner's prediction, with the target's tolerance band around it."""

    def pairs(key: str) -> list[tuple[int, float]]:
        return [(p["passes"], p["prefetch_memory"][key] / float(1 << 20)) for p in points
                if (p.get("prefetch_memory") or {}).get(key) is not None]

    for label, key, style in (("measured peak +alloc", "peak_alloc_bytes", "-"),
                              ("measured prefetch stream reserved", "stream_reserved_bytes", "-"),
                              ("planner prediction", "predicted_peak_bytes", "--")):
        if pairs(key):
            ax.plot(*zip(*pairs(key)), marker="o", linestyle=style, label=label)
    predicted = pairs("predicted_peak_bytes")
    if predicted and tolerance is not None:
        xs, ys = zip(*predicted)
        ax.fill_between(xs, [y * (1 - tolerance) for y in ys], [y * (1 + tolerance) for y in ys], alpha=0.15,
                        color="gray", label=f"prediction +-{tolerance:.0%}")
    ax.set(xlabel="sharding.prefetch_passes", ylabel="MiB (rank 0)", title="prefetch alone: memory vs passes")
    ax.legend(fontsize=8)


def _multipass(plt: Any, path: Path, sweep: dict[str, Any]) -> str:
    points = [p for p in sweep["points"] if p["status"] == "ok"]
    xs = [p["passes"] for p in points]
    fig, (alone_ax, mem_ax, time_ax) = plt.subplots(1, 3, figsize=(16, 4.5))
    _prefetch_alone(alone_ax, points, (sweep.get("prefetch_memory_target") or {}).get("tolerance"))

    def series(get: Any) -> list[float | None]:
        return [get(p) for p in points]

    mib = float(1 << 20)
    lines = {
        "measured step +alloc (rank 0)": series(lambda p: (p.get("memory_rank0") or {}).get(
            "step_peak_alloc_above_build_gib")),
        "measured step +reserved (rank 0)": series(lambda p: (p.get("memory_rank0") or {}).get(
            "step_peak_reserved_above_build_gib")),
        "planner per-step": series(lambda p: p.get("planner", {}).get("per_step_bytes")),
        "planner prefetch terms": series(lambda p: p.get("planner", {}).get("prefetch_terms_bytes")),
    }
    for label, ys in lines.items():
        scale = 1024.0 if label.startswith("measured") else 1 / mib  # GiB -> MiB, bytes -> MiB
        pairs = [(x, y * scale) for x, y in zip(xs, ys) if y is not None]
        if pairs:
            mem_ax.plot(*zip(*pairs), marker="o", linestyle="-" if label.startswith("measured") else "--", label=label)
    # tick labels: configured passes, and (planner) the most passes any TBE really makes
    happen = [max((p.get("planner", {}).get("passes_effective") or {}).values(), default=None) for p in points]
    ticks = [f"{x}" if h in (None, x) else f"{x}\n({h} happen)" for x, h in zip(xs, happen)]
    mem_ax.set(xlabel="sharding.prefetch_passes", ylabel="MiB",
               title=f"step memory vs passes (min pass size {sweep['prefetch_min_pass_size']:,})")
    mem_ax.legend(fontsize=8)
    times = {"prefetch step P50 (pipeline)": lambda p: (p.get("prefetch_ms") or {}).get("p50"),
             "prefetch alone P50": lambda p: ((p.get("prefetch_memory") or {}).get("ms") or {}).get("p50"),
             "whole step P50": lambda p: (p.get("step_ms") or {}).get("p50")}
    for label, get in times.items():
        pairs = [(x, y) for x, y in zip(xs, series(get)) if y is not None]
        if pairs:
            time_ax.plot(*zip(*pairs), marker="o", label=label)
    time_ax.set(xlabel="sharding.prefetch_passes", ylabel="ms", title="time vs passes")
    time_ax.legend(fontsize=8)
    for ax in (alone_ax, mem_ax, time_ax):
        ax.set_xticks(xs, ticks)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path.name


def _cache_sweep(plt: Any, path: Path, sweep: dict[str, Any]) -> str:
    fig, (time_ax, ratio_ax) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, lf in enumerate(sweep["cache_load_factors"]):
        color = colors[k % len(colors)]
        points = [p for p in sweep["points"] if p["cache_load_factor"] == lf]
        for name, style in (("prefetch", "-"), ("sparse_dist", "--")):
            xy = [(p["zipf_alpha"], p[name]["step_ms"]["p50"], p[name].get("hit_rate")) for p in points
                  if p[name]["status"] == "ok"]
            if not xy:
                continue
            time_ax.plot([x for x, _, _ in xy], [y for _, y, _ in xy], linestyle=style, marker="o", color=color,
                         label=f"{name}, load factor {lf}")
            for x, y, hit in xy if name == "sparse_dist" else []:
                if hit is not None:
                    time_ax.annotate(f"{hit:.2f}", (x, y), textcoords="offset points", xytext=(0, 6), fontsize=7,
                                     ha="center", color=color)
        ratio = [(p["sparse_dist"].get("hit_rate"), p["prefetch_over_sparse_dist"]) for p in points
                 if p.get("prefetch_over_sparse_dist") is not None and p["sparse_dist"].get("hit_rate") is not None]
        if ratio:
            ratio_ax.scatter(*zip(*ratio), color=color, label=f"load factor {lf}")
    time_ax.set(xlabel="Zipf alpha of the ids", ylabel="step time P50, ms",
                title="prefetch (solid) vs sparse_dist (dashed); labels: hit rate")
    ratio_ax.axhline(1.0, color="gray", linestyle="--")
    ratio_ax.set(xlabel="cache hit rate (sparse_dist, unique ids)", ylabel="prefetch P50 / sparse_dist P50",
                 title="below 1: prefetch pays")
    for ax in (time_ax, ratio_ax):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path.name


def write_plots(out_dir: str | Path, rows: list[Any], sections: dict[str, Any]) -> dict[str, Any]:
    """Write the plots that have data; returns ``{"written": [...], "reason": ...}``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        return {"written": [], "reason": f"matplotlib not importable: {err}"}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    skipped: list[str] = []
    try:
        if any(r.status == "ok" for r in rows):
            written.append(_step_time(plt, out / STEP_TIME, rows, sections.get("bound")))
        if any(r.status == "ok" and r.memory.get("peak_alloc_gib") is not None for r in rows):
            written.append(_memory(plt, out / MEMORY, rows))
        else:
            skipped.append(f"{MEMORY}: no allocator numbers (CPU run)")
        sweep = sections.get("multipass")
        if sweep and sweep.get("status") == "ok" and any(p["status"] == "ok" for p in sweep["points"]):
            written.append(_multipass(plt, out / MULTIPASS, sweep))
        elif sweep:
            skipped.append(f"{MULTIPASS}: no sweep point was measured")
        grid = sections.get("cache_sweep")
        if grid and grid.get("status") == "ok" and any("prefetch_over_sparse_dist" in p for p in grid["points"]):
            written.append(_cache_sweep(plt, out / CACHE_SWEEP, grid))
        elif grid:
            skipped.append(f"{CACHE_SWEEP}: " + (grid.get("reason") or "no point measured both pipelines"))
    except Exception as err:  # noqa: BLE001 - plots must not lose the measurements
        skipped.append(f"plotting failed: {type(err).__name__}: {err}")
    finally:
        plt.close("all")
    return {"written": written, "reason": "; ".join(skipped)}
