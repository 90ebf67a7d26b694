"""``recpipe bench``: the CPU smoke run end to end (2 Gloo ranks) with the hardware
bound, plots and a skipped multi-pass sweep, a second run against the first as the
weak-scaling baseline, one multi-pass sweep point on one rank, and the pieces that
need no process group (which config each pipeline runs, statistics, tables, plots)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from recpipe.bench.bound import STAGES, hbm_peak, prefetch_memory, stream_reserved_bytes
from recpipe.bench.measure import percentile, reserved_by_stream, summarize_ms
from recpipe.bench.multipass import (
    isolated_prefetch_peak_bytes,
    planner_prediction,
    prefetch_memory_point,
    prefetch_memory_target,
    sweep_config,
)
from recpipe.bench.plots import CACHE_SWEEP, MEMORY, MULTIPASS, STEP_TIME, write_plots
from recpipe.bench.report import Row, format_table
from recpipe.bench.runner import DRAIN, TRACE_STEPS, config_for_pipeline
from recpipe.bench.sections import bound_md, multipass_md, streams_md
from recpipe.cli import main
from recpipe.exit_codes import EXIT_BAD_CONFIG
from recpipe.config import ConfigError, load_config
from recpipe.pipelines import PIPELINES
from recpipe.pipelines import all_schedules

CONFIGS = Path(__file__).parent.parent / "configs" / "bench"
SMOKE = str(CONFIGS / "smoke_cpu.yaml")

# What runs on CPU (torchrec 1.8.0, fbgemm-gpu-cpu 1.8.0): every recpipe pipeline but
# prefetch (no UVM cache on CPU: skipped); TorchRec's Base and SparseDist. TorchRec's
# FusedSparseDist and SemiSync raise on CPU ("unknown parameter type"); the bench
# records them as failed and goes on.
CPU_OK = {("base", "recpipe"), ("sparse_dist", "recpipe"), ("fused_sparse_dist", "recpipe"),
          ("semi_sync", "recpipe"), ("base", "torchrec"), ("sparse_dist", "torchrec")}


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MiB = 1 << 20
# Stages of --bound that a CPU run measures: all but the UVM-cache prefetch.
CPU_STAGES = set(STAGES) - {"prefetch"}


def _main_table(md: str) -> list[str]:
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| pipeline | impl | P50 ms"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return lines[start + 2 : end]


@pytest.mark.slow
def test_smoke_cpu_bench_writes_json_and_markdown(tmp_path: Path):
    out = tmp_path / "bench"
    # --pipelines named: with a cache sweep, the plain runs happen only when asked for.
    code = main(["bench", "--config", SMOKE, "--steps", "3", "--warmup", "1", "--with-torchrec", "--bound",
                 "--pipelines", ",".join(PIPELINES),
                 "--multipass", "1,2", "--sweep-cache", "0.1,0.3", "--sweep-zipf", "0.8", "--out", str(out)])
    assert code == 0
    record = json.loads((out / "bench.json").read_text())

    # header first: resolved config, versions, hardware, world size, date
    assert list(record)[:4] == ["config", "date", "versions", "gpu"]
    assert record["config"] == load_config(SMOKE).model_dump(mode="json")
    assert {"torch", "fbgemm_gpu", "torchrec", "cuda"} <= set(record["versions"])
    assert record["versions"]["torch"] and record["versions"]["fbgemm_gpu"] != "unknown"
    assert record["gpu"]["name"] and record["world_size"] == 2
    bench = record["bench"]
    assert (bench["steps"], bench["warmup"], bench["batches_per_rank"]) == (3, 1, 3 + 1 + TRACE_STEPS + DRAIN)
    assert bench["trace_steps"] == TRACE_STEPS
    assert bench["global_batch"] == 2 * load_config(SMOKE).data.batch_size

    rows = {(r["pipeline"], r["impl"]): r for r in record["rows"]}
    assert set(rows) == {(n, i) for n in PIPELINES for i in ("recpipe", "torchrec")}
    for key in CPU_OK:
        r = rows[key]
        assert r["status"] == "ok", (key, r["reason"])
        assert len(r["step_ms_per_step"]) == 3 and len(r["step_ms_p50_per_rank"]) == 2
        assert 0 < r["step_ms"]["p50"] <= r["step_ms"]["p90"] <= r["step_ms"]["max"]
        assert r["samples_per_s"] > 0 and r["samples_per_s_wall"] > 0
        assert r["samples_per_s_per_gpu"] == pytest.approx(r["samples_per_s"] / 2)
        assert r["x_bound"] == pytest.approx(r["step_ms"]["p50"] / record["bound"]["bound_ms"])
        assert r["memory"] == {}  # CPU: no allocator numbers
        _check_cpu_trace(key, r)
    for impl in ("recpipe", "torchrec"):
        assert rows["prefetch", impl]["status"] == "skipped"
        assert "fused_uvm_caching" in rows["prefetch", impl]["reason"]
    for name in ("fused_sparse_dist", "semi_sync"):  # TorchRec's on CPU: recorded, not fatal
        assert rows[name, "torchrec"]["status"] in ("ok", "failed")
    # TorchRec's FX trace of RecModel(Batch) found the sharded EBC
    assert rows["sparse_dist", "torchrec"]["torchrec_pipelined_modules"] == 1
    assert rows["semi_sync", "torchrec"]["options"]["start_batch"] == 0
    assert rows["fused_sparse_dist", "torchrec"]["options"]["emb_lookup_stream"] == "current"

    md = (out / "bench.md").read_text()
    assert "CPU (Gloo)" in md and "none" not in md.split("- command:")[0] and "CUDA None" not in md
    for needle in ("torch ", "fbgemm-gpu ", "torchrec ", "CUDA ", "GPU:", "world size 2", "## Resolved config",
                   "## Stages timed alone", "**Stages alone: ", "## Multi-pass prefetch sweep", "## Weak scaling",
                   "## GPU busy time and host time", "## Host time by phase", "n/a: CPU run"):
        assert needle in md
    assert len(_main_table(md)) == len(rows)
    _check_bound(record["bound"])
    # the sweep needs a UVM cache: skipped with the reason, in the JSON and in the report
    assert record["multipass"]["status"] == "skipped" and record["multipass"]["passes"] == [1, 2]
    assert "fused_uvm_caching" in record["multipass"]["reason"] and "fused_uvm_caching" in md
    # the cache sweep: no UVM cache on CPU (nor in this config), said so, nothing measured
    grid = record["cache_sweep"]
    assert (grid["status"], grid["cache_load_factors"], grid["zipf_alphas"]) == ("skipped", [0.1, 0.3], [0.8])
    assert "needs CUDA" in grid["reason"] and "fused_uvm_caching" in grid["reason"] and "points" not in grid
    assert "Not measured (load factors [0.1, 0.3], Zipf alphas [0.8]): needs a fused_uvm_caching" in md
    # plots: step time (with the bound), no memory plot on CPU, no sweep plots
    assert record["plots"]["written"] == [STEP_TIME] and MEMORY in record["plots"]["reason"]
    assert CACHE_SWEEP in record["plots"]["reason"] and not (out / CACHE_SWEEP).exists()
    assert (out / STEP_TIME).read_bytes().startswith(PNG_MAGIC)
    assert not (out / MEMORY).exists() and not (out / MULTIPASS).exists()
    _second_run_against_baseline(tmp_path, out / "bench.json", rows)


def _check_cpu_trace(key: tuple[str, str], r: dict) -> None:
    """The profiled steps on CPU: host times and phases, no GPU busy time (n/a, not 0)."""
    t = r["trace"]
    assert t["status"] == "ok", (key, t)
    assert t["steps"] == TRACE_STEPS and t["gpu_busy_ms"] is None and r["gpu_busy_ms"] is None and r["x_busy"] is None
    assert t["gpu_busy_reason"].startswith("n/a: CPU run")
    assert 0 < t["host_ms_p50"] and 0 <= t["outside_phases_ms"] <= t["window_ms"] * 1.01
    assert len(t["per_rank"]) == 2 and t["host_ms_p50"] == max(p["host_ms_p50"] for p in t["per_rank"])
    assert r["cache"] == {}  # no UVM-cached table in the smoke config
    phases = t["phases_ms"]
    if key[1] == "torchrec":  # TorchRec's own ## forward ## ranges, batch index dropped
        assert t["phase_source"] == "torchrec" and "forward" in phases and phases["forward"] > 0
    elif phases:  # the engine's recpipe.<step> ranges, where the engine opens them
        steps = {s.name for schedules in all_schedules().values() for sch in schedules for s in sch.steps}
        assert t["phase_source"] == "recpipe" and set(phases) <= steps and "forward" in phases
    else:
        assert "opens none" in t["phases_reason"]
    # phases (rank 0's) + outside cover rank 0's calls: their mean, >= 3/5 of the median of 5 calls
    assert sum(phases.values()) + t["outside_phases_ms"] >= t["per_rank"][0]["host_ms_p50"] * 0.6 * 0.999


def _check_bound(bound: dict) -> None:
    assert bound["status"] == "ok", bound.get("reason")
    measured = {name for name, s in bound["stages"].items() if s["ms"] is not None}
    assert measured == CPU_STAGES
    for name in measured:
        s = bound["stages"][name]
        assert s["chains"] > 0 and 0 <= s["ms"]["p50"] <= s["ms"]["p90"] and len(s["p50_per_rank"]) == 2
    assert bound["stages"]["prefetch"]["reason"].startswith("n/a: no fused_uvm_caching")
    assert set(bound["resources"]) == {"compute", "comm", "copy"}
    assert bound["bound_resource"] in bound["resources"]
    assert bound["bound_ms"] == max(r["ms"] for r in bound["resources"].values()) > 0
    compute = sum(bound["stages"][n]["ms"]["p50"] for n in ("lookup", "dense_fwd_bwd", "emb_bwd", "optimizer"))
    assert bound["resources"]["compute"]["ms"] == pytest.approx(compute)
    bw = bound["bandwidth"]
    assert bw["h2d"]["bytes"] > 0 and bw["tbe_lookup"]["GB_per_s"] > 0 and bw["dense_allreduce"]["bytes"] > 0
    assert "fraction_of_peak" not in bw["tbe_lookup"]  # no HBM peak for a CPU
    assert "prefetch_h2d" not in bw


def _second_run_against_baseline(tmp_path: Path, baseline: Path, first_rows: dict) -> None:
    out = tmp_path / "again"
    code = main(["bench", "--config", SMOKE, "--steps", "3", "--warmup", "1", "--pipelines", "base,sparse_dist",
                 "--baseline", str(baseline), "--no-plots", "--out", str(out)])
    assert code == 0
    record = json.loads((out / "bench.json").read_text())
    assert "plots" not in record and not list(out.glob("*.png"))
    ws = record["weak_scaling"]
    assert ws["baseline_world_size"] == 2 and ws["baseline"] == str(baseline)
    by_key = {(r["pipeline"], r["impl"]): r for r in ws["rows"]}
    assert set(by_key) == {("base", "recpipe"), ("sparse_dist", "recpipe")}
    for key, r in by_key.items():
        then = first_rows[key]["samples_per_s_per_gpu"]
        assert r["baseline_samples_per_s_per_gpu"] == pytest.approx(then)
        assert r["efficiency"] == pytest.approx(r["samples_per_s_per_gpu"] / then)
    row = next(r for r in record["rows"] if r["pipeline"] == "base")
    assert row["weak_scaling"]["efficiency"] == by_key["base", "recpipe"]["efficiency"]
    md = (out / "bench.md").read_text()
    assert "| efficiency |" in md and "baseline samples/s/GPU" in md
    header = next(line for line in md.splitlines() if line.startswith("| pipeline | impl | P50 ms"))
    assert "samples/s/GPU" in header and "x GPU busy" in header and "x stages alone" not in header  # no --bound


def test_bad_bench_arguments_exit_2(capsys, tmp_path: Path):
    assert main(["bench", "--config", SMOKE, "--pipelines", "base,nope"]) == EXIT_BAD_CONFIG
    assert "nope" in capsys.readouterr().err
    assert main(["bench", "--config", SMOKE, "--multipass", "1,two"]) == EXIT_BAD_CONFIG
    assert main(["bench", "--config", SMOKE, "--multipass", "0,2"]) == EXIT_BAD_CONFIG
    assert "--multipass" in capsys.readouterr().err
    assert main(["bench", "--config", SMOKE, "--baseline", str(tmp_path / "none.json")]) == EXIT_BAD_CONFIG
    (tmp_path / "x.json").write_text("{}")
    assert main(["bench", "--config", SMOKE, "--baseline", str(tmp_path / "x.json")]) == EXIT_BAD_CONFIG
    assert "bench.json" in capsys.readouterr().err
    assert main(["bench", "--config", SMOKE, "--steps", "0"]) == EXIT_BAD_CONFIG
    assert main(["bench", "--config", SMOKE, "--steps", "1000"]) == EXIT_BAD_CONFIG  # more than the data has
    assert "data.synthetic.num_batches" in capsys.readouterr().err


def test_prefetch_runs_only_with_a_locked_cache_and_others_drop_the_lock():
    cfg = load_config(CONFIGS / "uvm_caching.yaml")
    cfg_p, overrides, skip = config_for_pipeline(cfg, "prefetch")
    assert not skip and overrides == {} and cfg_p.cache_line_locking
    # semi_sync looks up batch i+1 before backward(i): refused on unlocked UVM caches.
    _, _, skip = config_for_pipeline(cfg, "semi_sync")
    assert "semi_sync" in skip and "evict" in skip, skip
    for name in ("base", "sparse_dist", "fused_sparse_dist"):
        cfg_p, overrides, skip = config_for_pipeline(cfg, name)
        assert not skip and cfg_p.pipeline.name == name
        assert not cfg_p.cache_line_locking
        assert overrides == {"pipeline.name": name}
        assert cfg_p.sharding.uvm_host_mapped and cfg_p.model == cfg.model
    _, _, skip = config_for_pipeline(load_config(CONFIGS / "dlrm_criteo.yaml"), "prefetch")
    assert "fused_uvm_caching" in skip


def test_pipeline_variants_run_with_their_own_options_and_typos_are_config_errors(capsys):
    cfg = load_config(CONFIGS / "dlrm_criteo.yaml")
    cfg_p, overrides, skip = config_for_pipeline(cfg, "semi_sync:output_dist_wait=early+stash_gradients=true")
    assert not skip and cfg_p.pipeline.name == "semi_sync"
    assert cfg_p.pipeline.output_dist_wait == "early" and cfg_p.pipeline.stash_gradients is True
    assert overrides == {"pipeline.name": "semi_sync", "pipeline.output_dist_wait": "early",
                         "pipeline.stash_gradients": True}
    _, _, skip = config_for_pipeline(cfg, "prefetch:cache_fill=false")
    assert "fused_uvm_caching" in skip  # the variant's pipeline is still checked against the tables
    for bad in ("semi_sync:output_dist_wait=late", "semi_sync:no_such_option=1", "sparse_dist:oops"):
        assert main(["bench", "--config", SMOKE, "--pipelines", f"base,{bad}"]) == EXIT_BAD_CONFIG
        assert bad.split(":")[1].split("=")[0] in capsys.readouterr().err


def test_variants_with_config_keys_change_that_run_only_and_run_on_both_impls(tmp_path: Path, capsys):
    """A dotted variant key sets any config key but data.* for that row (e.g. fp16 vs
    fp32 rows interleaved in one run); TorchRec's pipelines get it too."""
    cfg = load_config(CONFIGS / "dlrm_criteo.yaml")
    label = "sparse_dist:sharding.default.weights_precision=fp16+sharding.comm_precision.forward=bf16"
    cfg_p, overrides, skip = config_for_pipeline(cfg, label)
    assert not skip and cfg_p.pipeline.name == "sparse_dist"
    tbe = [name for name, t in cfg.table_sharding().items() if t.type != "data_parallel"]
    assert tbe and {cfg_p.table_sharding()[name].weights_precision for name in tbe} == {"fp16"}
    assert cfg_p.sharding.comm_precision.forward == "bf16"
    assert {cfg.table_sharding()[name].weights_precision for name in tbe} == {None}  # cfg untouched (fp32)
    assert overrides == {"sharding.default.weights_precision": "fp16", "sharding.comm_precision.forward": "bf16"}
    both, _, _ = config_for_pipeline(cfg, "semi_sync:output_dist_wait=early+train.precision=bf16")
    assert (both.pipeline.output_dist_wait, both.train.precision) == ("early", "bf16")
    for bad, named in (("sparse_dist:data.batch_size=8", "data.batch_size"),
                       ("sparse_dist:pipeline.start_batch=1", "pipeline.start_batch")):
        with pytest.raises(ConfigError, match=named):
            config_for_pipeline(cfg, bad)
    with pytest.raises(ConfigError, match="weights_precision"):  # a bad value names its key
        config_for_pipeline(cfg, "sparse_dist:sharding.default.weights_precision=fp12")

    out = tmp_path / "b"
    fp16 = "sparse_dist:sharding.default.weights_precision=fp16"
    code = main(["bench", "--config", SMOKE, "--steps", "2", "--warmup", "1", "--trace-steps", "0", "--with-torchrec",
                 "--pipelines", f"sparse_dist,{fp16},sparse_dist:max_batches_ahead=1", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    rows = {(r["pipeline"], r["impl"]): r for r in json.loads((out / "bench.json").read_text())["rows"]}
    assert set(rows) == {("sparse_dist", "recpipe"), ("sparse_dist", "torchrec"), (fp16, "recpipe"),
                         (fp16, "torchrec"), ("sparse_dist:max_batches_ahead=1", "recpipe")}
    assert all(r["status"] == "ok" for r in rows.values()), {k: r["reason"] for k, r in rows.items()}
    assert rows[fp16, "torchrec"]["config_overrides"]["sharding.default.weights_precision"] == "fp16"


def test_pipeline_options_carry_over_only_for_the_configured_pipeline():
    cfg = load_config(SMOKE, ["pipeline={name: semi_sync, start_batch: 5, max_batches_ahead: 2}"])
    same, overrides, _ = config_for_pipeline(cfg, "semi_sync")
    assert (same.pipeline.start_batch, overrides) == (5, {})
    other, _, _ = config_for_pipeline(cfg, "sparse_dist")
    assert other.pipeline.max_batches_ahead == 2  # common options apply to every pipeline


def test_percentiles_and_table():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    s = summarize_ms([1.0, 2.0, 3.0])
    assert (s["p50"], s["min"], s["max"], s["mean"]) == (2.0, 1.0, 3.0, 2.0)
    rows = [
        Row("base", "recpipe", step_ms={"p50": 1.5, "p90": 2.0}, samples_per_s=1000.0,
            memory={"peak_alloc_gib": 1.0, "peak_reserved_gib": 1.5, "reserved_over_alloc": 1.5,
                    "step_peak_alloc_above_build_gib": 0.25}),
        Row("prefetch", "torchrec", status="skipped", reason="no cache"),
    ]
    text = format_table(rows)
    assert "1.50" in text and "1,000" in text and "1.500" in text and "skipped: no cache" in text
    md = format_table(rows, markdown=True).splitlines()
    assert len(md) == 4 and all(line.startswith("|") for line in md)


@pytest.mark.slow
def test_multipass_point_times_the_prefetch_step_and_asks_the_planner():
    """The sweep's per-point machinery on one Gloo rank. On CPU the config cannot have
    a UVM cache, so the prefetch pipeline runs with a no-op prefetch step (as in CPU CI):
    what is checked is the plumbing the GPU run relies on."""
    from tqdm import tqdm

    from recpipe.bench.multipass import _point, sweep_config, sweep_skip_reason
    from recpipe.bench.runner import BenchOptions, _single_rank_group, pregenerate
    from recpipe.distributed import init_process_group

    cfg = load_config(SMOKE, ["pipeline.name=prefetch", "distributed.nproc=1"])
    opts = BenchOptions(("prefetch",), False, steps=3, warmup=2, out="unused")
    with _single_rank_group():
        device = init_process_group(cfg)
        batches = pregenerate(cfg, 0, 1, opts.batches_per_run, device)
        point = _point(cfg, 1, batches, opts, device, tqdm(disable=True))
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


def test_plots_are_pngs_and_skip_what_has_no_data(tmp_path: Path):
    rows, sections = _gpu_like_rows()
    result = write_plots(tmp_path, rows, sections)
    assert result == {"written": [STEP_TIME, MEMORY, MULTIPASS], "reason": ""}
    for name in result["written"]:
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC)
    cpu_rows = [Row("base", "recpipe", step_ms={"p50": 1.0, "p90": 2.0})]
    result = write_plots(tmp_path / "cpu", cpu_rows, {"multipass": {"status": "skipped", "reason": "r"}})
    assert result["written"] == [STEP_TIME] and MEMORY in result["reason"] and MULTIPASS in result["reason"]


def test_hbm_peak_by_gpu_name():
    assert hbm_peak("NVIDIA H100 80GB HBM3") == ("H100 SXM", 3.35e12)
    assert hbm_peak("NVIDIA H200") == ("H200", 4.8e12)
    assert hbm_peak("NVIDIA H100 PCIe") is None and hbm_peak("cpu") is None


# ------------------------------------------------------------------ prefetch memory alone
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
    row_wise tables on one rank are placed table_wise, ``recpipe.torchrec_args.placed_type``).
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


