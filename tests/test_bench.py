"""``recpipe bench``: the CPU smoke run end to end (2 Gloo ranks) with plots, bad
arguments, ``--help``, and the pieces that need no process group (which config each
pipeline runs, TorchRec's compiled row, statistics, tables, plots). The studies built on
it are tested in tests/studies/."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from recpipe.bench.measure import percentile, summarize_ms
from recpipe.bench.report import MEMORY_PLOT, STEP_TIME_PLOT, Row, format_table, write_plots
from recpipe.bench.run import config_for_pipeline
from recpipe.bench.run import DRAIN, BenchOptions
from recpipe.bench.runner import runs_of
from recpipe.cli import build_parser, main
from recpipe.exit_codes import EXIT_BAD_CONFIG
from recpipe.config import ConfigError, load_config
from recpipe.pipelines import PIPELINES
from recpipe.pipelines import all_schedules

CONFIGS = Path(__file__).parent.parent / "configs" / "bench"
TRACE_STEPS = build_parser().parse_args(["bench", "--config", "x"]).trace_steps  # the default
SMOKE = str(CONFIGS / "smoke_cpu.yaml")

# What runs on CPU (torchrec 1.8.0, fbgemm-gpu-cpu 1.8.0): every recpipe pipeline but
# prefetch (no UVM cache on CPU: skipped); TorchRec's Base and SparseDist. TorchRec's
# FusedSparseDist and SemiSync raise on CPU ("unknown parameter type"); the bench
# records them as skipped, saying why, and goes on.
CPU_OK = {("base", "recpipe"), ("sparse_dist", "recpipe"), ("fused_sparse_dist", "recpipe"),
          ("semi_sync", "recpipe"), ("base", "torchrec"), ("sparse_dist", "torchrec")}


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _main_table(md: str) -> list[str]:
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| pipeline | impl | P50 ms"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return lines[start + 2 : end]


@pytest.mark.slow
def test_smoke_cpu_bench_writes_json_and_markdown(tmp_path: Path, capfd):
    out = tmp_path / "bench"
    code = main(["bench", "--config", SMOKE, "--steps", "3", "--warmup", "1", "--with-torchrec", "--out", str(out)])
    assert code == 0
    printed = capfd.readouterr()
    assert "USDT" not in printed.out + printed.err, "the profiler's marker lines reached the console"
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
        assert r["memory"] == {}  # CPU: no allocator numbers
        _check_cpu_trace(key, r)
    for impl in ("recpipe", "torchrec"):
        assert rows["prefetch", impl]["status"] == "skipped"
        assert "fused_uvm_caching" in rows["prefetch", impl]["reason"]
    for name in ("fused_sparse_dist", "semi_sync"):  # TorchRec's on CPU: skipped, saying why
        assert rows[name, "torchrec"]["status"] == "skipped", rows[name, "torchrec"]
        assert "runs on CUDA only" in rows[name, "torchrec"]["reason"]
        assert f"{name} (torchrec) skipped: TorchRec's pipeline runs on CUDA only" in printed.out
    # TorchRec's FX trace of RecModel(Batch) found the sharded EBC
    assert rows["sparse_dist", "torchrec"]["torchrec_pipelined_modules"] == 1
    assert rows["semi_sync", "torchrec"]["options"]["start_batch"] == 0
    assert rows["fused_sparse_dist", "torchrec"]["options"]["emb_lookup_stream"] == "current"

    md = (out / "bench.md").read_text()
    assert "CPU (Gloo)" in md and "none" not in md.split("- command:")[0] and "CUDA None" not in md
    for needle in ("torch ", "fbgemm-gpu ", "torchrec ", "CUDA ", "GPU:", "world size 2", "## Resolved config",
                   "## Host time by phase", "## Paired comparisons"):
        assert needle in md
    assert len(_main_table(md)) == len(rows)
    header = next(line for line in md.splitlines() if line.startswith("| pipeline | impl | P50 ms"))
    assert "samples/s/GPU" in header and "x GPU busy" in header and "x stages alone" not in header
    assert "## GPU time by kernel class" not in md  # CPU: no kernels
    # paired comparisons: every ok recpipe row against TorchRec's of its pipeline and recpipe's base
    pairs = {(p["a"], p["b"]): p for p in record["comparisons"]}
    assert {("base (recpipe)", "base (torchrec)"), ("sparse_dist (recpipe)", "sparse_dist (torchrec)"),
            ("semi_sync (recpipe)", "base (recpipe)")} <= set(pairs)
    pair = pairs[("sparse_dist (recpipe)", "sparse_dist (torchrec)")]
    assert pair["pooled_ratio"] == pytest.approx(rows["sparse_dist", "recpipe"]["step_ms"]["p50"]
                                                 / rows["sparse_dist", "torchrec"]["step_ms"]["p50"])
    assert pair["rounds"] == 1 and pair["sign_test_p"] is None
    # plots: step time, no memory plot on CPU
    assert record["plots"]["written"] == [STEP_TIME_PLOT] and MEMORY_PLOT in record["plots"]["reason"]
    assert (out / STEP_TIME_PLOT).read_bytes().startswith(PNG_MAGIC)
    assert not (out / MEMORY_PLOT).exists()


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


def test_bad_bench_arguments_exit_2(capsys, tmp_path: Path):
    assert main(["bench", "--config", SMOKE, "--pipelines", "base,nope"]) == EXIT_BAD_CONFIG
    assert "nope" in capsys.readouterr().err
    for flag, value in (("--warmup", "-1"), ("--trace-steps", "-1"), ("--rounds", "0")):
        assert main(["bench", "--config", SMOKE, flag, value]) == EXIT_BAD_CONFIG
        assert flag in capsys.readouterr().err
    assert main(["bench", "--config", SMOKE, "--profile", "--trace-steps", "0"]) == EXIT_BAD_CONFIG
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
    # one key of a speed feature's section, after its shorthand or alone
    cfg_p, overrides, skip = config_for_pipeline(cfg, "sparse_dist:cuda_graphs=true+cuda_graphs.optimizer=false")
    assert not skip and cfg_p.pipeline.cuda_graphs.enabled and not cfg_p.pipeline.cuda_graphs.optimizer
    assert overrides["pipeline.cuda_graphs.optimizer"] is False
    cfg_p, _, skip = config_for_pipeline(cfg, "sparse_dist:step_graph.enabled=true+step_graph.headroom=1.5")
    assert not skip and cfg_p.pipeline.step_graph.enabled and cfg_p.pipeline.step_graph.headroom == 1.5
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


def test_help_shows_every_flag_with_its_default_and_no_study_flags(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--steps", "100"), ("--warmup", "20"), ("--rounds", "1"), ("--trace-steps", "5")):
        assert f"{flag} " in text and f"(default: {default})" in text
    for flag in ("--pipelines", "--with-torchrec", "--profile", "--no-plots", "--out"):
        assert flag in text
    assert text.count("default:") >= 9  # every flag says its default
    for gone in ("--bound", "--multipass", "--sweep-cache", "--sweep-zipf", "--baseline"):
        assert gone not in text


def test_torchrecs_compiled_pipeline_is_a_row_only_with_compile_on():
    """``pipeline.compile.enabled`` adds TorchRec's TrainPipelinePT2 as one more base row
    with --with-torchrec; TorchRec 1.6 and 1.8 take (model, optimizer, device, compile_configs)."""
    import torch

    from recpipe.bench.run import build_torchrec_pipeline
    from recpipe.compat.torch import dynamo_config_kept

    cfg = load_config(SMOKE)
    assert not cfg.pipeline.compile.enabled  # pipeline.compile off by default
    on = load_config(SMOKE, ["pipeline.compile=true"])
    assert on.pipeline.compile.enabled
    opts = BenchOptions(("sparse_dist", "semi_sync:output_dist_wait=early"), True, 3, 1, 0, "unused")
    assert runs_of(cfg, opts) == [("sparse_dist", "recpipe"), ("sparse_dist", "torchrec"),
                                  ("semi_sync:output_dist_wait=early", "recpipe")]
    assert runs_of(on, opts)[-1] == ("base", "torchrec_pt2") and len(runs_of(on, opts)) == 4
    assert ("base", "torchrec_pt2") not in runs_of(on, BenchOptions(("base",), False, 3, 1, 0, "unused"))
    model = torch.nn.Linear(4, 1)
    base = config_for_pipeline(cfg, "base")[0]
    pipe, options, _ = build_torchrec_pipeline(base, model, torch.optim.SGD(model.parameters(), lr=0.1),
                                               torch.device("cpu"), compiled=True)
    assert type(pipe).__name__ == "TrainPipelinePT2"
    assert options["compile_configs"]["backend"] == "inductor"
    # TrainPipelinePT2 sets dynamo's process-wide flags when it compiles: put back after its run
    import torch._dynamo

    before = torch._dynamo.config.capture_scalar_outputs
    with dynamo_config_kept():
        torch._dynamo.config.capture_scalar_outputs = not before
    assert torch._dynamo.config.capture_scalar_outputs == before


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


def test_plots_are_pngs_and_skip_what_has_no_data(tmp_path: Path):
    mem = {"peak_alloc_gib": 20.0, "peak_reserved_gib": 22.0}
    rows = [Row("sparse_dist", "recpipe", step_ms={"p50": 8.0, "p90": 9.0}, memory=mem, gpu_busy_ms=7.5,
                round_p50_ms=[7.9, 8.1], host_ms={"p50": 3.0}),
            Row("sparse_dist", "torchrec", step_ms={"p50": 8.5, "p90": 9.5}, memory=mem),
            Row("base", "torchrec_pt2", step_ms={"p50": 9.5, "p90": 9.9}, memory=mem),
            Row("prefetch", "torchrec", status="failed", reason="x")]
    result = write_plots(tmp_path, rows)
    assert result == {"written": [STEP_TIME_PLOT, MEMORY_PLOT], "reason": ""}
    for name in result["written"]:
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC)
    result = write_plots(tmp_path / "cpu", [Row("base", "recpipe", step_ms={"p50": 1.0, "p90": 2.0})])
    assert result["written"] == [STEP_TIME_PLOT] and MEMORY_PLOT in result["reason"]


def test_kineto_marker_lines_are_dropped_and_nothing_else(capfd):
    from recpipe.bench.trace import kineto_markers_dropped

    with kineto_markers_dropped():
        os.write(2, b"USDT:2000-01-01 00:00:00 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a warning of someone else\n")
    assert capfd.readouterr().err == "a warning of someone else\n"


def test_floor_is_compute_plus_the_steps_collectives():
    """x floor: the row's device time outside NCCL plus its collectives timed alone; their sizes are the
    planner's bytes per rank (the busiest rank's) and calls per step."""
    from recpipe.bench.floor import _sizes, fill_floor, floor_md
    from recpipe.bench.report import Row

    cfg = load_config(None, ["distributed.nproc=4", "sharding.tables={t_cat_0: {type: row_wise}}"])
    sizes = _sizes(cfg, 4)
    assert set(sizes) == {"input_a2a", "output_a2a", "backward_a2a", "allreduce"}
    assert all(nbytes > 0 and calls > 0 for nbytes, calls in sizes.values()), sizes
    assert _sizes(cfg, 8)["output_a2a"][0] > sizes["output_a2a"][0]  # more peers, more of the pooled rows leave
    row = Row("sparse_dist", "recpipe", step_ms={"p50": 6.0}, trace={"compute_busy_ms": 2.0})
    comm = {"world": 4, "comm_ms": 1.0, "collectives_ms": {"input_a2a": 0.25, "allreduce": 0.75},
            "bytes_per_rank": {"input_a2a": 2**20, "allreduce": 2**21}, "calls": {"input_a2a": 3, "allreduce": 1}}
    fill_floor(row, comm)
    assert row.floor == {"compute_ms": 2.0, "comm_ms": 1.0, "floor_ms": 3.0, "x_floor": 2.0}
    assert "| input all-to-all | 1.00 | 3 | 0.250 |" in floor_md(comm)
    cpu = Row("base", "recpipe", step_ms={"p50": 6.0}, trace={})
    fill_floor(cpu, {"comm_ms": None, "reason": "n/a: NCCL collectives need CUDA"})
    assert cpu.floor == {"reason": "n/a: NCCL collectives need CUDA"}


def test_an_out_that_cannot_be_written_is_refused_before_any_run(tmp_path, capfd):
    """``--out`` on a pseudo filesystem, or under a file: one line naming it, exit 6, before a batch is made."""
    from recpipe.exit_codes import EXIT_CHECKPOINT

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for out in ("/proc/recpipe_bench", str(blocker / "bench")):
        assert main(["bench", "--config", SMOKE, "--out", out, "--steps", "1", "--warmup", "1"]) == EXIT_CHECKPOINT
        err = capfd.readouterr().err.strip().splitlines()
        assert err == [err[0]] and err[0].startswith(f"recpipe bench: cannot write --out {out}: "), err
