"""benchmarks/studies/bound.py: every stage alone on CPU beside the bench's rows (2 Gloo
ranks, end to end), its markdown, the prefetch-memory summary, the stream's reserved bytes and the stage clock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.studies.bound import (STAGES, bound_md, hbm_peak, main, prefetch_memory, stream_reserved_bytes,
                                      time_stage)

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "configs" / "bench" / "smoke_cpu.yaml")
MiB = 1 << 20
# Stages that a CPU run measures: all but the UVM-cache prefetch.
CPU_STAGES = set(STAGES) - {"prefetch"}


@pytest.mark.slow
def test_bound_beside_the_bench_rows_on_cpu(tmp_path: Path):
    out = tmp_path / "bound"
    assert main(["--config", SMOKE, "--steps", "3", "--warmup", "1", "--pipelines", "base,sparse_dist", "--no-plots",
                 "--out", str(out)]) == 0
    record = json.loads((out / "bench.json").read_text())
    assert record["command"].startswith("python benchmarks/studies/bound.py --config")
    bound = record["bound"]
    _check_bound(bound)
    rows = {(r["pipeline"], r["impl"]): r for r in record["rows"]}
    assert set(rows) == {("base", "recpipe"), ("sparse_dist", "recpipe")}
    assert {(x["pipeline"], x["impl"]) for x in bound["x_bound"]} == set(rows)
    for x in bound["x_bound"]:
        assert x["x_bound"] == pytest.approx(rows[x["pipeline"], x["impl"]]["step_ms"]["p50"] / bound["bound_ms"])
    md = (out / "bench.md").read_text()
    for needle in ("## Stages timed alone", "**Stages alone: ", "x stages alone (P50 / stages alone)",
                   "## Paired comparisons"):
        assert needle in md


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


def test_hbm_peak_by_gpu_name():
    assert hbm_peak("NVIDIA H100 80GB HBM3") == ("H100 SXM", 3.35e12)
    assert hbm_peak("NVIDIA H200") == ("H200", 4.8e12)
    assert hbm_peak("NVIDIA H100 PCIe") is None and hbm_peak("cpu") is None


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


def test_time_stage_is_one_interval_of_the_step_clock():
    import time

    import torch

    ms, out = time_stage(torch.device("cpu"), lambda: time.sleep(0.02) or 7)
    assert out == 7 and 19.0 <= ms < 1000