def test_bound_prefetch_memory_summary_and_line():
    def rank(peaks, reserved, ms, ran=True):
        chains = [({"prefetch": t} if ran else {}, {"prefetch_peak_alloc_bytes": a, "prefetch_stream_reserved_bytes": r}
                   if ran else {}) for a, r, t in zip(peaks, reserved, ms)]
        return {"prefetch": ran, "chains": chains}

    per_rank = [rank([10 * MiB, 12 * MiB], [20 * MiB, 22 * MiB], [1.0, 3.0]),
                rank([11 * MiB, 13 * MiB], [22 * MiB, 22 * MiB], [2.0, 2.0]), rank([0, 0], [0, 0], [0, 0], ran=False)]
    pm = prefetch_memory(per_rank)
    assert (pm["peak_alloc_bytes"], pm["peak_alloc_bytes_max"]) == (12 * MiB, 13 * MiB)
    assert pm["peak_alloc_bytes_per_rank"] == [12 * MiB, 13 * MiB, 0]
    assert (pm["stream_reserved_bytes"], pm["stream_reserved_bytes_max"]) == (22 * MiB, 22 * MiB)
    assert (pm["ms"]["min"], pm["ms"]["max"]) == (2.0, 3.0)  # per chain the slowest rank that ran it
    bound = {"status": "ok", "method": "m", "timing": "t", "chains": {"timed": 2, "warmup": 1, "kinds": "k"},
             "stages": {}, "resources": {}, "bound_ms": 1.0, "bound_resource": "compute", "bandwidth": {},
             "prefetch_memory": pm}
    line = next(x for x in bound_md(bound) if "prefetch memory" in x)
    assert "peak 12.0 MiB allocated" in line and "max over ranks 13.0" in line and "22.0 MiB reserved" in line


