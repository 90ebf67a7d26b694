"""``recpipe bench``: the CPU smoke run end to end (2 Gloo ranks), plus the pieces
that need no process group (which config each pipeline runs, statistics, table)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recpipe.bench.measure import percentile, summarize_ms
from recpipe.bench.report import Row, format_table
from recpipe.bench.runner import DRAIN, config_for_pipeline
from recpipe.cli import EXIT_BAD_CONFIG, main
from recpipe.config import load_config
from recpipe.pipelines import PIPELINES

CONFIGS = Path(__file__).parent.parent / "configs" / "bench"
SMOKE = str(CONFIGS / "smoke_cpu.yaml")

# What runs on CPU (torchrec 1.8.0, fbgemm-gpu-cpu 1.8.0): every recpipe pipeline but
# prefetch (no UVM cache on CPU: skipped); TorchRec's Base and SparseDist. TorchRec's
# FusedSparseDist and SemiSync raise on CPU ("unknown parameter type"); the bench
# records them as failed and goes on.
CPU_OK = {("base", "recpipe"), ("sparse_dist", "recpipe"), ("fused_sparse_dist", "recpipe"),
          ("semi_sync", "recpipe"), ("base", "torchrec"), ("sparse_dist", "torchrec")}


@pytest.mark.slow
def test_smoke_cpu_bench_writes_json_and_markdown(tmp_path: Path):
    out = tmp_path / "bench"
    code = main(["bench", "--config", SMOKE, "--steps", "3", "--warmup", "1", "--with-torchrec", "--out", str(out)])
    assert code == 0
    record = json.loads((out / "bench.json").read_text())

    # header first: resolved config, versions, hardware, world size, date
    assert list(record)[:4] == ["config", "date", "versions", "gpu"]
    assert record["config"] == load_config(SMOKE).model_dump(mode="json")
    assert {"torch", "fbgemm_gpu", "torchrec", "cuda"} <= set(record["versions"])
    assert record["versions"]["torch"] and record["versions"]["fbgemm_gpu"] != "unknown"
    assert record["gpu"]["name"] and record["world_size"] == 2
    bench = record["bench"]
    assert (bench["steps"], bench["warmup"], bench["batches_per_rank"]) == (3, 1, 3 + 1 + DRAIN)
    assert bench["global_batch"] == 2 * load_config(SMOKE).data.batch_size

    rows = {(r["pipeline"], r["impl"]): r for r in record["rows"]}
    assert set(rows) == {(n, i) for n in PIPELINES for i in ("recpipe", "torchrec")}
    for key in CPU_OK:
        r = rows[key]
        assert r["status"] == "ok", (key, r["reason"])
        assert len(r["step_ms_per_step"]) == 3 and len(r["step_ms_p50_per_rank"]) == 2
        assert 0 < r["step_ms"]["p50"] <= r["step_ms"]["p90"] <= r["step_ms"]["max"]
        assert r["samples_per_s"] > 0 and r["samples_per_s_wall"] > 0
        assert r["memory"] == {}  # CPU: no allocator numbers
    for impl in ("recpipe", "torchrec"):
        assert rows["prefetch", impl]["status"] == "skipped"
        assert "fused_uvm_caching" in rows["prefetch", impl]["reason"]
    for name in ("fused_sparse_dist", "semi_sync"):  # TorchRec's on CPU: recorded, not fatal
        assert rows[name, "torchrec"]["status"] in ("ok", "failed")
    # TorchRec's FX trace of RecModel(Batch) found the sharded EBC
    assert rows["sparse_dist", "torchrec"]["torchrec_pipelined_modules"] == 1
    assert rows["semi_sync", "torchrec"]["options"]["start_batch"] == 0
    assert rows["fused_sparse_dist", "torchrec"]["options"]["emb_lookup_stream"] == "data_dist"

    md = (out / "bench.md").read_text()
    for needle in ("torch ", "fbgemm-gpu ", "torchrec ", "CUDA ", "GPU:", "world size 2", "## Resolved config"):
        assert needle in md
    table = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| pipeline")]
    assert len(table) == len(rows)


def test_bad_bench_arguments_exit_2(capsys):
    assert main(["bench", "--config", SMOKE, "--pipelines", "base,nope"]) == EXIT_BAD_CONFIG
    assert "nope" in capsys.readouterr().err
    assert main(["bench", "--config", SMOKE, "--steps", "0"]) == EXIT_BAD_CONFIG
    assert main(["bench", "--config", SMOKE, "--steps", "1000"]) == EXIT_BAD_CONFIG  # more than the data has
    assert "data.synthetic.num_batches" in capsys.readouterr().err


def test_prefetch_runs_only_with_a_locked_cache_and_others_drop_the_lock():
    cfg = load_config(CONFIGS / "uvm_caching.yaml")
    cfg_p, overrides, skip = config_for_pipeline(cfg, "prefetch")
    assert not skip and overrides == {} and cfg_p.sharding.prefetch_pipeline
    # semi_sync looks up batch i+1 before backward(i): refused on unlocked UVM caches.
    _, _, skip = config_for_pipeline(cfg, "semi_sync")
    assert "semi_sync" in skip and "evict" in skip, skip
    for name in ("base", "sparse_dist", "fused_sparse_dist"):
        cfg_p, overrides, skip = config_for_pipeline(cfg, name)
        assert not skip and cfg_p.pipeline.name == name
        assert not cfg_p.sharding.prefetch_pipeline
        assert overrides == {"pipeline.name": name, "sharding.prefetch_pipeline": False}
        assert cfg_p.sharding.uvm_host_mapped and cfg_p.model == cfg.model
    _, _, skip = config_for_pipeline(load_config(CONFIGS / "dlrm_criteo.yaml"), "prefetch")
    assert "fused_uvm_caching" in skip


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
