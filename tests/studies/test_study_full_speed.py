"""benchmarks/studies/full_speed.py on CPU: the reference and a variant fed by a producer process
train alike (exit 0, every row `equal`), and a variant that trains differently is reported."""

from __future__ import annotations

from pathlib import Path

from benchmarks.studies.full_speed import main

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")
SMALL = ["--set", "distributed.nproc=1", "--set", "train.steps=20", "--set", "train.log_every=10",
         "--set", "data.synthetic.num_eval_batches=1", "--set", f"model.num_embeddings_per_feature={[100] * 26}"]


def test_the_study_reports_equal_and_different_runs(tmp_path):
    assert main(["--config", CONFIG, *SMALL, "--variant", "data.num_workers=1", "--out", str(tmp_path / "a")]) == 0
    report = (tmp_path / "a" / "full_speed.md").read_text()
    assert "| data.num_workers=0 (lockstep) |" in report and "| data.num_workers=1 | " in report
    assert report.count("| equal |") == 1
    # another learning rate is another run: it must be reported as such, and fail the study
    assert main(["--config", CONFIG, *SMALL, "--variant", "optimizer.dense.lr=0.5", "--out", str(tmp_path / "b")]) == 1
    assert "differs: losses of" in (tmp_path / "b" / "full_speed.md").read_text()
