"""FBGEMM's multi-pass UVM-cache prefetch, swept over ``sharding.prefetch_passes``.

    python benchmarks/studies/multipass.py --config configs/bench/uvm_caching.yaml --passes 1,2,4,8,12 --out runs/mp

(with any ``recpipe bench`` flag; the bench's own rows only with ``--pipelines``).
``bench.json`` gets a ``multipass`` section, ``bench.md`` its tables, ``multipass.png``
the curves.

Only for configs with ``fused_uvm_caching`` tables (the prefetch pipeline locks their cache lines)
(otherwise the sweep is skipped and the report says why). For each P the recpipe
``prefetch`` pipeline runs the bench's warm-up and timed steps on a fresh model built
with ``sharding.prefetch_passes=P`` (validated by ``config_from_dict``; every other
value, ``prefetch_min_pass_size`` included, as configured), and the point records:

* the step time (P50/P90 of the slowest rank, as the main rows);
* the prefetch step alone: a clock wrapped around recpipe's ``prefetch``
  step with events on the prefetch stream (the ``step_function`` hook). The time
  includes waiting for the input all-to-all's tensors when they are still in flight
  (the step waits for them on the dist stream before prefetching);
* measured step memory above the post-build allocation (allocated and reserved,
  ``MemorySnapshot``), rank 0 and the maximum over ranks;
* the planner's prediction for the same config and world size (rank 0): the terms
  whose name contains ``prefetch``, its per-step total, and the passes that really
  happen per TBE (FBGEMM does not split a batch below ``prefetch_min_pass_size``);
* the prefetch's own memory, measured alone (``bound.measure_prefetch_memory``: a
  fresh model, a few whole fwd + bwd chains, the prefetch stage drained before and
  after): its peak allocated bytes above the allocation before it, the prefetch
  stream's reserved bytes, its time; beside the planner's prediction for that same
  measurement (:func:`isolated_prefetch_peak_bytes`) and their ratio. The sweep's
  ``prefetch_memory_target`` says whether the ratio is within ``TOLERANCE`` at every
  P on every rank.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository's packages first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.studies.bound import measure_prefetch_memory  # noqa: E402
from benchmarks.studies.common import MiB, bench_parser, mib, run_study, write_plot  # noqa: E402
from recpipe.bench.measure import StepClock, prefetch_unavailable, summarize_ms  # noqa: E402
from recpipe.bench.report import Row, cell, grid  # noqa: E402
from recpipe.bench.run import combine, config_for_pipeline, fresh_batches, gather, run_local  # noqa: E402
from recpipe.config import ConfigError, RecpipeConfig, config_from_dict  # noqa: E402
from recpipe.data import Batch  # noqa: E402
from recpipe.builder import make_pipeline  # noqa: E402
from recpipe.planner.memory import LENGTH_BYTES, TBE_OFFSET_BYTES  # noqa: E402
from recpipe.planner.tbe import LOCATION_BYTES, prefetch_scratch_bytes  # noqa: E402

__all__ = ["TOLERANCE", "Multipass", "describe_point", "draw", "isolated_prefetch_peak_bytes",
           "measure_point", "multipass_md", "parse_passes", "prefetch_memory_point", "prefetch_memory_target", "run_multipass",
           "sweep_config", "sweep_skip_reason"]

TOLERANCE = 0.10  # the measured prefetch peak should follow the planner's curve within 10 %
PLOT = "multipass.png"

_MEMORY_KEYS = ("step_peak_alloc_above_build_gib", "step_peak_reserved_above_build_gib", "peak_alloc_gib",
                "peak_reserved_gib")


class _PrefetchProbe:
    """``run_local``'s ``build``: the configured ``prefetch`` pipeline (``make_pipeline``),
    its ``prefetch`` step timed by a ``StepClock`` pair on the stream it runs on (the engine
    has entered the prefetch stream and its fences when it calls the step; two events a
    step), wrapped in with the engine's ``wrap_step``. The clock is kept here, so the
    prefetch times of the timed steps are read after the run. The step that trains batch j
    prefetches batch j + 1; the timed steps train batches ``warmup .. warmup + steps - 1``."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.clock: StepClock | None = None
        self.prefetched: list[int] = []

    def __call__(self, cfg: RecpipeConfig, model: Any, optimizer: Any, device: torch.device) -> Any:
        pipe = make_pipeline(cfg, model, optimizer, device)
        clock, prefetched = StepClock(device), []
        self.clock, self.prefetched = clock, prefetched  # not the pipeline: the run frees it

        def timed(step: Any) -> Any:
            def timed_prefetch(p: Any, batch: Any) -> None:
                clock.start()
                step(p, batch)
                clock.stop()
                prefetched.append(batch.index)

            return timed_prefetch

        pipe.wrap_step("prefetch", timed)
        return pipe

    def prefetch_ms(self) -> list[float]:
        if self.clock is None:
            return []
        lo, hi = self.warmup + 1, self.warmup + self.steps
        return [t for t, j in zip(self.clock.times_ms(), self.prefetched) if lo <= j <= hi]  # synchronizes


