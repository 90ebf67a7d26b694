"""The example trainer script that subclasses a pipeline runs and its hooks fire."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_custom_pipeline_script_trains_with_its_hooks():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "custom_pipeline.py"), "--config", str(ROOT / "configs" / "quickstart.yaml"),
         "--set", "train.steps=12", "--set", "data.batch_size=64"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # 12 batches of 64 samples on rank 0, one optimizer step each, a clip per backward
    assert "trained 12 steps, 768 samples on rank 0" in out.stdout, out.stdout
    assert "dense grad norm before clipping" in out.stdout


def test_bench_summary_renders_the_published_numbers(tmp_path: Path):
    """scripts/bench_summary.py: the per-hardware report and the README headline come
    from the suites' bench.json, number for number."""
    import json

    suite = ROOT / "benchmarks" / "results" / "h100x1" / "opt_heavy.json"
    record = json.loads(suite.read_text())
    ours = next(r for r in record["rows"] if r["pipeline"] == "sparse_dist" and r["impl"] == "recpipe")
    theirs = next(r for r in record["rows"] if r["pipeline"] == "sparse_dist" and r["impl"] == "torchrec")
    script = str(ROOT / "scripts" / "bench_summary.py")
    head = subprocess.run([sys.executable, script, "headline", str(suite)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert head.returncode == 0, head.stderr[-2000:]
    ratio = ours["step_ms"]["p50"] / theirs["step_ms"]["p50"]
    line = next(x for x in head.stdout.splitlines() if "| sparse_dist |" in x)
    assert f"| {ours['step_ms']['p50']:.2f} | {theirs['step_ms']['p50']:.2f} | {ratio:.3f} |" in line
    out = tmp_path / "summary.md"
    rep = subprocess.run([sys.executable, script, "report", str(out), "--title", "t", str(suite)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert rep.returncode == 0, rep.stderr[-2000:]
    text = out.read_text()
    assert record["command"] in text and "### Targets" in text and "### Stages timed alone" in text
    assert f"**Stages alone: {record['bound']['bound_ms']:.3f} ms per step" in text


@pytest.mark.slow
def test_two_tower_script_subclasses_the_configured_pipeline():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "two_tower.py"), "--config", str(ROOT / "configs" / "two_tower.yaml"),
         "--set", "train.steps=8", "--set", "data.batch_size=32", "--set", "pipeline.name=fused_sparse_dist"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TwoTowerFusedSparseDistPipeline: trained 8 steps" in out.stdout, out.stdout
    assert "history_ec <- batch.history" in out.stdout


def test_memory_at_peak_replays_the_allocator_history_to_the_peak():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import memory_at_peak as m

    def frames(path: str, line: int) -> list[dict]:
        return [{"filename": "/usr/lib/python3/torch/nn/functional.py", "line": 1, "name": "linear"},
                {"filename": f"/site/{path}", "line": line, "name": "f"}]

    mib = 2**20
    trace = [
        {"action": "alloc", "addr": 1, "size": 4 * mib, "stream": 0, "frames": frames("recpipe/pipelines/steps.py", 10)},
        {"action": "alloc", "addr": 2, "size": 8 * mib, "stream": 7, "frames": frames("torchrec/distributed/dist_data.py", 5)},
        {"action": "free_requested", "addr": 1, "size": 4 * mib, "stream": 0, "frames": []},
        {"action": "alloc", "addr": 3, "size": 2 * mib, "stream": 0, "frames": frames("recpipe/pipelines/steps.py", 10)},
        {"action": "free_completed", "addr": 1, "size": 4 * mib, "stream": 0, "frames": []},
        {"action": "free_completed", "addr": 99, "size": mib, "stream": 0, "frames": []},  # allocated before recording
        {"action": "alloc", "addr": 4, "size": 1 * mib, "stream": 0, "frames": []},
    ]
    best, alive = m.peak_live(trace)
    assert best == 14 * mib and set(alive) == {1, 2, 3}  # freed only at free_completed
    summary = m.summarize(trace, {0: "compute", 7: "dist"})
    assert summary["by_site"] == [("torchrec/distributed/dist_data.py:5 f", 8 * mib),
                                  ("recpipe/pipelines/steps.py:10 f", 6 * mib)]
    assert summary["by_stream"] == [("dist", 8 * mib), ("compute", 6 * mib)]


def test_memory_at_peak_names_the_last_occupant_of_each_free_block():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import memory_at_peak as m

    comm = [{"filename": "/site/torchrec/distributed/comm_ops.py", "line": 422, "name": "allocate"}]
    mlp = [{"filename": "/site/torchrec/modules/mlp.py", "line": 80, "name": "forward"}]
    trace = [  # two occupants of [100, 160): the newer one counts
        {"action": "alloc", "addr": 100, "size": 60, "stream": 7, "frames": mlp},
        {"action": "free_completed", "addr": 100, "size": 60, "stream": 7, "frames": mlp},
        {"action": "alloc", "addr": 110, "size": 40, "stream": 7, "frames": comm},
        {"action": "free_completed", "addr": 110, "size": 40, "stream": 7, "frames": comm},
    ]
    segments = [
        {"stream": 7, "total_size": 200, "allocated_size": 120, "blocks": [
            {"address": 0, "size": 100, "state": "active_allocated"},
            {"address": 100, "size": 60, "state": "inactive"},
            {"address": 160, "size": 20, "state": "active_allocated"},
            {"address": 180, "size": 20, "state": "inactive"}]},
        {"stream": 9, "total_size": 50, "allocated_size": 50, "blocks": [
            {"address": 500, "size": 50, "state": "active_allocated"}]},
    ]
    got = m.reserved_summary(segments, trace, {7: "compute"})
    assert got["by_stream"] == {
        "compute": {"reserved": 200, "allocated": 120, "free": 80, "largest_free": 60, "segments": 1},
        "9": {"reserved": 50, "allocated": 50, "free": 0, "largest_free": 0, "segments": 1}}
    assert got["free_by_site"] == [("compute: torchrec/distributed/comm_ops.py:422 allocate", 60),
                                   ("compute: (before recording)", 20)]


def test_memory_at_peak_finds_the_free_holes_at_the_peak_allocated():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import memory_at_peak as m

    mib = 2**20
    grad = [{"filename": "/site/torchrec/distributed/comm_ops.py", "line": 1235, "name": "recat"}]
    mlp = [{"filename": "/site/torchrec/modules/mlp.py", "line": 80, "name": "forward"}]
    # One 100 MiB segment; A [0, 10) and B [50, 60) alive throughout (allocated before recording).
    segments = [{"device": 0, "address": 0, "total_size": 100 * mib, "stream": 7, "blocks": [
        {"address": 0, "size": 10 * mib, "state": "active_allocated"},
        {"address": 10 * mib, "size": 40 * mib, "state": "inactive"},
        {"address": 50 * mib, "size": 10 * mib, "state": "active_allocated"},
        {"address": 60 * mib, "size": 20 * mib, "state": "inactive"},
        {"address": 80 * mib, "size": 20 * mib, "state": "inactive"}]},
        # mapped only after the peak: not reserved at the peak
        {"device": 0, "address": 200 * mib, "total_size": 4 * mib, "stream": 9, "blocks": [
            {"address": 200 * mib, "size": 4 * mib, "state": "inactive"}]}]
    trace = [
        {"action": "alloc", "addr": 10 * mib, "size": 30 * mib, "stream": 7, "frames": mlp},
        {"action": "free_completed", "addr": 10 * mib, "size": 30 * mib, "stream": 7, "frames": mlp},
        {"action": "alloc", "addr": 10 * mib, "size": 20 * mib, "stream": 7, "frames": grad},
        {"action": "alloc", "addr": 60 * mib, "size": 25 * mib, "stream": 7, "frames": grad},  # the peak: 65 MiB
        {"action": "free_completed", "addr": 10 * mib, "size": 20 * mib, "stream": 7, "frames": grad},
        {"action": "free_completed", "addr": 60 * mib, "size": 25 * mib, "stream": 7, "frames": grad},
        {"action": "segment_map", "addr": 200 * mib, "size": 4 * mib, "stream": 9, "frames": []},
        {"action": "alloc", "addr": 85 * mib, "size": 15 * mib, "stream": 7, "frames": mlp},
        {"action": "free_completed", "addr": 85 * mib, "size": 15 * mib, "stream": 7, "frames": mlp},
    ]
    gap = m.gap_at_peak({"segments": segments, "device_traces": [trace]}, 0, {7: "compute"})
    assert gap["peak_allocated"] == 65 * mib and gap["event"] == 4
    assert gap["by_stream"] == {"compute": {"reserved": 100 * mib, "allocated": 65 * mib, "free": 35 * mib, "holes": 2}}
    assert gap["holes"] == [
        {"stream": "compute", "size": 20 * mib, "last_before": "30 MiB at torchrec/modules/mlp.py:80 forward",
         "next_after": "(not reused)"},
        {"stream": "compute", "size": 15 * mib, "last_before": "(before recording)",
         "next_after": "15 MiB at torchrec/modules/mlp.py:80 forward"}]


@pytest.mark.slow
def test_precision_auc_script_trains_both_precisions_and_reports_the_difference(tmp_path: Path):
    """scripts/precision_auc.py: two runs that differ only in the precisions (every table,
    the sharding.tables entries included), the same seed, and a report of both AUCs."""
    import json

    report = tmp_path / "report.md"
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "precision_auc.py"), "--config", str(ROOT / "configs" / "quickstart.yaml"),
         "--out", str(tmp_path / "runs"), "--report", str(report), "--steps", "6", "--eval-batches", "2",
         "--eval-every", "3", "--tolerance", "1.0", "--set", "data.batch_size=64"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads((tmp_path / "runs" / "precision_auc.json").read_text())
    (pair,) = record["pairs"]
    fp32, low = pair["runs"]
    for run, weights, comms in ((fp32, "fp32", "fp32"), (low, "fp16", "bf16")):
        sharding = run["config"]["sharding"]
        assert {t["weights_precision"] for t in [sharding["default"], *sharding["tables"].values()]} == {weights}
        assert sharding["comm_precision"] == {"forward": comms, "backward": comms}
        assert run["config"]["train"]["seed"] == 0 and [e["step"] for e in run["evals"]] == [3, 6]
    assert pair["difference"] == low["summary"]["eval_auc"] - fp32["summary"]["eval_auc"]
    assert record["eval_set"]["samples"] == 2 * 2 * 64 and 0 < record["eval_set"]["auc_se"] < 1
    text = report.read_text()
    assert f"difference (fp16_bf16 - fp32) {pair['difference']:+.5f}" in text and "runs as fp16 on CPU" in text


@pytest.mark.slow
def test_trainer_vs_bench_interleaves_pairs_and_profiles_the_host(tmp_path: Path):
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "tvb"
    small = ["distributed.nproc=1", "train.device=cpu", "distributed.backend=gloo", "data.batch_size=128",
             "data.synthetic.num_eval_batches=1"]
    cmd = [sys.executable, str(root / "scripts" / "trainer_vs_bench.py"), "--config", str(root / "configs" / "quickstart.yaml"),
           "--pipeline", "sparse_dist", "--steps", "20", "--steady-from", "5", "--bench-steps", "5", "--bench-warmup", "2",
           "--pairs", "2", "--profile-steps", "3", "--out", str(out)]
    for pair in small:
        cmd += ["--set", pair]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((out / "trainer_vs_bench.json").read_text())
    ratios = [pair["ratio"] for pair in result["pairs"]]
    assert len(ratios) == 2 and result["ratio"] == pytest.approx(sum(ratios) / 2)
    for k in range(2):
        pair = result["pairs"][k]
        assert pair["train"]["window_steps"] == [5, 20]  # the profiled steps come after the window
        assert pair["ratio"] == pytest.approx(pair["train"]["samples_per_s_wall"] / pair["bench"]["samples_per_s_wall"])
        assert "Self CPU" in (out / f"pair{k}" / "host_profile.txt").read_text()
        parts = pair["train"]["host_parts"]  # steps 6-20 (step 5 has no "outside" before it inside the window)
        assert set(parts) == {"progress", "next", "outside"}
        assert 0 <= parts["next"]["total"] <= parts["progress"]["total"]
        assert all(p["p50"] <= p["p90"] <= p["max"] <= p["total"] for p in parts.values())
        assert pair["train"]["intra_op_threads"] >= 1  # recorded: the GPU trainer's rule sets it (train/trainer.py)
    assert "trainer host time per step" in done.stdout
    assert "median ratio of 2 interleaved pairs" in done.stdout
