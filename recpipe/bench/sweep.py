"""``recpipe bench --sweep-cache LF,... --sweep-zipf A,...``: when does prefetch pay?

For configs with ``fused_uvm_caching`` tables, on CUDA: recpipe's ``prefetch`` and
``sparse_dist`` at every (cache load factor, Zipf alpha) of the grid (a flag left out
sweeps only the config's own value). Every cached table gets the swept load factor;
the synthetic ids the swept alpha (one set of pre-generated batches per alpha).

Cost. Building the model dominates on the tables the sweep is for (about 15 s for
the four 10M-row UVM tables of ``configs/bench/uvm_caching.yaml`` on one H100), and
the cache size is fixed when it is built, so the model is built once per (load
factor, pipeline) and every alpha and round runs on it as a *segment*: the cache is
written back and emptied first (FBGEMM's ``flush`` and ``reset_cache_states``), so
each segment starts from an empty cache, as a freshly built model would; then the
bench's warm-up, timed steps (cache counters around them), profiled steps and
drain. Rounds (``--rounds``) interleave the alphas in rotated order on each model;
the two pipelines of a load factor run one after the other.

Each point records both pipelines' step time (P50/P90 over rounds), hit rate, rows
fetched per step, cache work (exposed and overlapped) and GPU busy time; and
``prefetch / sparse_dist`` (P50). ``recommend`` turns the grid into advice: per point
the faster pipeline (prefetch only when at least ``WIN_MARGIN`` faster: it also locks
cache lines and needs ``sharding.prefetch_pipeline``), the hit rate below which
prefetch won, the nearest point to this config, and issue 16's targets on the grid.
On CPU there is no UVM cache: the sweep is skipped with that reason, never faked.
"""

from __future__ import annotations

import math
import traceback
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from recpipe.bench.compare import merge_rounds
from recpipe.bench.measure import free_device_memory
from recpipe.bench.report import Row
from recpipe.bench.run import (
    build_run,
    combine,
    config_for_pipeline,
    fresh_batches,
    gather,
    timed_steps,
    traced_steps,
    untimed_steps,
)
from recpipe.bench.uvm_cache import cached_tables, counter_delta, prefetch_unavailable, read_counters, unavailable
from recpipe.config import ConfigError, RecpipeConfig, config_from_dict
from recpipe.data import Batch
from recpipe.pipelines.prefetch import cached_tbes
from recpipe.torchrec_args import DEFAULT_CACHE_LOAD_FACTOR

__all__ = ["SWEPT", "WIN_MARGIN", "parse_grid", "point_config", "recommend", "run_sweep", "skip_reason"]

SWEPT = ("prefetch", "sparse_dist")
WIN_MARGIN = 0.02  # prefetch is recommended where its P50 is at least 2 % below sparse_dist's
MISS_SHARE = 0.15  # issue 16: where cache work costs sparse_dist >= 15 % of its step ...
PREFETCH_GAIN = 0.10  # ... prefetch should be >= 10 % faster; and never > 2 % slower anywhere


def parse_grid(text: str | None, flag: str, low: float, high: float, low_open: bool) -> tuple[float, ...]:
    """``"0.05,0.1"`` -> (0.05, 0.1); ConfigError naming the flag for anything else."""
    if not text:
        return ()
    try:
        values = tuple(dict.fromkeys(float(v) for v in text.split(",") if v.strip()))
    except ValueError:
        values = ()
    bad = [v for v in values if not (low < v <= high if low_open else low <= v <= high)]
    if not values or bad:
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise ConfigError(f"{flag}={text!r}: give comma-separated numbers in {interval}, e.g. 0.05,0.2,0.5"
                          + (f" (out of range: {bad})" if bad else ""))
    return values