def sweep_skip_reason(cfg: RecpipeConfig, device: torch.device) -> str:
    """Why the sweep cannot run on this config and machine ('' if it can)."""
    if prefetch_unavailable(cfg):
        return prefetch_unavailable(cfg)
    if device.type != "cuda":
        return "the UVM cache needs CUDA (device is cpu)"
    return ""


def sweep_config(cfg: RecpipeConfig, passes: int) -> tuple[RecpipeConfig | None, str]:
    """The ``prefetch`` pipeline's config with ``sharding.prefetch_passes=passes``, or (None, why)."""
    base, _, skip = config_for_pipeline(cfg, "prefetch")
    if base is None:
        return None, skip
    raw = base.model_dump(mode="json")
    raw["sharding"]["prefetch_passes"] = passes
    try:
        return config_from_dict(raw, f"multipass sweep, sharding.prefetch_passes={passes}"), ""
    except ConfigError as err:
        return None, str(err).replace("\n", " ")


def isolated_prefetch_peak_bytes(
    tbes: list[tuple[float, int]], passes: int, min_pass_size: int, fbgemm_version: tuple[int, int]
) -> int:
    """Predicted peak allocated bytes above the allocation before ``module.prefetch``
    of one batch (what ``bound`` measures), from the (indices, bags) of each cached TBE
    of the rank, in prefetch order (torchrec: lookup by lookup, TBE by TBE).

    TBE k at its peak holds what the TBEs before it left, its own prefetch scratch
    (:func:`~recpipe.planner.tbe.prefetch_scratch_bytes`, freed when it returns) and::

        locations  4 n    final_lxu_cache_locations, int32 [n] (kept for the forward)
        offsets    4 (b + 1)  KJT.offsets() from the int32 lengths (cached on the KJT)
        cast       8 (b + 1)  prepare_inputs: offsets.to(indices.dtype), int64 (freed)

    so peak = max over k of (sum over j < k of (4 n_j + 4 (b_j + 1)) + 4 n_k + 12 (b_k + 1) + scratch_k).
    """
    peak, kept = 0.0, 0.0
    for n, bags in tbes:
        leaves = LOCATION_BYTES * n + LENGTH_BYTES * (bags + 1)
        scratch = prefetch_scratch_bytes(n, passes, min_pass_size, fbgemm_version)
        peak = max(peak, kept + leaves + TBE_OFFSET_BYTES * (bags + 1) + scratch)
        kept += leaves
    return int(round(peak))


def _isolated_prefetch_peaks(plan: Any, passes: int, min_pass_size: int) -> list[int]:
    """:func:`isolated_prefetch_peak_bytes` of every rank of ``plan`` (its cached TBEs;
    every non-data-parallel table's feature brings W x B bags to its TBE)."""
    out = []
    for r in plan.ranks:
        tbes = [(g.indices_per_batch, len(g.tables) * plan.batch_size * (1 if g.sharding_type == "data_parallel"
                                                                          else plan.world_size))
                for g in r.tbe_groups if g.kernel == "cached"]
        out.append(isolated_prefetch_peak_bytes(tbes, passes, min_pass_size, plan.fbgemm_version))
    return out


