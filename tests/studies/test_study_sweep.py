"""benchmarks/studies/sweep.py: the grid's flags and configs, the segments on one model (on
CPU, without a cache), the recommendation arithmetic, its markdown and plot, the study on
CPU (refused with the reason); and on CUDA the whole grid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import torch

from benchmarks.studies.common import write_plot
from benchmarks.studies.sweep import PLOT, draw, main, parse_grid, point_config, recommend, sweep_md
from recpipe.config import ConfigError, load_config
from recpipe.exit_codes import EXIT_BAD_CONFIG

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "bench"
SMOKE = str(CONFIGS / "smoke_cpu.yaml")


def test_grid_flags_are_checked():
    assert parse_grid("0.05, 0.2,0.2,0.5", "--cache", 0.0, 1.0, low_open=True) == (0.05, 0.2, 0.5)
    assert parse_grid(None, "--cache", 0.0, 1.0, low_open=True) == ()
    with pytest.raises(ConfigError, match=r"--cache.*out of range: \[0.0\]"):
        parse_grid("0,0.2", "--cache", 0.0, 1.0, low_open=True)
    with pytest.raises(ConfigError, match="--zipf"):
        parse_grid("0.6,x", "--zipf", 0.0, 10.0, low_open=False)
    assert main(["--config", SMOKE, "--cache", "1.5"]) == EXIT_BAD_CONFIG


def test_point_configs_set_every_cached_table_and_the_ids():
    cfg = load_config(CONFIGS / "uvm_caching.yaml")
    for name in ("prefetch", "sparse_dist"):
        p, why = point_config(cfg, name, 0.05, 0.6)
        assert not why and p.pipeline.name == name and p.data.synthetic.zipf_alpha == 0.6
        cached = {t: s for t, s in p.table_sharding().items() if s.kernel == "fused_uvm_caching"}
        assert len(cached) == 4 and {s.cache_load_factor for s in cached.values()} == {0.05}
        assert p.cache_line_locking == (name == "prefetch")
    assert "fused_uvm_caching" in point_config(load_config(SMOKE), "prefetch", 0.1, 1.0)[1]


@pytest.mark.slow
def test_segments_on_one_model_on_cpu():
    """measure_model on one Gloo rank: prefetch (its step a no-op without a cache)
    over two alphas and two rounds on one model; the cache numbers say why they are absent."""
    from tqdm import tqdm

    from benchmarks.studies.sweep import measure_model
    from recpipe.bench.run import BenchOptions
    from recpipe.bench.runner import pregenerate, single_rank_group
    from recpipe.distributed import init_process_group

    cfg = load_config(SMOKE, ["pipeline.name=prefetch", "distributed.nproc=1"])
    opts = BenchOptions(("prefetch",), False, steps=3, warmup=1, out="unused", rounds=2, trace_steps=2)
    with single_rank_group():
        device = init_process_group(cfg)
        batches = {a: pregenerate(load_config(SMOKE, ["distributed.nproc=1", f"data.synthetic.zipf_alpha={a}"]),
                                  0, 1, opts.batches_per_run, device) for a in (0.6, 1.2)}
        assert not all(x.sparse_features.values().equal(y.sparse_features.values())
                       for x, y in zip(batches[0.6], batches[1.2]))
        rows = measure_model(cfg, (0.6, 1.2), batches, opts, device, tqdm(disable=True))
    assert set(rows) == {0.6, 1.2}
    for row in rows.values():
        assert row.status == "ok", row.reason
        assert row.steps == 6 and len(row.round_p50_ms) == 2 and row.step_ms["p50"] > 0
        assert row.trace["status"] == "ok" and row.trace["rounds"] == 2 and row.trace["gpu_busy_ms"] is None
        assert row.cache == {"reason": "n/a: no fused_uvm_caching table (no UVM cache)"}


def _side(p50: float, hit: float, exposed: float) -> dict:
    return {"status": "ok", "step_ms": {"p50": p50}, "hit_rate": hit, "rows_fetched_per_step": 1000 * (1 - hit),
            "occupancy": 1.0,
            "cache_gpu_ms": exposed + 0.5, "cache_exposed_ms": exposed}


def _sweep() -> dict:
    points = []
    for lf, alpha, pf, sd, hit, exposed in ((0.05, 0.6, 8.0, 10.0, 0.30, 2.0), (0.05, 1.2, 9.9, 10.0, 0.80, 1.0),
                                            (0.5, 0.6, 10.3, 10.0, 0.60, 1.2), (0.5, 1.2, 10.1, 10.0, 0.95, 0.2)):
        point = {"cache_load_factor": lf, "zipf_alpha": alpha, "prefetch": _side(pf, hit, 0.1),
                 "sparse_dist": _side(sd, hit, exposed), "prefetch_over_sparse_dist": pf / sd,
                 "sparse_dist_miss_share": exposed / sd}
        points.append(point)
    points.append({"cache_load_factor": 0.2, "zipf_alpha": 0.6, "prefetch": {"status": "failed", "reason": "boom"},
                   "sparse_dist": _side(10.0, 0.5, 1.0)})
    return {"status": "ok", "cache_load_factors": [0.05, 0.2, 0.5], "zipf_alphas": [0.6, 1.2], "segments": "s",
            "points": points, "recommendation": recommend(points, 0.2, 1.05)}


def test_recommendation_from_the_grid():
    sweep = _sweep()
    rec = sweep["recommendation"]
    assert [p.get("winner") for p in sweep["points"]] == ["prefetch", "sparse_dist", "sparse_dist", "sparse_dist", None]
    assert (rec["prefetch_wins"], rec["points"]) == (1, 4)
    assert rec["prefetch_won_up_to_hit_rate"] == 0.30 and rec["sparse_dist_won_from_hit_rate"] == 0.60
    # nearest measured point to (0.2, 1.05): log-distance in load factor, linear in alpha
    assert rec["for_this_config"]["nearest_point"] == (0.5, 1.2)  # |log(0.5/0.2)| < |log(0.05/0.2)|
    assert rec["for_this_config"]["pipeline"] == "sparse_dist"
    never = rec["targets"]["never_slower_by_2pct"]
    assert never["met"] is False and never["worst"] == pytest.approx(1.03) and never["at"] == (0.5, 0.6)
    heavy = rec["targets"]["faster_by_10pct_where_misses_cost_15pct"]
    assert heavy["points"] == 1 and heavy["met"] is True and heavy["ratios"] == [pytest.approx(0.8)]  # 2.0 / 10 ms
    assert recommend([], 0.2, 1.0) == {"reason": "no point has both pipelines measured"}


def test_sweep_markdown_and_plot(tmp_path):
    sweep = _sweep()
    md = "\n".join(sweep_md(sweep))
    assert "| 0.05 | 0.6 | 8.00 | 10.00 | 0.800 | 0.300 | 700 | 100.0% | 0.60 (0.10) | 2.50 (2.00) | 20.0% | prefetch |" in md
    assert "| 0.2 | 0.6 | failed | 10.00 | - |" in md
    assert "**use sparse_dist**" in md and "**not met**" in md and "**met** at all 1 such points (prefetch / sparse_dist 0.800)" in md
    assert "cache was" not in md  # every point's cache was full
    sweep["recommendation"]["for_this_config"]["occupancy"] = 0.25
    assert "That point's cache was 25% full" in "\n".join(sweep_md(sweep))
    skipped = {"status": "skipped", "reason": "the UVM cache needs CUDA", "cache_load_factors": [0.1],
               "zipf_alphas": [1.0]}
    assert "Not measured (load factors [0.1], Zipf alphas [1.0]): the UVM cache needs CUDA" in "\n".join(sweep_md(skipped))
    plots = write_plot(tmp_path / PLOT, lambda plt, path: draw(plt, path, sweep))
    assert plots["written"] == [PLOT] and (tmp_path / PLOT).read_bytes().startswith(b"\x89PNG")


def test_a_sweep_alone_runs_no_plain_pipelines(tmp_path):
    # without --pipelines: only the sweep (skipped on CPU and in this config, with its reasons).
    assert main(["--config", SMOKE, "--cache", "0.1,0.3", "--zipf", "0.8", "--steps", "2", "--warmup", "1",
                 "--set", "distributed.nproc=1", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["rows"] == []
    grid = record["cache_sweep"]
    assert (grid["status"], grid["cache_load_factors"], grid["zipf_alphas"]) == ("skipped", [0.1, 0.3], [0.8])
    assert "needs CUDA" in grid["reason"] and "fused_uvm_caching" in grid["reason"] and "points" not in grid
    md = (tmp_path / "bench.md").read_text()
    assert "--pipelines" not in md and "needs CUDA" in md
    assert "Not measured (load factors [0.1, 0.3], Zipf alphas [0.8]): needs a fused_uvm_caching" in md
    assert not (tmp_path / PLOT).exists()


def _cached() -> list[str]:
    """Overrides of the bench's GPU tests (tests/test_bench_gpu.py): small UVM-cached tables, prefetch."""
    table = "{type: table_wise, kernel: fused_uvm_caching, cache_load_factor: 0.05}"
    return ["train.device=cuda", "distributed.backend=nccl", "distributed.nproc=1", "model.embedding_dim=16",
            "model.dense_arch_layer_sizes=[32,16]", "model.num_embeddings_per_feature=[20000,20000,5000,100]",
            "data.batch_size=512", "data.synthetic.mean_pooling_factors=3.0", "data.synthetic.zipf_alpha=1.05",
            f"sharding.default={table}", "sharding.tables={t_cat_3: {type: table_wise, kernel: fused}}",
            "sharding.uvm_host_mapped=true", "pipeline.name=prefetch"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sweep_measures_its_grid(tmp_path):
    code = main(["--config", SMOKE, *(x for o in _cached() for x in ("--set", o)), "--pipelines",
                 "sparse_dist", "--steps", "8", "--warmup", "4", "--trace-steps", "2", "--rounds", "2",
                 "--cache", "0.01,0.5", "--zipf", "0.6,1.2", "--out", str(tmp_path)])
    assert code == 0
    import json

    sweep = json.loads((tmp_path / "bench.json").read_text())["cache_sweep"]
    assert sweep["status"] == "ok" and len(sweep["points"]) == 4
    hit = {(p["cache_load_factor"], p["zipf_alpha"]): p["sparse_dist"]["hit_rate"] for p in sweep["points"]}
    for p in sweep["points"]:
        for name in ("prefetch", "sparse_dist"):
            assert p[name]["status"] == "ok" and len(p[name]["round_p50_ms"]) == 2
            assert 0 <= p[name]["hit_rate"] <= 1 and p[name]["cache_gpu_ms"] > 0
        assert p["prefetch_over_sparse_dist"] > 0 and p["winner"] in ("prefetch", "sparse_dist")
    for alpha in (0.6, 1.2):
        assert hit[(0.01, alpha)] < hit[(0.5, alpha)]
    for lf in (0.01, 0.5):
        assert hit[(lf, 0.6)] < hit[(lf, 1.2)]
    assert "for_this_config" in sweep["recommendation"]
    assert (tmp_path / "cache_sweep.png").exists()
