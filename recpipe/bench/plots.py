"""PNG plots of a bench record (matplotlib, Agg backend; rank 0 only):

* ``bench_step_time.png``: P50 step time per pipeline and implementation, a whisker up to
  P90, each round's P50 as a dot (``--rounds``), the GPU busy time per step as a black
  line across each bar (the step cannot be shorter), the host time per call as a triangle;
* ``bench_memory.png``: peak allocated vs reserved (not on CPU: no allocator numbers).

Plotting never fails the bench: an error becomes the ``plots`` section's reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["MEMORY", "STEP_TIME", "write_plots"]

STEP_TIME, MEMORY = "bench_step_time.png", "bench_memory.png"
_COLORS = {"recpipe": "tab:blue", "torchrec": "tab:orange", "torchrec_pt2": "tab:green"}


def _step_time(plt: Any, path: Path, rows: list[Any]) -> str:
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


def write_plots(out_dir: str | Path, rows: list[Any]) -> dict[str, Any]:
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
            written.append(_step_time(plt, out / STEP_TIME, rows))
        if any(r.status == "ok" and r.memory.get("peak_alloc_gib") is not None for r in rows):
            written.append(_memory(plt, out / MEMORY, rows))
        else:
            skipped.append(f"{MEMORY}: no allocator numbers (CPU run)")
    except Exception as err:  # noqa: BLE001 - plots must not lose the measurements
        skipped.append(f"plotting failed: {type(err).__name__}: {err}")
    finally:
        plt.close("all")
    return {"written": written, "reason": "; ".join(skipped)}