def skip_reason(cfg: RecpipeConfig, device: torch.device) -> str:
    """Why the sweep cannot run here ('' if it can)."""
    why = []
    if prefetch_unavailable(cfg):
        why.append(prefetch_unavailable(cfg))
    if device.type != "cuda":
        why.append(f"the UVM cache needs CUDA (device is {device.type}): there is no cache here, so no hit rate "
                   "and no prefetch to measure")
    if cfg.data.factory is not None or cfg.data.source != "synthetic":
        why.append("--sweep-zipf needs the synthetic data source (data.synthetic.zipf_alpha)")
    return "; ".join(why)


def point_config(cfg: RecpipeConfig, name: str, lf: float, alpha: float) -> tuple[RecpipeConfig | None, str]:
    """``name``'s bench config with every cached table at load factor ``lf`` and ids
    at Zipf ``alpha``, or (None, why)."""
    base, _, skip = config_for_pipeline(cfg, name)
    if base is None:
        return None, skip
    raw = base.model_dump(mode="json")
    sh = raw["sharding"]
    for spec in [sh["default"], *sh["tables"].values()]:
        if spec["kernel"] == "fused_uvm_caching":
            spec["cache_load_factor"] = lf
    raw["data"]["synthetic"]["zipf_alpha"] = alpha
    try:
        return config_from_dict(raw, f"cache sweep: {name}, cache_load_factor={lf}, zipf_alpha={alpha}"), ""
    except ConfigError as err:
        return None, str(err).replace("\n", " ")


def _empty_cache(model: torch.nn.Module) -> None:
    """Write dirty cache lines back to host memory and empty every UVM cache. Only
    with no batch in flight (after a drain: no line is locked)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # host sync: the drain's work on every stream is done before the flush
    for tbe in cached_tbes(model, locked=False):
        tbe.flush()
        tbe.reset_cache_states()


def _segment(model: Any, pipe: Any, cfg: RecpipeConfig, batches: list[Batch], opts: Any, device: torch.device,
             bar: tqdm) -> dict[str, Any]:
    """One alpha on the built model, this rank: run_local's phases without the build."""
    out: dict[str, Any] = {"status": "ok", "reason": "", "notes": [], "options": {}, "cls": type(pipe).__name__,
                           "build_s": 0.0, "memory": {}}
    _empty_cache(model)
    it = fresh_batches(batches)
    untimed_steps(pipe, it, bar, opts.warmup)
    if device.type == "cuda":
        torch.cuda.synchronize()
    why = unavailable(cfg, device)
    counters = read_counters(model) if not why else None
    timed_steps(pipe, it, opts.steps, device, bar, out)
    if counters is not None:
        out["cache_counters"] = counter_delta(counters, read_counters(model))
    else:
        out["cache_reason"] = why
    if opts.trace_steps:
        out["trace"] = traced_steps(pipe, it, opts, device, f"sweep {cfg.pipeline.name}")
        bar.update(opts.trace_steps)
    untimed_steps(pipe, it, bar)
    return out


def measure_model(cfg_p: RecpipeConfig, alphas: tuple[float, ...], batches: dict[float, list[Batch]], opts: Any,
                  device: torch.device, bar: tqdm) -> dict[float, Row]:
    """Collective: one model of ``cfg_p`` (its pipeline), every alpha in every round
    as a segment; per alpha the row merged over rounds."""
    world = dist.get_world_size()
    per_alpha: dict[float, list[Row]] = {a: [] for a in alphas}
    model = pipe = None
    free_device_memory(device)
    local: dict[str, Any] = {"status": "ok", "reason": "", "notes": [], "options": {}, "cls": ""}
    try:
        torch.manual_seed(cfg_p.train.seed)
        sharded, pipe = build_run(cfg_p, "recpipe", device, None, local)
        model = sharded.model
    except Exception as err:  # noqa: BLE001 - recorded on every point of this model
        traceback.print_exc()
        local.update(status="failed", reason=f"{type(err).__name__}: {str(err).strip()[:300]}")
    for r in range(opts.rounds):
        shift = r % len(alphas)
        for alpha in alphas[shift:] + alphas[:shift]:
            if pipe is None:
                out = dict(local)
                bar.update(len(batches[alpha]))
            else:
                try:
                    out = _segment(model, pipe, cfg_p, batches[alpha], opts, device, bar)
                except Exception as err:  # noqa: BLE001 - the next segments fail too, fast
                    traceback.print_exc()
                    out = {"status": "failed", "reason": f"{type(err).__name__}: {str(err).strip()[:300]}",
                           "notes": [], "options": {}, "cls": ""}
            row = Row(pipeline=cfg_p.pipeline.name, impl="recpipe")
            combine(row, gather(out), cfg_p.data.batch_size * world, opts.steps)
            per_alpha[alpha].append(row)
    del model, pipe
    free_device_memory(device)
    return {a: merge_rounds(rows, cfg_p.data.batch_size * world) for a, rows in per_alpha.items()}


