"""benchmarks/studies/multipass.py: one sweep point on one Gloo rank, the planner's prediction
of the prefetch measured alone, the target, the markdown and the plot, and the study's CLI
(skipped on CPU with the reason; bad passes exit 2)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.studies.multipass import (
    PLOT,
    draw,
    isolated_prefetch_peak_bytes,
    main,
    multipass_md,
    planner_prediction,
    prefetch_memory_point,
    prefetch_memory_target,
    sweep_config,
    sweep_skip_reason,
)
from benchmarks.studies.common import write_plot
from recpipe.bench.measure import summarize_ms
from recpipe.bench.report import Row
from recpipe.config import load_config
from recpipe.exit_codes import EXIT_BAD_CONFIG

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs" / "bench"
SMOKE = str(CONFIGS / "smoke_cpu.yaml")
MiB = 1 << 20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_multipass_point_times_the_prefetch_step_and_asks_the_planner():
    """The sweep's per-point machinery on one Gloo rank. On CPU the config cannot have
    a UVM cache, so the prefetch pipeline runs with a no-op prefetch step (as in CPU CI):
    what is checked is the plumbing the GPU run relies on."""
    from tqdm import tqdm

    from benchmarks.studies.multipass import measure_point
    from recpipe.bench.run import BenchOptions
    from recpipe.bench.runner import pregenerate, single_rank_group
    from recpipe.distributed import init_process_group

    cfg = load_config(SMOKE, ["pipeline.name=prefetch", "distributed.nproc=1"])
    opts = BenchOptions(("prefetch",), False, steps=3, warmup=2, trace_steps=5, out="unused")
    with single_rank_group():
        device = init_process_group(cfg)
        batches = pregenerate(cfg, 0, 1, opts.batches_per_run, device)
        point = measure_point(cfg, 1, batches, opts, device, tqdm(disable=True))
    assert point["status"] == "ok", point["reason"]
    assert point["step_ms"]["p50"] > 0 and point["prefetch_ms"]["p50"] >= 0
    assert point["prefetch_ms"]["p50"] < point["step_ms"]["max"]
    assert point["memory_rank0"] is None and "CPU" in point["memory_reason"]
    plan = point["planner"]
    assert plan["per_step_bytes"] > 0 and plan["prefetch_terms_bytes"] == sum(plan["prefetch_terms"].values())
    assert plan["isolated_prefetch_peak_bytes"] == [0]  # no cached table in the smoke config
    assert point["prefetch_memory"] == {"status": "skipped", "reason": "n/a: CPU run (no UVM cache)"}
    assert "fused_uvm_caching" in sweep_skip_reason(load_config(SMOKE), device)
    uvm = load_config(CONFIGS / "uvm_caching.yaml")
    assert sweep_skip_reason(uvm, device) == "the UVM cache needs CUDA (device is cpu)"
    cfg8, why = sweep_config(uvm, 8)
    assert not why and cfg8.sharding.prefetch_passes == 8 and cfg8.pipeline.name == "prefetch"
    assert cfg8.sharding.prefetch_min_pass_size == uvm.sharding.prefetch_min_pass_size


def _gpu_like_rows() -> tuple[list[Row], dict]:
    """Rows and a sweep shaped like a GPU run's, to draw every plot on CPU."""
    mem = {"peak_alloc_gib": 20.0, "peak_reserved_gib": 22.0}
    rows = [Row("sparse_dist", "recpipe", step_ms={"p50": 8.0, "p90": 9.0}, memory=mem),
            Row("sparse_dist", "torchrec", step_ms={"p50": 8.5, "p90": 9.5}, memory=mem),
            Row("prefetch", "torchrec", status="failed", reason="x")]
    point = {"status": "ok", "step_ms": {"p50": 9.0}, "prefetch_ms": {"p50": 1.0},
             "memory_rank0": {"step_peak_alloc_above_build_gib": 0.3, "step_peak_reserved_above_build_gib": 0.4},
             "planner": {"per_step_bytes": 3e8, "prefetch_terms_bytes": 7e7, "passes_effective": {"t": 1}}}
    points = [dict(point, passes=p, prefetch_memory=prefetch_memory_point(_measured_alone(a, r), [pred]))
              for p, a, r, pred in ((1, 73 * MiB, 96 * MiB, 70 * MiB), (2, 44 * MiB, 96 * MiB, 42 * MiB),
                                    (4, 29 * MiB, 96 * MiB, 29 * MiB))]
    points.append({"passes": 8, "status": "failed", "reason": "y",
                   "prefetch_memory": {"status": "failed", "reason": "rank 0: boom"}})
    sweep = {"status": "ok", "prefetch_min_pass_size": 65536, "pipeline": "prefetch (recpipe)", "measured": "m",
             "predicted": "p", "prefetch_memory": "alone", "points": points,
             "prefetch_memory_target": prefetch_memory_target(points)}
    bound = {"status": "ok", "bound_ms": 5.0, "bound_resource": "compute"}
    return rows, {"bound": bound, "multipass": sweep}


