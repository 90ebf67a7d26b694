"""What a bench record holds and how it is written: :class:`Row` (one pipeline and implementation, over ranks
and rounds), the header (resolved config, versions, GPU), ``bench.json``, ``bench.md`` (the table, then a section
per kind of profiled-step number: a missing one prints as '-' with the reason beside it) and the PNG plots."""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from recpipe.bench.measure import summarize_ms
from recpipe.bench.trace import KERNEL_CLASSES
from recpipe.config import RecpipeConfig

__all__ = ["MEMORY_PLOT", "STEP_TIME_PLOT", "Row", "cell", "environment", "format_table", "gpu_time_table", "grid",
           "md_section", "rows_md", "write_outputs", "write_plots"]

STEP_TIME_PLOT, MEMORY_PLOT = "bench_step_time.png", "bench_memory.png"
_COLORS = {"recpipe": "tab:blue", "torchrec": "tab:orange", "torchrec_pt2": "tab:green"}  # the plots, by impl


@dataclass
class Row:
    """One (pipeline, implementation) run; numbers are over ranks (see runner)."""

    pipeline: str
    impl: str  # "recpipe" or "torchrec"
    status: str = "ok"  # ok | skipped | failed
    reason: str = ""
    pipeline_class: str = ""
    options: dict[str, Any] = field(default_factory=dict)  # constructor keyword arguments
    config_overrides: dict[str, Any] = field(default_factory=dict)  # versus the given config
    notes: list[str] = field(default_factory=list)
    steps: int = 0
    step_ms: dict[str, float] = field(default_factory=dict)  # p50/p90/mean/min/max of per-step max over ranks
    step_ms_per_step: list[float] = field(default_factory=list)
    step_ms_p50_per_rank: list[float] = field(default_factory=list)
    round_p50_ms: list[float] = field(default_factory=list)  # P50 of each round (``--rounds``)
    samples_per_s: float | None = None  # global batch / P50 step time
    samples_per_s_per_gpu: float | None = None  # samples_per_s / world size (weak scaling keeps it flat)
    samples_per_s_wall: float | None = None  # global batch * steps / host wall of the timed steps
    wall_s: float | None = None
    host_ms: dict[str, float] = field(default_factory=dict)  # inside each call; near the step time = launch-bound
    host_ms_per_step: list[float] = field(default_factory=list)  # per step, the slowest rank's
    build_s: float | None = None
    first_step_s: float | None = None  # the first progress() call: compiles and captures (slowest rank)
    first_step_s_rounds: list[float] = field(default_factory=list)  # each round's (later: kernels cached)
    memory: dict[str, Any] = field(default_factory=dict)  # GiB, max over ranks, + per_rank
    torchrec_pipelined_modules: int | None = None
    gpu_busy_ms: float | None = None  # per profiled step, the slowest rank's (trace.py)
    x_busy: float | None = None  # P50 / GPU busy: the headline (1.0 = the GPU never idles)
    floor: dict[str, Any] = field(default_factory=dict)  # compute + collectives timed alone, x floor (floor.py)
    trace: dict[str, Any] = field(default_factory=dict)  # trace.summarize_trace over ranks (and rounds)
    cache: dict[str, Any] = field(default_factory=dict)  # UVM cache metrics (measure.cache_metrics), or {"reason": ...}
    # recpipe's rows: every step's loss per rank, and "equal" when they equal the same run in lockstep
    # (the host waiting for the device after every step: runner.lockstep_losses), else what differs
    step_losses: list[list[float]] = field(default_factory=list)
    check: str = ""

    def fill_rates(self, global_batch: int) -> None:
        """Statistics and rates from the per-step lists, ``step_ms_p50_per_rank``, ``wall_s`` and ``trace``."""
        self.steps, self.step_ms = len(self.step_ms_per_step), summarize_ms(self.step_ms_per_step)
        self.host_ms = summarize_ms(self.host_ms_per_step) if self.host_ms_per_step else {}
        self.samples_per_s = global_batch / (self.step_ms["p50"] / 1e3)
        self.samples_per_s_per_gpu = self.samples_per_s / (len(self.step_ms_p50_per_rank) or 1)
        self.samples_per_s_wall = global_batch * self.steps / self.wall_s if self.wall_s else None
        self.round_p50_ms = self.round_p50_ms or [self.step_ms["p50"]]
        self.gpu_busy_ms = self.trace.get("gpu_busy_ms")
        self.x_busy = self.step_ms["p50"] / self.gpu_busy_ms if self.gpu_busy_ms else None

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> "Row":
        """A row of a ``bench.json``; keys this version does not know are left out."""
        return cls(**{k: v for k, v in record.items() if k in cls.__dataclass_fields__})


