"""The example scripts: a trainer script's pipeline class trained by recpipe's trainer, its
hooks firing in every rank; the two-tower model with its own; the precision AUC comparison
(the studies' scripts: tests/studies/)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_custom_pipeline_script_trains_its_class_with_recpipes_trainer(tmp_path):
    """The script defines a pipeline class and hands it to recpipe.train.train: recpipe's
    trainer (2 ranks, evaluation, summary) runs it, the ranks importing the class by the
    script's module name."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "custom_pipeline.py"), "--config", str(ROOT / "configs" / "quickstart.yaml"),
         "--set", "train.steps=12", "--set", "data.batch_size=64", "--set", f"logging.run_dir={tmp_path}"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # a report after 10 steps: sparse_dist has fetched 2 batches of 64 samples ahead by then
    assert "ClippedSparseDist: 10 steps, 768 samples fetched on rank 0" in out.stdout, out.stdout
    assert "dense grad norm before clipping" in out.stdout
    assert "final eval AUC" in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["world_size"] == 2
    assert "class: scripts.custom_pipeline:ClippedSparseDist" in (tmp_path / "config.yaml").read_text()


@pytest.mark.slow
def test_two_tower_script_trains_its_pipeline_class_and_refuses_another_pipeline(tmp_path):
    run = [sys.executable, str(ROOT / "scripts" / "two_tower.py"), "--config", str(ROOT / "configs" / "two_tower.yaml"),
           "--set", "train.steps=20", "--set", "data.batch_size=32", "--set", "train.eval_every=0",
           "--set", f"logging.run_dir={tmp_path}"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TwoTowerPipeline: 20 steps" in out.stdout and "positive labels on rank 0" in out.stdout, out.stdout
    assert "history_ec <- batch.history" in out.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["eval_auc"] is not None
    # TwoTowerPipeline extends sparse_dist: another pipeline is refused before any process starts
    refused = subprocess.run([*run, "--set", "pipeline.name=fused_sparse_dist"], capture_output=True, text=True,
                             timeout=300, cwd=ROOT)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "not a subclass of FusedSparseDistPipeline" in refused.stderr and "pipeline.class" in refused.stderr


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
