"""What a bench record holds and how it is written: :class:`Row` (one pipeline and
implementation, over ranks and rounds), the header (resolved config, versions, GPU),
the table, ``bench.json`` and ``bench.md``."""

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
from recpipe.config import RecpipeConfig

__all__ = ["Row", "environment", "format_table", "grid", "write_outputs"]


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
    # Host time inside each progress() call (no sync): near the step time = launch-bound.
    host_ms: dict[str, float] = field(default_factory=dict)
    host_ms_per_step: list[float] = field(default_factory=list)  # per step, the slowest rank's
    build_s: float | None = None
    first_step_s: float | None = None  # the first progress() call: compiles and captures (slowest rank)
    first_step_s_rounds: list[float] = field(default_factory=list)  # each round's (later: kernels cached)
    memory: dict[str, Any] = field(default_factory=dict)  # GiB, max over ranks, + per_rank
    torchrec_pipelined_modules: int | None = None
    gpu_busy_ms: float | None = None  # per profiled step, the slowest rank's (trace.py)
    x_busy: float | None = None  # P50 / GPU busy: the headline (1.0 = the GPU never idles)
    trace: dict[str, Any] = field(default_factory=dict)  # trace.summarize_trace over ranks (and rounds)
    cache: dict[str, Any] = field(default_factory=dict)  # UVM cache metrics (measure.cache_metrics), or {"reason": ...}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

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
            "torch": torch.__version__,
            "fbgemm_gpu": _version("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-nightly"),
            "torchrec": _version("torchrec", "torchrec-nightly"),
            "cuda": torch.version.cuda,
            "nccl": _nccl_version() if cuda else None,
            "python": platform.python_version(),
        },
        "gpu": {
            "name": ", ".join(sorted(set(gpu_names))) if cuda else "CPU (Gloo)",
            "count_visible": torch.cuda.device_count() if cuda else 0,
            "per_rank": gpu_names if cuda else [],
        },
        "world_size": world_size,
        "device_type": device.type,
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") if cuda else None,
        "host": {"node": platform.node(), "cpus": os.cpu_count(), "processor": platform.processor()},
        "command": " ".join(sys.argv),
    }


# ------------------------------------------------------------------ table
_COLUMNS = ("pipeline", "impl", "P50 ms", "P90 ms", "GPU busy ms", "x GPU busy", "host ms/call", "samples/s",
            "samples/s/GPU", "peak alloc GiB", "peak reserved GiB", "reserved/alloc", "step +GiB", "note")


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _cells(row: Row) -> list[str]:
    if row.status != "ok":
        return [row.pipeline, row.impl] + ["-"] * (len(_COLUMNS) - 3) + [f"{row.status}: {row.reason}"]
    mem = row.memory
    busy = _num(row.gpu_busy_ms, ".2f") if row.gpu_busy_ms is not None else ("n/a" if row.trace else "-")
    return [row.pipeline, row.impl, _num(row.step_ms.get("p50"), ".2f"), _num(row.step_ms.get("p90"), ".2f"), busy,
            _num(row.x_busy, ".2f"), _num(row.host_ms.get("p50"), ".2f"), _num(row.samples_per_s, ",.0f"),
            _num(row.samples_per_s_per_gpu, ",.0f"), _num(mem.get("peak_alloc_gib"), ".2f"),
            _num(mem.get("peak_reserved_gib"), ".2f"), _num(mem.get("reserved_over_alloc"), ".3f"),
            _num(mem.get("step_peak_alloc_above_build_gib"), ".2f"), "; ".join(row.notes)]


def grid(header: tuple[str, ...] | list[str], body: list[list[str]], markdown: bool = False) -> str:
    """A fixed-width text table, or a markdown one."""
    if markdown:
        esc = lambda s: s.replace("|", "\\|")  # noqa: E731
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(esc(c) for c in cells) + " |" for cells in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(c[i]) for c in body)) if body else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header).rstrip(), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*c).rstrip() for c in body]
    return "\n".join(out)


def format_table(rows: list[Row], markdown: bool = False) -> str:
    return grid(_COLUMNS, [_cells(r) for r in rows], markdown)


# ------------------------------------------------------------------ files
def write_outputs(out_dir: str | Path, cfg: RecpipeConfig, header: dict[str, Any], rows: list[Row],
                  sections: dict[str, Any] | None = None, sections_md: list[str] | None = None) -> Path:
    """Write ``bench.json`` and ``bench.md`` into ``out_dir``; returns the JSON path.
    ``sections`` follow the rows in the JSON, ``sections_md`` the table in the markdown."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {"config": cfg.model_dump(mode="json"), **header, "rows": [r.to_dict() for r in rows], **(sections or {})}
    path = out / "bench.json"
    path.write_text(json.dumps(_clean(record), indent=2, allow_nan=False) + "\n")
    (out / "bench.md").write_text(_markdown(cfg, header, rows, sections_md or []))
    return path


def _clean(obj: Any) -> Any:
    """NaN and infinities -> None recursively (JSON has neither)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def _markdown(cfg: RecpipeConfig, header: dict[str, Any], rows: list[Row], sections_md: list[str]) -> str:
    v, gpu, bench = header["versions"], header["gpu"], header["bench"]
    lines = [
        "# recpipe bench",
        "",
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
        "profiled step (n/a on CPU); **x GPU busy = P50 / GPU busy** (1.00: the GPU never idles); host ms/call: host",
        "time inside progress(); step +GiB: step-only peak above the model. Every number: docs/benchmarking.md.",
        "",
        format_table(rows, markdown=True),
        "",
        *sections_md,
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
