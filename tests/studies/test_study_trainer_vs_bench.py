"""benchmarks/studies/trainer_vs_bench.py on CPU: the bench and the trainer interleaved in pairs,
the trainer's host time per step by part, its host profile after the steady window."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUDIES = ROOT / "benchmarks" / "studies"


@pytest.mark.slow
def test_trainer_vs_bench_interleaves_pairs_and_profiles_the_host(tmp_path: Path):
    root = ROOT
    out = tmp_path / "tvb"
    small = ["distributed.nproc=1", "train.device=cpu", "distributed.backend=gloo", "data.batch_size=128",
             "data.synthetic.num_eval_batches=1", "train.log_every=5"]
    cmd = [sys.executable, str(STUDIES / "trainer_vs_bench.py"), "--config", str(root / "configs" / "quickstart.yaml"),
           "--pipeline", "sparse_dist", "--steps", "20", "--steady-from", "5", "--bench-steps", "5", "--bench-warmup", "2",
           "--pairs", "2", "--profile-steps", "3", "--profile-eval", "--cli", "--out", str(out)]
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
        assert "Self CPU" in (out / f"pair{k}" / "eval_host_profile.txt").read_text()
        assert pair["train"]["eval"]["samples_per_s"] > 0 and pair["train"]["eval"]["loader_wait_s"] >= 0
        parts = pair["train"]["host_parts"]  # steps 6-20 (step 5 has no "outside" before it inside the window)
        assert set(parts) == {"progress", "next", "outside"}
        assert 0 <= parts["next"]["total"] <= parts["progress"]["total"]
        assert all(p["p50"] <= p["p90"] <= p["max"] <= p["total"] for p in parts.values())
        assert pair["train"]["intra_op_threads"] >= 1  # recorded: the GPU trainer's rule sets it (train/trainer.py)
    assert "trainer host time per step" in done.stdout and "trainer's final evaluation:" in done.stdout
    assert "median ratio of 2 interleaved pairs" in done.stdout
    # --cli: recpipe train as a user runs it, beside each pair, and the markdown report
    for pair in result["pairs"]:
        cli = pair["cli"]
        assert cli["steps"] == 20 and cli["samples_per_s"] > 0 and cli["eval_samples_per_s"] > 0
        assert pair["cli_ratio"] == pytest.approx(cli["samples_per_s"] / pair["bench"]["samples_per_s_wall"])
        assert cli["startup_s"] > 0 and cli["num_workers"] == 0  # quickstart's
        assert any(line.startswith("start-up:") for line in cli["said"])
    report = (out / "trainer_vs_bench.md").read_text()
    assert report.count("\n| ") == 3 and "trainer_vs_bench.py" in report and result["versions"] in report