def test_stream_reserved_bytes_sums_the_streams_segments(monkeypatch):
    import torch

    segments = [{"device": 0, "stream": 7, "total_size": 2 * MiB, "active_size": MiB},
                {"device": 0, "stream": 7, "total_size": 20 * MiB, "active_size": 0},
                {"device": 0, "stream": 0, "total_size": 64 * MiB, "active_size": 60 * MiB},
                {"device": 0, "stream": 9, "total_size": 4 * MiB, "active_size": 0},
                {"device": 1, "stream": 7, "total_size": MiB, "active_size": MiB}]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)

    class Stream:
        cuda_stream = 7

    assert stream_reserved_bytes(torch.device("cuda", 0), Stream()) == 22 * MiB
    assert stream_reserved_bytes(torch.device("cuda", 1), Stream()) == MiB

    # By role: a recpipe pipeline's streams and a TorchRec pipeline's *_stream attributes.
    class Fake:  # a torch.cuda.Stream as far as the function looks (no CUDA here)
        def __init__(self, handle):
            self.cuda_stream = handle

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Fake(0))

    @dataclasses.dataclass
    class Roles:
        memcpy: object
        dist: object

    class RecpipePipe:
        streams = Roles(memcpy=Fake(7), dist=None)

    class TorchRecPipe:
        def __init__(self):
            self._data_dist_stream = Fake(7)

    gib = MiB / 2**30
    for pipe, role in ((RecpipePipe(), "memcpy"), (TorchRecPipe(), "data_dist")):
        assert reserved_by_stream(torch.device("cuda", 0), pipe) == {
            "compute": [64 * gib, 60 * gib], role: [22 * gib, 1 * gib], "other": [4 * gib, 0.0]}


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


def test_streams_section_lists_reserved_memory_by_stream_largest_first():
    row = Row(pipeline="semi_sync", impl="recpipe", status="ok",
              memory={"reserved_over_alloc": 1.071, "reserved_by_stream": [
                  {"dist": [0.25, 0.0], "compute": [10.0, 9.5]}, {"compute": [9.0, 8.0]}]})
    md = "\n".join(streams_md([row, Row(pipeline="base", impl="recpipe", status="ok")]))
    assert "| semi_sync | recpipe | 1.071 | 0 | compute 10.00 (9.50), dist 0.25 (0.00) |" in md
    assert "| semi_sync | recpipe | 1.071 | 1 | compute 9.00 (8.00) |" in md
    assert "| base |" not in md