def test_multipass_plot_is_a_png(tmp_path: Path):
    _, sections = _gpu_like_rows()
    sweep = sections["multipass"]
    assert write_plot(tmp_path / PLOT, lambda plt, path: draw(plt, path, sweep)) == {"written": [PLOT], "reason": ""}
    assert (tmp_path / PLOT).read_bytes().startswith(PNG_MAGIC)


def test_the_study_on_cpu_is_skipped_with_the_reason_and_bad_passes_exit_2(tmp_path: Path, capsys):
    assert main(["--config", SMOKE, "--passes", "1,two"]) == EXIT_BAD_CONFIG
    assert main(["--config", SMOKE, "--passes", "0,2"]) == EXIT_BAD_CONFIG
    assert "--passes" in capsys.readouterr().err
    out = tmp_path / "mp"
    assert main(["--config", SMOKE, "--passes", "1,2", "--steps", "2", "--warmup", "1", "--set", "distributed.nproc=1",
                 "--out", str(out)]) == 0
    record = json.loads((out / "bench.json").read_text())
    assert record["rows"] == []  # without --pipelines only the sweep runs
    assert record["multipass"]["status"] == "skipped" and record["multipass"]["passes"] == [1, 2]
    assert "fused_uvm_caching" in record["multipass"]["reason"]
    assert "## Multi-pass prefetch sweep" in (out / "bench.md").read_text()
    assert record["command"].startswith("python benchmarks/studies/multipass.py --config")
    assert not (out / PLOT).exists()


def _measured_alone(alloc: int, reserved: int, ms: float = 2.0) -> dict:
    """``measure_prefetch_memory``'s dict for one rank."""
    return {"status": "ok", "peak_alloc_bytes": alloc, "peak_alloc_bytes_max": alloc, "stream_reserved_bytes": reserved,
            "stream_reserved_bytes_max": reserved, "peak_alloc_bytes_per_rank": [alloc],
            "stream_reserved_bytes_per_rank": [reserved], "ms": summarize_ms([ms]), "chains": {"warmup": 2, "timed": 4}}


def test_isolated_prefetch_peak_by_hand():
    """One TBE of n = 1000 indices, b = 100 bags: scratch (44.18 n + 8 n merged at one
    pass) + locations 4 n + KJT offsets 4 (b + 1) + their int64 cast 8 (b + 1)."""
    one = 52_180 + 4_000 + 404 + 808
    assert isolated_prefetch_peak_bytes([(1000, 100)], 1, 1, (1, 6)) == one == 57_392
    # 4 passes of 250: the last pass peaks, 44.18 * 250 + 8 * 1000 merged = 19045 (its cat: 16 * 1000)
    assert isolated_prefetch_peak_bytes([(1000, 100)], 4, 1, (1, 6)) == 19_045 + 4_000 + 404 + 808
    assert isolated_prefetch_peak_bytes([(1000, 100)], 4, 1, (1, 3)) == 11_045 + 4_000 + 404 + 808  # no merge
    assert isolated_prefetch_peak_bytes([(1000, 100)], 4, 1000, (1, 6)) == one  # below the min pass size
    # Two TBEs: the second one's peak sits on what the first left (locations + KJT offsets).
    small = 26_090 + 2_000 + 204 + 408
    assert isolated_prefetch_peak_bytes([(1000, 100), (500, 50)], 1, 1, (1, 6)) == max(one, 4_404 + small) == one
    assert isolated_prefetch_peak_bytes([(500, 50), (1000, 100)], 1, 1, (1, 6)) == 2_204 + one == 59_596
    assert isolated_prefetch_peak_bytes([], 1, 1, (1, 6)) == 0


# The H100 multipass sweep (benchmarks/results/h100x1/multipass.md): 4 cached row-wise tables of
# pooling 40, B = 8192, W = 1 (placed table_wise on one rank: the same one TBE of the four cached tables).
H100_SWEEP = ["sharding.prefetch_min_pass_size=65536", "data.synthetic.mean_pooling_factors=[40,40,40,40"
              + ",1" * 22 + "]", "model.num_embeddings_per_feature=[2000000,2000000,2000000,2000000"
              + ",1000000" * 8 + ",100000" * 14 + "]", "distributed.nproc=1"]