def _version(*dist_names: str) -> str:
    for name in dist_names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return "unknown"


def _nccl_version() -> str | None:
    with contextlib.suppress(AttributeError, RuntimeError):
        v = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return None


def environment(device: torch.device, world_size: int, gpu_names: list[str]) -> dict[str, Any]:
    """Versions and hardware; ``gpu_names`` is every rank's device name."""
    cuda = device.type == "cuda"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "torch": torch.__version__, "fbgemm_gpu": _version("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-nightly"),
            "torchrec": _version("torchrec", "torchrec-nightly"), "cuda": torch.version.cuda,
            "nccl": _nccl_version() if cuda else None, "python": platform.python_version()},
        "gpu": {"name": ", ".join(sorted(set(gpu_names))) if cuda else "CPU (Gloo)",
                "count_visible": torch.cuda.device_count() if cuda else 0, "per_rank": gpu_names if cuda else []},
        "world_size": world_size, "device_type": device.type,
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") if cuda else None,
        "host": {"node": platform.node(), "cpus": os.cpu_count(), "processor": platform.processor()},
        "command": " ".join(sys.argv),
    }


_COLUMNS = ("pipeline", "impl", "P50 ms", "P90 ms", "GPU busy ms", "x GPU busy", "floor ms", "x floor", "host ms/call",
            "samples/s",
            "samples/s/GPU", "peak alloc GiB", "peak reserved GiB", "reserved/alloc", "step +GiB", "check", "note")