def _summary(row: Row) -> dict[str, Any]:
    """What a sweep point keeps of one pipeline's merged row."""
    if row.status != "ok":
        return {"status": row.status, "reason": row.reason}
    c = row.cache
    return {
        "status": "ok", "step_ms": row.step_ms, "round_p50_ms": row.round_p50_ms, "gpu_busy_ms": row.gpu_busy_ms,
        "x_busy": row.x_busy, "hit_rate": c.get("hit_rate"), "rows_fetched_per_step": c.get("rows_fetched_per_step"),
        "bytes_fetched_per_step": c.get("bytes_fetched_per_step"), "occupancy": c.get("occupancy"),
        "evicted_per_step": c.get("evicted_per_step"), "cache_gpu_ms": c.get("gpu_ms"),
        "cache_exposed_ms": c.get("exposed_ms"), "cache_overlap_ms": c.get("overlap_ms"),
        **({"cache_reason": c["reason"]} if "reason" in c else {}),
    }


def run_sweep(cfg: RecpipeConfig, opts: Any, lfs: tuple[float, ...], alphas: tuple[float, ...],
              make_batches: Any, device: torch.device, bar: tqdm) -> dict[str, Any]:
    """Collective: the grid (the same dict on every rank). ``make_batches(cfg)`` gives
    this rank's pre-generated batches of a config."""
    lfs = lfs or tuple(sorted({_lf(cfg, t) for t in cached_tables(cfg)}))
    alphas = alphas or (cfg.data.synthetic.zipf_alpha,)
    grid = {"cache_load_factors": list(lfs), "zipf_alphas": list(alphas)}
    per_model = opts.rounds * len(alphas) * opts.batches_per_run  # progress bar ticks of one model's segments
    bar.total = (bar.total or 0) + len(lfs) * len(SWEPT) * per_model
    skip = skip_reason(cfg, device)
    if skip:
        bar.update(len(lfs) * len(SWEPT) * per_model)
        return {"status": "skipped", "reason": skip, **grid}
    batch_cfgs = {a: point_config(cfg, "sparse_dist", lfs[0], a) for a in alphas}
    bad = [why for c, why in batch_cfgs.values() if c is None]
    if bad:
        bar.update(len(lfs) * len(SWEPT) * per_model)
        return {"status": "skipped", "reason": bad[0], **grid}
    batches = {a: make_batches(c) for a, (c, _) in batch_cfgs.items()}
    found: dict[tuple[float, float, str], dict[str, Any]] = {}
    for lf in lfs:
        for name in SWEPT:
            cfg_p, why = point_config(cfg, name, lf, alphas[0])
            if cfg_p is None:
                found.update({(lf, a, name): {"status": "skipped", "reason": why} for a in alphas})
                bar.update(per_model)
                continue
            bar.set_description(f"sweep {name} lf={lf}")
            for alpha, row in measure_model(cfg_p, alphas, batches, opts, device, bar).items():
                found[(lf, alpha, name)] = _summary(row)
    points = []
    for lf in lfs:
        for alpha in alphas:
            point = {"cache_load_factor": lf, "zipf_alpha": alpha, **{n: found[(lf, alpha, n)] for n in SWEPT}}
            pf, sd = point["prefetch"], point["sparse_dist"]
            if pf["status"] == sd["status"] == "ok":
                point["prefetch_over_sparse_dist"] = pf["step_ms"]["p50"] / sd["step_ms"]["p50"]
                exposed = sd.get("cache_exposed_ms")
                point["sparse_dist_miss_share"] = exposed / sd["step_ms"]["p50"] if exposed is not None else None
            points.append(point)
    return {"status": "ok", **grid, "points": points, "segments": _SEGMENTS,
            "recommendation": recommend(points, _config_lf(cfg), cfg.data.synthetic.zipf_alpha)}