def planner_prediction(cfg: RecpipeConfig, world_size: int) -> dict[str, Any]:
    """Rank 0 of ``plan_from_config``: prefetch terms, per-step bytes, passes that happen;
    and every rank's peak of the prefetch measured alone (``isolated_prefetch_peak_bytes``)."""
    from recpipe.planner import plan_from_config

    try:
        plan = plan_from_config(cfg, world_size=world_size)
    except Exception as err:  # noqa: BLE001 - a planner bug must not lose the measured sweep
        return {"reason": f"n/a: planner raised {type(err).__name__}: {str(err)[:200]}"}
    r0 = plan.ranks[0]
    terms = {t.name: t.bytes for t in r0.terms if "prefetch" in t.name and t.side == "hbm"}
    hbm = [t for t in r0.terms if t.side == "hbm"]
    per_step = sum(t.bytes for t in hbm if t.category == "per_step")
    savings = next((p for p in plan.prefetch if p.rank == 0), None)
    effective = dict(savings.passes_effective) if savings is not None else {
        g.name: g.prefetch_passes_effective for g in r0.tbe_groups if g.prefetch_passes_effective}
    return {
        "prefetch_terms_bytes": sum(terms.values()),
        "prefetch_terms": terms,
        "per_step_bytes": per_step,
        "per_step_plus_allocator_bytes": per_step + sum(t.bytes for t in hbm if t.category == "allocator"),
        "passes_effective": effective,
        "isolated_prefetch_peak_bytes": _isolated_prefetch_peaks(
            plan, cfg.sharding.prefetch_passes, cfg.sharding.prefetch_min_pass_size),
        "peak_phase": r0.peak_phase,
        "warnings": [w for w in plan.warnings if "prefetch" in w],
    }


def measure_point(
    cfg_p: RecpipeConfig, passes: int, batches: list[Batch], opts: Any, device: torch.device, bar: tqdm
) -> dict[str, Any]:
    """Collective: one sweep point on every rank."""
    probe = _PrefetchProbe(opts.warmup, opts.steps)
    per_rank = gather(run_local(cfg_p, "recpipe", batches, opts, device, bar, build=probe))
    prefetch_ms = gather(probe.prefetch_ms())
    world = len(per_rank)
    row = combine(Row(pipeline="prefetch", impl="recpipe"), per_rank, cfg_p.data.batch_size * world, opts.steps)
    point: dict[str, Any] = {"passes": passes, "status": row.status, "reason": row.reason}
    if row.status == "ok":
        prefetch = [max(ts) for ts in zip(*prefetch_ms)]
        mems = [r.memory for r in per_rank]
        point.update(
            step_ms=row.step_ms,
            samples_per_s=row.samples_per_s,
            prefetch_ms=summarize_ms(prefetch) if prefetch else None,
            memory_rank0={k: mems[0].get(k) for k in _MEMORY_KEYS} if mems[0] else None,
            memory_max={k: max(m[k] for m in mems) for k in _MEMORY_KEYS} if mems[0] else None,
        )
        if not mems[0]:
            point["memory_reason"] = "n/a: no allocator statistics on CPU"
    alone = (measure_prefetch_memory(cfg_p, list(fresh_batches(batches, device)), device) if device.type == "cuda"
             else {"status": "skipped", "reason": "n/a: CPU run (no UVM cache)"})
    if dist.get_rank() == 0:
        point["planner"] = planner_prediction(cfg_p, world)
    predicted = point.get("planner", {}).get("isolated_prefetch_peak_bytes")
    point["prefetch_memory"] = prefetch_memory_point(alone, predicted)
    return point


def prefetch_memory_point(measured: dict[str, Any], predicted: list[int] | None) -> dict[str, Any]:
    """``measure_prefetch_memory``'s result beside the prediction (per rank, bytes):
    ``measured_over_predicted`` (rank 0) and per rank (None where nothing is predicted:
    a rank without a cached TBE)."""
    out = dict(measured)
    if measured.get("status") != "ok" or not predicted:
        return out
    per_rank = [m / p if p else None for m, p in zip(measured["peak_alloc_bytes_per_rank"], predicted)]
    out.update(predicted_peak_bytes=predicted[0], predicted_peak_bytes_max=max(predicted),
               predicted_peak_bytes_per_rank=list(predicted), measured_over_predicted=per_rank[0],
               measured_over_predicted_per_rank=per_rank)
    return out


