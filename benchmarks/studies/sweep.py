"""When does prefetch pay? recpipe's prefetch against sparse_dist over cache load factor and Zipf alpha.

    python benchmarks/studies/sweep.py --config configs/bench/uvm_caching.yaml \
        --cache 0.05,0.1,0.2,0.5 --zipf 0.6,0.8,1.0,1.2 --rounds 3 --out runs/sweep

(with any ``recpipe bench`` flag; the bench's own rows only with ``--pipelines``).
``bench.json`` gets a ``cache_sweep`` section, ``bench.md`` its table and advice,
``cache_sweep.png`` the curves.

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
cache lines), the hit rate below which
prefetch won, the nearest point to this config, and two targets on the grid: prefetch never
more than 2 % slower, and at least 10 % faster where cache misses cost sparse_dist 15 % of its step.
On CPU there is no UVM cache: the sweep is skipped with that reason, never faked.
"""

from __future__ import annotations

import math
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository's packages first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.studies.common import bench_parser, run_study, write_plot  # noqa: E402
from recpipe.bench.compare import merge_rounds  # noqa: E402
from recpipe.bench.measure import cached_tables, free_device_memory, prefetch_unavailable  # noqa: E402
from recpipe.bench.report import Row, cell, grid  # noqa: E402
from recpipe.bench.run import RunResult, build_run, combine, config_for_pipeline, gather, measure_steps  # noqa: E402
from recpipe.bench.runner import pregenerate  # noqa: E402
from recpipe.config import ConfigError, RecpipeConfig, config_from_dict  # noqa: E402
from recpipe.data import Batch  # noqa: E402
from recpipe.pipelines.prefetch import cached_tbes  # noqa: E402
from recpipe.table_sharding.cache import DEFAULT_CACHE_LOAD_FACTOR  # noqa: E402

__all__ = ["SWEPT", "WIN_MARGIN", "CacheSweep", "draw", "empty_cache", "measure_model", "parse_grid", "point_config",
           "recommend", "run_sweep", "skip_reason", "sweep_md"]

SWEPT = ("prefetch", "sparse_dist")
WIN_MARGIN = 0.02  # prefetch is recommended where its P50 is at least 2 % below sparse_dist's
MISS_SHARE = 0.15  # where cache work costs sparse_dist >= 15 % of its step ...
PREFETCH_GAIN = 0.10  # ... prefetch should be >= 10 % faster; and never > 2 % slower anywhere
PLOT = "cache_sweep.png"


def skip_reason(cfg: RecpipeConfig, device: torch.device) -> str:
    """Why the sweep cannot run here ('' if it can)."""
    why = []
    if prefetch_unavailable(cfg):
        why.append(prefetch_unavailable(cfg))
    if device.type != "cuda":
        why.append(f"the UVM cache needs CUDA (device is {device.type}): there is no cache here, so no hit rate "
                   "and no prefetch to measure")
    if cfg.data.factory is not None or cfg.data.source != "synthetic":
        why.append("--zipf needs the synthetic data source (data.synthetic.zipf_alpha)")
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