_SEGMENTS = ("one model per (load factor, pipeline); per alpha and round a segment starting from an empty cache "
             "(flush + reset_cache_states): warm-up, timed steps with cache counters, profiled steps, drain")


def _lf(cfg: RecpipeConfig, table: str) -> float:
    lf = cfg.sharding.for_table(table).cache_load_factor
    return DEFAULT_CACHE_LOAD_FACTOR if lf is None else lf


def _config_lf(cfg: RecpipeConfig) -> float | None:
    """The config's load factor (the largest, when cached tables differ)."""
    return max((_lf(cfg, t) for t in cached_tables(cfg)), default=None)


def _hit_rates(points: list[dict[str, Any]]) -> list[float]:
    return [p["sparse_dist"]["hit_rate"] for p in points if p["sparse_dist"].get("hit_rate") is not None]


def recommend(points: list[dict[str, Any]], lf: float | None, alpha: float) -> dict[str, Any]:
    """Which pipeline to use, from the measured grid (see the module docstring); marks
    each measured point's ``winner``."""
    measured = [p for p in points if p.get("prefetch_over_sparse_dist") is not None]
    if not measured:
        return {"reason": "no point has both pipelines measured"}
    for p in measured:
        p["winner"] = "prefetch" if p["prefetch_over_sparse_dist"] <= 1 - WIN_MARGIN else "sparse_dist"
    hits = _hit_rates
    wins = [p for p in measured if p["winner"] == "prefetch"]
    losses = [p for p in measured if p["winner"] == "sparse_dist"]
    out: dict[str, Any] = {"prefetch_wins": len(wins), "points": len(measured), "margin": WIN_MARGIN}
    if wins and hits(wins):
        out["prefetch_won_up_to_hit_rate"] = max(hits(wins))
    if losses and hits(losses):
        out["sparse_dist_won_from_hit_rate"] = min(hits(losses))
    if lf is not None:
        near = min(measured, key=lambda p: abs(math.log(p["cache_load_factor"] / lf)) + abs(p["zipf_alpha"] - alpha))
        out["for_this_config"] = {"cache_load_factor": lf, "zipf_alpha": alpha,
                                  "nearest_point": (near["cache_load_factor"], near["zipf_alpha"]),
                                  "pipeline": near["winner"],
                                  "prefetch_over_sparse_dist": near["prefetch_over_sparse_dist"],
                                  "hit_rate": near["sparse_dist"].get("hit_rate"),
                                  "occupancy": near["sparse_dist"].get("occupancy")}
    worst = max(measured, key=lambda p: p["prefetch_over_sparse_dist"])
    heavy = [p for p in measured if (p.get("sparse_dist_miss_share") or 0) >= MISS_SHARE]
    out["targets"] = {
        "never_slower_by_2pct": {"met": worst["prefetch_over_sparse_dist"] <= 1.02,
                                 "worst": worst["prefetch_over_sparse_dist"],
                                 "at": (worst["cache_load_factor"], worst["zipf_alpha"])},
        "faster_by_10pct_where_misses_cost_15pct": {
            "points": len(heavy),
            "met": all(p["prefetch_over_sparse_dist"] <= 1 - PREFETCH_GAIN for p in heavy) if heavy else None,
            "ratios": [p["prefetch_over_sparse_dist"] for p in heavy]},
    }
    return out