@pytest.mark.parametrize("passes", [1, 2, 4, 8, 12])
def test_isolated_prefetch_prediction_of_the_h100_sweep(passes):
    """N = 4 x 40 x 8192 = 1,310,720 indices and b = 4 x 8192 bags in one TBE (table_wise/cached/d128:
    row_wise tables on one rank are placed table_wise, ``recpipe.table_sharding.placement.placed_type``).
    Leaves: 4 N + 12 (b + 1) = 5,636,108 B. Scratch (FBGEMM >= 1.4): one pass 52.18 N; 2 passes
    44.18 N / 2 + 8 N; 4 passes 44.18 N / 4 + 8 N; from 8 passes on the last cat's 16 N floor."""
    cfg, why = sweep_config(load_config(CONFIGS / "uvm_caching.yaml", H100_SWEEP), passes)
    assert not why
    n = 1_310_720
    scratch = {1: 68_393_370, 2: 39_439_565, 4: 24_962_663, 8: 16 * n, 12: 16 * n}[passes]
    assert scratch == max(math.ceil(44.18 * n / passes + 8 * n), 16 * n)
    pred = planner_prediction(cfg, 1)
    assert pred["isolated_prefetch_peak_bytes"] == [scratch + 4 * n + 12 * (4 * 8192 + 1)]
    assert pred["passes_effective"] == {"table_wise/cached/d128": passes}


def test_prefetch_memory_point_and_target():
    point = prefetch_memory_point(_measured_alone(77 * MiB, 96 * MiB), [70 * MiB])
    assert point["measured_over_predicted"] == pytest.approx(1.1) and point["predicted_peak_bytes"] == 70 * MiB
    assert prefetch_memory_point({"status": "failed", "reason": "x"}, [1]) == {"status": "failed", "reason": "x"}
    assert "measured_over_predicted" not in prefetch_memory_point(_measured_alone(1, 1), None)
    two = dict(_measured_alone(60, 0), peak_alloc_bytes_per_rank=[60, 0])
    assert prefetch_memory_point(two, [50, 0])["measured_over_predicted_per_rank"] == [1.2, None]

    def pts(*ratios):
        return [{"passes": p, "prefetch_memory": prefetch_memory_point(_measured_alone(int(100 * r), 0), [100])}
                for p, r in zip((1, 2, 4), ratios)]

    assert prefetch_memory_target(pts(1.0, 0.95, 1.08)) == {
        "tolerance": 0.10, "holds": True, "worst_ratio": 1.08, "worst_passes": 4, "not_compared": []}
    miss = prefetch_memory_target(pts(1.0, 0.85, 1.05))
    assert (miss["holds"], miss["worst_ratio"], miss["worst_passes"]) == (False, 0.85, 2)
    failed = {"passes": 8, "status": "failed", "prefetch_memory": {"status": "failed"}}
    gap = prefetch_memory_target(pts(1.0) + [failed])
    assert (gap["holds"], gap["not_compared"]) == (False, [8])


def test_multipass_markdown_has_the_prefetch_alone_table_and_target():
    _, sections = _gpu_like_rows()
    md = "\n".join(multipass_md(sections["multipass"])).splitlines()
    table = [line for line in md if line.startswith("| 1 |") or line.startswith("| 8 |")]
    assert len(table) == 4  # step-level table and prefetch-alone table, P=1 and P=8 in each
    alone = next(line for line in table if "73.0" in line)
    assert alone.split(" | ")[1:8] == ["2.000", "73.0", "73.0", "96.0", "70.0", "1.043", "1.043"]
    assert any("failed: rank 0: boom" in line for line in table)
    target = next(line for line in md if line.startswith("- Target"))
    assert "within 10%" in target and "**does not hold**" in target and "not compared at P=8" in target
    assert "worst measured/predicted 1.048 at P=2" in target
    ok = dict(sections["multipass"], points=sections["multipass"]["points"][:3])
    ok["prefetch_memory_target"] = prefetch_memory_target(ok["points"])
    assert "**holds** (worst measured/predicted 1.048 at P=2)" in multipass_md(ok)[-2]
    old = {k: v for k, v in sections["multipass"].items() if not k.startswith("prefetch_memory")}
    assert not any("Target" in x or "Prefetch alone" in x for x in multipass_md(old))  # records from before it