def prefetch_memory_target(points: list[dict[str, Any]], tolerance: float = TOLERANCE) -> dict[str, Any]:
    """Whether the prefetch measured alone peaks within ``tolerance`` of the planner's
    prediction at every swept P, on every rank with a prediction; a P without both
    numbers on any rank fails it."""
    ratios = {p["passes"]: [x for x in (p.get("prefetch_memory") or {}).get("measured_over_predicted_per_rank") or []
                            if x is not None] for p in points}
    missing = [P for P, rs in ratios.items() if not rs]
    compared = [(P, x) for P, rs in ratios.items() for x in rs]
    worst = max(compared, key=lambda c: abs(c[1] - 1.0), default=(None, None))
    return {
        "tolerance": tolerance,
        "holds": not missing and all(abs(x - 1.0) <= tolerance for _, x in compared),
        "worst_ratio": worst[1],
        "worst_passes": worst[0],
        "not_compared": missing,
    }


def run_multipass(
    cfg: RecpipeConfig, passes: tuple[int, ...], batches: list[Batch], opts: Any, device: torch.device, bar: tqdm
) -> dict[str, Any]:
    """Collective: the sweep (every rank returns it; rank 0's points carry the planner)."""
    skip = sweep_skip_reason(cfg, device)
    if skip:
        bar.update(len(passes) * len(batches))
        return {"status": "skipped", "reason": skip, "passes": list(passes)}
    points = []
    for p in passes:
        bar.set_description(f"multipass P={p}")
        cfg_p, why = sweep_config(cfg, p)
        if cfg_p is None:
            points.append({"passes": p, "status": "skipped", "reason": why})
            bar.update(len(batches))
            continue
        points.append(measure_point(cfg_p, p, batches, opts, device, bar))
    return {
        "status": "ok",
        "pipeline": "prefetch (recpipe), prefetch step timed by a clock around it (wrap_step)",
        "prefetch_min_pass_size": cfg.sharding.prefetch_min_pass_size,
        "measured": "GiB above the post-build allocation, peak over warm-up and timed steps",
        "predicted": "planner rank 0: terms named *prefetch*; per-step terms; per-step + allocator terms",
        "prefetch_memory": "the prefetch alone (bound stage g, whole fwd+bwd chains on a fresh model): peak allocated "
                           "bytes above the allocation before it, max over the timed chains; the prefetch stream's "
                           "reserved bytes; predicted: isolated_prefetch_peak_bytes of the planner's TBEs",
        "points": points,
        "prefetch_memory_target": prefetch_memory_target(points),
    }


def describe_point(p: dict[str, Any]) -> str:
    """One line per sweep point for the console."""
    if p["status"] != "ok":
        return f"multipass P={p['passes']} {p['status']}: {p.get('reason', '')}"
    prefetch = (p.get("prefetch_ms") or {}).get("p50")
    mem = (p.get("memory_rank0") or {}).get("step_peak_alloc_above_build_gib")
    alone = p.get("prefetch_memory") or {}
    line = (f"multipass P={p['passes']} step P50 {p['step_ms']['p50']:.2f} ms, prefetch P50 "
            + ("-" if prefetch is None else f"{prefetch:.3f} ms")
            + ", step +" + ("- (CPU)" if mem is None else f"{mem:.3f} GiB") + " allocated")
    if alone.get("status") != "ok":
        return line + f"; prefetch alone {alone.get('status', '-')}: {alone.get('reason', '')}"
    ratio = alone.get("measured_over_predicted")
    return (line + f"; prefetch alone +{alone['peak_alloc_bytes'] / MiB:.1f} MiB allocated"
            + ("" if ratio is None else f" ({ratio:.3f} x predicted)"))


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
            cell((p.get("step_ms") or {}).get("p50"), ".3f"), cell(pf.get("p50"), ".3f"), cell(pf.get("p90"), ".3f"),
            _gib_as_mib(mem.get("step_peak_alloc_above_build_gib")),
            _gib_as_mib(mem.get("step_peak_reserved_above_build_gib")),
            mib(plan.get("prefetch_terms_bytes")), mib(plan.get("per_step_bytes")),
            mib(plan.get("per_step_plus_allocator_bytes")),
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
            str(p["passes"]), cell((pm.get("ms") or {}).get("p50"), ".3f"), mib(pm.get("peak_alloc_bytes")),
            mib(pm.get("peak_alloc_bytes_max")), mib(pm.get("stream_reserved_bytes")),
            mib(pm.get("predicted_peak_bytes")), cell(pm.get("measured_over_predicted"), ".3f"), cell(worst, ".3f"),
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