def cell(x: float | None, fmt: str) -> str:
    """A number of a table: '-' for None or NaN."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _cells(row: Row) -> list[str]:
    if row.status != "ok":
        return [row.pipeline, row.impl] + ["-"] * (len(_COLUMNS) - 3) + [f"{row.status}: {row.reason}"]
    mem = row.memory
    busy = cell(row.gpu_busy_ms, ".2f") if row.gpu_busy_ms is not None else ("n/a" if row.trace else "-")
    return [row.pipeline, row.impl, cell(row.step_ms.get("p50"), ".2f"), cell(row.step_ms.get("p90"), ".2f"), busy,
            cell(row.x_busy, ".2f"), cell(row.floor.get("floor_ms"), ".2f"), cell(row.floor.get("x_floor"), ".2f"),
            cell(row.host_ms.get("p50"), ".2f"), cell(row.samples_per_s, ",.0f"),
            cell(row.samples_per_s_per_gpu, ",.0f"), cell(mem.get("peak_alloc_gib"), ".2f"),
            cell(mem.get("peak_reserved_gib"), ".2f"), cell(mem.get("reserved_over_alloc"), ".3f"),
            cell(mem.get("step_peak_alloc_above_build_gib"), ".2f"), _check_cell(row.check), "; ".join(row.notes)]


def _check_cell(check: str) -> str:
    """The check column: equal, DIFFERS (a row not to publish), or - (TorchRec's rows, --no-check)."""
    if not check:
        return "-"
    return "equal" if check == "equal" else ("DIFFERS" if check.startswith("differs") else "not checked")


def grid(header: tuple[str, ...] | list[str], body: list[list[str]], markdown: bool = False) -> str:
    """A fixed-width text table, or a markdown one."""
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |" for cells in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(c[i]) for c in body)) if body else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header).rstrip(), fmt.format(*("-" * w for w in widths))]
    return "\n".join(out + [fmt.format(*c).rstrip() for c in body])


def format_table(rows: list[Row], markdown: bool = False) -> str:
    return grid(_COLUMNS, [_cells(r) for r in rows], markdown)


def md_section(title: str, intro: str, header: tuple[str, ...], body: list[list[str]]) -> list[str]:
    """A section of bench.md: its title, what it shows, the table; nothing without rows."""
    return [f"## {title}", "", intro, "", grid(header, body, markdown=True), ""] if body else []


def write_outputs(out_dir: str | Path, cfg: RecpipeConfig, header: dict[str, Any], rows: list[Row],
                  sections: dict[str, Any] | None = None, sections_md: list[str] | None = None) -> Path:
    """Write ``bench.json`` (``sections`` after the rows) and ``bench.md`` (``sections_md`` after the table)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {"config": cfg.model_dump(mode="json"), **header, "rows": [asdict(r) for r in rows], **(sections or {})}
    record = json.loads(json.dumps(record), parse_constant=lambda _: None)  # NaN, infinities -> null
    path = out / "bench.json"
    path.write_text(json.dumps(record, indent=2, allow_nan=False) + "\n")
    (out / "bench.md").write_text(_markdown(cfg, header, rows, sections_md or []))
    return path


def _markdown(cfg: RecpipeConfig, header: dict[str, Any], rows: list[Row], sections_md: list[str]) -> str:
    v, gpu, bench = header["versions"], header["gpu"], header["bench"]
    lines = [
        "# recpipe bench", "",
        f"- date: {header['date']}",
        f"- versions: torch {v['torch']}, fbgemm-gpu {v['fbgemm_gpu']}, torchrec {v['torchrec']}"
        + "".join(f", {k} {v[key]}" for k, key in (("CUDA", "cuda"), ("NCCL", "nccl")) if v[key]),
        f"- GPU: {gpu['name']} ({gpu['count_visible']} visible); world size {header['world_size']}; "
        f"PYTORCH_CUDA_ALLOC_CONF: {header.get('cuda_alloc_conf') or 'PyTorch default'}",
        f"- command: `{header['command']}`",
        f"- steps: {bench['steps']} timed after {bench['warmup']} warm-up (+{bench['drain']} untimed to drain); "
        f"global batch {bench['global_batch']}; timing: {bench['timing']}",
        f"- precision: {cfg.train.precision} (train.precision; the same model for recpipe's and TorchRec's pipelines)",
        f"- host batches: {bench['batches_per_rank']} per rank, generated in {bench['batch_generation_s']:.2f} s "
        f"({bench['batch_generation_ms_per_batch']:.1f} ms/batch), pinned: {bench['pinned']}",
        "",
        "P50/P90 over timed steps of the slowest rank's step time; GPU busy: the union of device intervals per",
        "profiled step (n/a on CPU), NCCL's kernels counted while they wait for their peers (on several GPUs a",
        "step can be all NCCL waiting); **x GPU busy = P50 / GPU busy** (1.00: the GPU never idles); floor: the",
        "step's device time outside NCCL's kernels plus its collectives timed alone at their sizes on the same",
        "ranks; **x floor = P50 / floor**; host ms/call: host time inside progress(); step +GiB: step-only peak",
        "above the model. Every number: docs/benchmarking.md.",
        "", format_table(rows, markdown=True), "", *sections_md,
    ]
    details = [r for r in rows if r.config_overrides or r.notes or r.options]
    if details:
        lines += ["## Per-run options", ""]
        for r in details:
            parts = [r.pipeline_class, r.options and "options " + json.dumps(r.options),
                     r.config_overrides and "config overrides " + json.dumps(r.config_overrides),
                     r.notes and "notes: " + "; ".join(r.notes)]
            lines.append(f"- {r.pipeline} / {r.impl}: " + ", ".join(p for p in parts if p))
        lines.append("")
    lines += ["## Resolved config", "", "```yaml", cfg.to_yaml().rstrip(), "```", ""]
    return "\n".join(lines)


def _traced(rows: list[Row], key: str = "status") -> list[Row]:
    return [r for r in rows if r.status == "ok" and (r.trace or {}).get("status") == "ok" and r.trace.get(key)]


def gpu_time_table(rows: list[Row], markdown: bool = True) -> str:
    """Per traced row: GPU busy, NCCL busy, window, busy by stream, GPU ms by kernel class; '' without kernels."""
    header = ("pipeline", "impl", "GPU busy ms", "NCCL busy ms", "window ms", "busy ms by stream", *KERNEL_CLASSES,
              "GEMM + TBE ms")
    body = []
    for r in _traced(rows, "kernel_classes_ms"):
        t, ms = r.trace, r.trace["kernel_classes_ms"]
        total = sum(ms.values()) or 1.0
        streams = ", ".join(f"{s}: {v:.2f}" for s, v in t["streams_busy_ms"].items())
        classes = [f"{ms[c]:.3f} ({ms[c] / total:.0%})" for c in KERNEL_CLASSES]
        floor = ms["gemm"] + ms["tbe_forward"] + ms["tbe_backward"]
        body.append([r.pipeline, r.impl, cell(t["gpu_busy_ms"], ".3f"), cell(t["nccl_busy_ms"], ".3f"),
                     cell(t["window_ms"], ".2f"), streams, *classes, f"{floor:.3f}"])
    return grid(header, body, markdown) if body else ""


def _gpu_time_md(rows: list[Row]) -> list[str]:
    table = gpu_time_table(rows)
    return ["## GPU time by kernel class (profiled steps)", "",
            "Per step: GPU busy (the union of device intervals over all streams; NCCL kernels count while they wait), "
            "then each kernel class's summed device time and its share of the sum (kernels on overlapping streams "
            "count in full). GEMM + TBE is what no fusion removes. Rank 0's classes.", "", table, ""] if table else []


def _phases_md(rows: list[Row]) -> list[str]:
    """Host ms per step by phase, one table per implementation (their phases differ)."""
    lines: list[str] = []
    for impl in dict.fromkeys(r.impl for r in rows):
        mine = [r for r in _traced(rows) if r.impl == impl]
        names = list(dict.fromkeys(p for r in mine for p in r.trace["phases_ms"]))
        body = [[r.pipeline, cell(r.trace["host_ms_p50"], ".3f"),
                 *(cell(r.trace["phases_ms"].get(p), ".3f") for p in names),
                 cell(r.trace["outside_phases_ms"], ".3f"), r.trace.get("phases_reason", "")] for r in mine]
        if body:
            header = ("pipeline", "host ms/call (profiled)", *names, "outside phases", "note")
            lines += [f"{impl}:", "", grid(header, body, markdown=True), ""]
    intro = ["## Host time by phase (profiled steps)", "", "Host ms per step inside each phase's ranges (recpipe: "
             "`recpipe.<step>`; TorchRec: its train pipelines' `## name ##` ranges). Phases can nest.", ""]
    return intro + lines if lines else []


def _host_syncs_md(rows: list[Row]) -> list[str]:
    body = []
    for r in _traced(rows, "host_syncs"):
        hs = r.trace["host_syncs"]
        sites = "; ".join(f"{site} ({v['per_step']:.1f}, {v['blocked_ms']:.3f})"
                          for site, v in list(hs["by_site"].items())[:5] if v["per_step"] > 0)
        body.append([r.pipeline, r.impl, cell(hs["per_step"], ".1f"), cell(hs["blocked_ms"], ".3f"), sites or "-"])
    return md_section(
        "Host syncs (profiled steps)",
        "CUDA calls inside `progress()` that block the host until the device catches up (synchronize, a synchronous "
        "copy, a copy to pageable memory: `.item()`, `.tolist()`), per step, with the time blocked. Site: the "
        "pipeline phase, then the outermost and innermost CPU ops holding the call. Rank 0.",
        ("pipeline", "impl", "syncs/step", "blocked ms/step", "sites (syncs/step, blocked ms/step)"), body)


def _cache_md(rows: list[Row]) -> list[str]:
    header = ("pipeline", "impl", "hit rate", "rows fetched/step", "MB fetched/step", "UVM lookups/step",
              "cache full", "evicted/step", "cache work ms", "overlapped ms (with compute)", "exposed ms",
              "H2D GB/s (insert op)", "H2D GB/s (row moves)", "note")
    body = []
    for r, c in ((r, r.cache) for r in rows if r.status == "ok" and r.cache):
        if "hit_rate" not in c:
            body.append([r.pipeline, r.impl] + ["-"] * (len(header) - 3) + [c.get("reason", "")])
            continue
        body.append([r.pipeline, r.impl, cell(c["hit_rate"], ".3f"), cell(c["rows_fetched_per_step"], ",.0f"),
                     cell(c["bytes_fetched_per_step"] / 1e6, ",.2f"), cell(c["uvm_lookups_per_step"], ",.0f"),
                     cell(c["occupancy"], ".1%"), cell(c["evicted_per_step"], ",.0f"), cell(c.get("gpu_ms"), ".3f"),
                     f"{cell(c.get('overlap_ms'), '.3f')} ({cell(c.get('overlap_compute_ms'), '.3f')})",
                     cell(c.get("exposed_ms"), ".3f"), cell(c.get("h2d_GB_per_s_populate"), ",.1f"),
                     cell(c.get("h2d_GB_per_s_insert"), ",.1f"),
                     c.get("populate_op", "") if "gpu_ms" in c else "no cache work in the trace"])
    return md_section(
        "UVM cache",
        "FBGEMM's cache counters over the timed steps, the cache work in the profiled steps (overlapped with other "
        "device work, in brackets with compute kernels, or exposed), and bytes fetched over the GPU time of the cache "
        "insert (note: its op) or of its row moves; the rank that fetches most (docs/benchmarking.md).", header, body)


def _first_step_md(rows: list[Row]) -> list[str]:
    """The first step of each run (its first round): what compiling and capturing cost."""
    body = [[r.pipeline, r.impl, cell(r.first_step_s, ".2f"),
             ", ".join(f"{x:.2f}" for x in r.first_step_s_rounds[1:]) or "-", cell(r.build_s, ".1f")]
            for r in rows if r.first_step_s]
    return md_section(
        "First step",
        "Seconds of the first `progress()` call (to the device's end) of each run's first round (later rounds, in the "
        "same process, find the compiled kernels in inductor's cache): `pipeline.compile` compiles there, CUDA graphs "
        "are captured there; and the model's build.",
        ("pipeline", "impl", "first step s", "later rounds' first step s", "build s"), body)


def rows_md(rows: list[Row]) -> list[str]:
    """The per-row sections that follow the main table."""
    return _gpu_time_md(rows) + _phases_md(rows) + _host_syncs_md(rows) + _cache_md(rows) + _first_step_md(rows)


def _save(fig: Any, ax: Any, path: Path, ylabel: str, title: str) -> str:
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    handles, labels = ax.get_legend_handles_labels()
    by_label = dict(zip(labels, handles))  # each legend entry once
    ax.legend(by_label.values(), by_label.keys(), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path.name


def _step_time(plt: Any, path: Path, rows: list[Row]) -> str:
    pipelines = list(dict.fromkeys(r.pipeline for r in rows))
    impls = [i for i in _COLORS if any(r.impl == i for r in rows)]
    width = 0.8 / len(impls)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(pipelines)), 4.5))
    for k, impl in enumerate(impls):
        for x, name in enumerate(pipelines):
            row = next((r for r in rows if r.pipeline == name and r.impl == impl), None)
            pos = x + (k - (len(impls) - 1) / 2) * width
            if row is None or row.status != "ok":
                if row is not None:
                    ax.text(pos, 0, row.status, rotation=90, ha="center", va="bottom", fontsize=8, color="gray")
                continue
            p50, p90 = row.step_ms["p50"], row.step_ms["p90"]
            ax.bar(pos, p50, width, color=_COLORS[impl], yerr=[[0.0], [p90 - p50]], capsize=3, label=impl)
            if row.gpu_busy_ms:  # the lower bound: the step cannot be shorter than its GPU busy time
                ax.hlines(row.gpu_busy_ms, pos - width / 2, pos + width / 2, colors="black", linewidth=2.5,
                          label="GPU busy per step (profiled)")
            if row.host_ms.get("p50"):
                ax.scatter([pos], [row.host_ms["p50"]], marker="v", s=25, color="dimgray", zorder=3,
                           label="host ms per progress() call")
            if len(row.round_p50_ms) > 1:  # each round's own P50 (``--rounds``): the spread behind the bar
                ax.scatter([pos] * len(row.round_p50_ms), row.round_p50_ms, s=12, color="black", zorder=3,
                           label="P50 of each round")
    ax.set_xticks(range(len(pipelines)), pipelines)
    return _save(fig, ax, path, "step time, ms (bar P50, whisker P90)", "recpipe bench: step time per pipeline")


def _memory(plt: Any, path: Path, rows: list[Row]) -> str:
    measured = [r for r in rows if r.status == "ok" and r.memory.get("peak_alloc_gib") is not None]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(measured)), 4.5))
    xs = range(len(measured))
    ax.bar([x - 0.2 for x in xs], [r.memory["peak_alloc_gib"] for r in measured], 0.4, label="peak allocated")
    ax.bar([x + 0.2 for x in xs], [r.memory["peak_reserved_gib"] for r in measured], 0.4, label="peak reserved")
    ax.set_xticks(list(xs), [f"{r.pipeline}\n{r.impl}" for r in measured], fontsize=8)
    return _save(fig, ax, path, "GiB (max over ranks, model included)", "recpipe bench: peak GPU memory")


def write_plots(out_dir: str | Path, rows: list[Row]) -> dict[str, Any]:
    """The plots that have data, ``{"written": [...], "reason": ...}`` (a plot never fails the bench): P50 step
    time per pipeline and implementation (whisker to P90, each round's P50 a dot, GPU busy per step a black
    line, host time per call a triangle) and, not on CPU, peak allocated vs reserved memory."""
    try:  # matplotlib is optional and slow to import: only the plots need it
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        return {"written": [], "reason": f"matplotlib not importable: {err}"}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written, skipped = [], []
    try:
        if any(r.status == "ok" for r in rows):
            written.append(_step_time(plt, out / STEP_TIME_PLOT, rows))
        if any(r.status == "ok" and r.memory.get("peak_alloc_gib") is not None for r in rows):
            written.append(_memory(plt, out / MEMORY_PLOT, rows))
        else:
            skipped.append(f"{MEMORY_PLOT}: no allocator numbers (CPU run)")
    except Exception as err:  # noqa: BLE001 - plots must not lose the measurements
        skipped.append(f"plotting failed: {type(err).__name__}: {err}")
    finally:
        plt.close("all")
    return {"written": written, "reason": "; ".join(skipped)}
