"""``recpipe bench --multipass P1,P2,...``: FBGEMM's multi-pass UVM-cache prefetch, swept.

Only for configs with ``fused_uvm_caching`` tables and ``sharding.prefetch_pipeline``
(otherwise the sweep is skipped and the report says why). For each P the recpipe
``prefetch`` pipeline runs the bench's warm-up and timed steps on a fresh model built
with ``sharding.prefetch_passes=P`` (validated by ``config_from_dict``; every other
value, ``prefetch_min_pass_size`` included, as configured), and the point records:

* the step time (P50/P90 of the slowest rank, as the main rows);
* the prefetch step alone: ``TimedPrefetchPipeline`` brackets recpipe's ``prefetch``
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

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from recpipe.bench.bound import measure_prefetch_memory
from recpipe.bench.measure import StepClock, summarize_ms
from recpipe.bench.report import Row
from recpipe.bench.run import combine, config_for_pipeline, fresh_batches, gather, run_local
from recpipe.bench.uvm_cache import prefetch_unavailable
from recpipe.config import ConfigError, RecpipeConfig, config_from_dict
from recpipe.data import Batch
from recpipe.pipelines import PrefetchPipeline
from recpipe.planner.memory import LENGTH_BYTES, TBE_OFFSET_BYTES
from recpipe.planner.tbe import LOCATION_BYTES, prefetch_scratch_bytes

__all__ = ["TOLERANCE", "TimedPrefetchPipeline", "describe_point", "isolated_prefetch_peak_bytes",
           "prefetch_memory_point", "prefetch_memory_target", "run_multipass", "sweep_config", "sweep_skip_reason"]

TOLERANCE = 0.10  # issue 5: the measured prefetch peak follows the planner's curve within 10%

_MEMORY_KEYS = ("step_peak_alloc_above_build_gib", "step_peak_reserved_above_build_gib", "peak_alloc_gib",
                "peak_reserved_gib")


class TimedPrefetchPipeline(PrefetchPipeline):
    """``PrefetchPipeline`` whose ``prefetch`` step is timed: a ``StepClock`` pair
    around it on the stream it runs on (the engine has entered the prefetch stream
    and its fences when it calls the step). Costs two events per step."""

    def __init__(self, model, optimizer, device, **options) -> None:
        super().__init__(model, optimizer, device, **options)
        self.prefetch_clock = StepClock(device)
        self.prefetched: list[int] = []  # batch index of each timed prefetch, in order

    def step_function(self, name: str):
        step = super().step_function(name)
        if name != "prefetch":
            return step

        def timed_prefetch(pipe, batch) -> None:
            self.prefetch_clock.start()
            step(pipe, batch)
            self.prefetch_clock.stop()
            self.prefetched.append(batch.index)

        return timed_prefetch


@dataclass(frozen=True)
class _PrefetchProbe:
    """``run_local``'s hook: build a ``TimedPrefetchPipeline`` and keep the prefetch
    times of the timed steps. The step that trains batch j prefetches batch j + 1,
    and the timed steps train batches ``warmup .. warmup + steps - 1``."""

    warmup: int
    steps: int

    def build(self, cfg: RecpipeConfig, model: Any, optimizer: Any, device: torch.device) -> TimedPrefetchPipeline:
        return TimedPrefetchPipeline(model, optimizer, device, **cfg.pipeline.model_dump(exclude={"name"}))

    def collect(self, pipe: TimedPrefetchPipeline) -> dict[str, Any]:
        times = pipe.prefetch_clock.times_ms()  # synchronizes
        lo, hi = self.warmup + 1, self.warmup + self.steps
        return {"prefetch_ms": [t for t, j in zip(times, pipe.prefetched) if lo <= j <= hi]}


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


def _point(
    cfg_p: RecpipeConfig, passes: int, batches: list[Batch], opts: Any, device: torch.device, bar: tqdm
) -> dict[str, Any]:
    """Collective: one sweep point on every rank."""
    local = run_local(cfg_p, "recpipe", batches, opts, device, bar, probe=_PrefetchProbe(opts.warmup, opts.steps))
    per_rank = gather(local)
    world = len(per_rank)
    row = Row(pipeline="prefetch", impl="recpipe")
    combine(row, per_rank, cfg_p.data.batch_size * world, opts.steps)
    point: dict[str, Any] = {"passes": passes, "status": row.status, "reason": row.reason}
    if row.status == "ok":
        prefetch = [max(ts) for ts in zip(*(r["probe"]["prefetch_ms"] for r in per_rank))]
        mems = [r["memory"] for r in per_rank]
        point.update(
            step_ms=row.step_ms,
            samples_per_s=row.samples_per_s,
            prefetch_ms=summarize_ms(prefetch) if prefetch else None,
            memory_rank0={k: mems[0].get(k) for k in _MEMORY_KEYS} if mems[0] else None,
            memory_max={k: max(m[k] for m in mems) for k in _MEMORY_KEYS} if mems[0] else None,
        )
        if not mems[0]:
            point["memory_reason"] = "n/a: no allocator statistics on CPU"
    alone = (measure_prefetch_memory(cfg_p, list(fresh_batches(batches)), device) if device.type == "cuda"
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
        points.append(_point(cfg_p, p, batches, opts, device, bar))
    return {
        "status": "ok",
        "pipeline": "prefetch (recpipe), prefetch step timed alone by TimedPrefetchPipeline",
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
    return (line + f"; prefetch alone +{alone['peak_alloc_bytes'] / 2**20:.1f} MiB allocated"
            + ("" if ratio is None else f" ({ratio:.3f} x predicted)"))