def _prefetch_alone(ax: Any, points: list[dict[str, Any]], tolerance: float | None) -> None:
    """The prefetch measured alone (peak allocated, prefetch stream reserved; rank 0)
    beside the planner's prediction, with the target's tolerance band around it."""

    def pairs(key: str) -> list[tuple[int, float]]:
        return [(p["passes"], p["prefetch_memory"][key] / MiB) for p in points
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


def draw(plt: Any, path: Path, sweep: dict[str, Any]) -> str:
    points = [p for p in sweep["points"] if p["status"] == "ok"]
    xs = [p["passes"] for p in points]
    fig, (alone_ax, mem_ax, time_ax) = plt.subplots(1, 3, figsize=(16, 4.5))
    _prefetch_alone(alone_ax, points, (sweep.get("prefetch_memory_target") or {}).get("tolerance"))

    def series(get: Any) -> list[float | None]:
        return [get(p) for p in points]

    lines = {
        "measured step +alloc (rank 0)": series(lambda p: (p.get("memory_rank0") or {}).get(
            "step_peak_alloc_above_build_gib")),
        "measured step +reserved (rank 0)": series(lambda p: (p.get("memory_rank0") or {}).get(
            "step_peak_reserved_above_build_gib")),
        "planner per-step": series(lambda p: p.get("planner", {}).get("per_step_bytes")),
        "planner prefetch terms": series(lambda p: p.get("planner", {}).get("prefetch_terms_bytes")),
    }
    for label, ys in lines.items():
        scale = 1024.0 if label.startswith("measured") else 1 / MiB  # GiB -> MiB, bytes -> MiB
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


def parse_passes(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4); ConfigError naming the flag for anything else."""
    try:
        passes = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        passes = ()
    if not passes or min(passes) < 1:
        raise ConfigError(f"--passes={text!r}: give comma-separated pass counts >= 1, e.g. 1,2,4,8")
    return tuple(dict.fromkeys(passes))


@dataclass(frozen=True)
class Multipass:
    """The study's measurement after the bench's rows (every rank)."""

    passes: tuple[int, ...]

    def __call__(self, cfg: RecpipeConfig, opts: Any, rows: list[Row], batches: list[Batch], device: torch.device,
                 bar: tqdm) -> tuple[dict[str, Any], list[str]]:
        bar.total = (bar.total or 0) + len(self.passes) * len(batches)
        sweep = run_multipass(cfg, self.passes, batches, opts, device, bar)
        if dist.get_rank() == 0:
            if sweep["status"] != "ok":
                bar.write(f"multipass sweep skipped: {sweep['reason']}")
            for p in sweep.get("points", []):
                bar.write(describe_point(p))
            if opts.plots and sweep["status"] == "ok" and any(p["status"] == "ok" for p in sweep["points"]):
                sweep["plots"] = write_plot(Path(opts.out) / PLOT, lambda plt, path: draw(plt, path, sweep))
        return {"multipass": sweep}, multipass_md(sweep)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--passes", required=True, metavar="P1,P2,...",
                        help="sharding.prefetch_passes values to sweep (configs with UVM-cached tables)")
    args = parser.parse_args(argv)
    return run_study("multipass", argv, args, lambda: Multipass(parse_passes(args.passes)))


if __name__ == "__main__":
    sys.exit(main())