def empty_cache(model: torch.nn.Module) -> None:
    """Write dirty cache lines back to host memory and empty every UVM cache. Only
    with no batch in flight (after a drain: no line is locked)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # host sync: the drain's work on every stream is done before the flush
    for tbe in cached_tbes(model, locked=False):
        tbe.flush()
        tbe.reset_cache_states()


def measure_model(cfg_p: RecpipeConfig, alphas: tuple[float, ...], batches: dict[float, list[Batch]], opts: Any,
                  device: torch.device, bar: tqdm) -> dict[float, Row]:
    """Collective: one model of ``cfg_p`` (its pipeline), every alpha in every round
    as a segment; per alpha the row merged over rounds."""
    world = dist.get_world_size()
    per_alpha: dict[float, list[Row]] = {a: [] for a in alphas}
    model = pipe = None
    free_device_memory(device)
    built = RunResult()
    try:
        sharded, pipe = build_run(cfg_p, "recpipe", device, built)
        model = sharded.model
    except Exception as err:  # noqa: BLE001 - recorded on every point of this model
        traceback.print_exc()
        built.fail(err)
    for r in range(opts.rounds):
        shift = r % len(alphas)
        for alpha in alphas[shift:] + alphas[:shift]:
            # A segment: the bench's phases on this model, from an empty cache as a freshly built model would.
            out = RunResult(pipeline_class=built.pipeline_class, options=built.options, populate_op=built.populate_op)
            if pipe is None:
                out = built
                bar.update(len(batches[alpha]))
            else:
                try:
                    empty_cache(model)
                    measure_steps(model, pipe, cfg_p, batches[alpha], opts, device, bar, out,
                                  label=f"sweep {cfg_p.pipeline.name}")
                except Exception as err:  # noqa: BLE001 - the next segments fail too, fast
                    traceback.print_exc()
                    out.fail(err)
            row = combine(Row(pipeline=cfg_p.pipeline.name, impl="recpipe"), gather(out),
                          cfg_p.data.batch_size * world, opts.steps)
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
                     f"{mine['prefetch_over_sparse_dist']:.3f}, hit rate {cell(mine['hit_rate'], '.3f')}).")
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
            return f"{cell(x.get('cache_gpu_ms'), '.2f')} ({cell(x.get('cache_exposed_ms'), '.2f')})"

        body.append([str(p["cache_load_factor"]), str(p["zipf_alpha"]),
                     cell((pf.get("step_ms") or {}).get("p50"), ".2f") if pf["status"] == "ok" else pf["status"],
                     cell((sd.get("step_ms") or {}).get("p50"), ".2f") if sd["status"] == "ok" else sd["status"],
                     cell(p.get("prefetch_over_sparse_dist"), ".3f"), cell(sd.get("hit_rate"), ".3f"),
                     cell(sd.get("rows_fetched_per_step"), ",.0f"), cell(sd.get("occupancy"), ".1%"), work(pf), work(sd),
                     cell(p.get("sparse_dist_miss_share"), ".1%"), p.get("winner", "-")])
    return lines + [grid(header, body, markdown=True), ""] + _recommendation_md(sweep["recommendation"])


def draw(plt: Any, path: Path, sweep: dict[str, Any]) -> str:
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


@dataclass(frozen=True)
class CacheSweep:
    """The study's measurement after the bench's rows (every rank)."""

    cache_load_factors: tuple[float, ...]
    zipf_alphas: tuple[float, ...]

    def __call__(self, cfg: RecpipeConfig, opts: Any, rows: list[Row], batches: list[Batch], device: torch.device,
                 bar: tqdm) -> tuple[dict[str, Any], list[str]]:
        rank, world = dist.get_rank(), dist.get_world_size()
        grid = run_sweep(cfg, opts, self.cache_load_factors, self.zipf_alphas,
                         lambda c: pregenerate(c, rank, world, opts.batches_per_run, device), device, bar)
        if rank == 0:
            bar.write(f"cache sweep {grid['status']}" + (
                f": {grid['reason']}" if grid["status"] != "ok" else f", {len(grid['points'])} points"))
            if opts.plots and grid["status"] == "ok" and any("prefetch_over_sparse_dist" in p for p in grid["points"]):
                grid["plots"] = write_plot(Path(opts.out) / PLOT, lambda plt, path: draw(plt, path, grid))
        return {"cache_sweep": grid}, sweep_md(grid)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--cache", default=None, metavar="LF1,LF2,...",
                        help="cache load factors of the UVM-cached tables (default: the config's)")
    parser.add_argument("--zipf", default=None, metavar="A1,A2,...",
                        help="Zipf alphas of the synthetic ids (default: the config's data.synthetic.zipf_alpha)")
    args = parser.parse_args(argv)
    return run_study("sweep", argv, args, lambda: CacheSweep(parse_grid(args.cache, "--cache", 0.0, 1.0, low_open=True),
                                                       parse_grid(args.zipf, "--zipf", 0.0, 10.0, low_open=False)))


if __name__ == "__main__":
    sys.exit(main())
