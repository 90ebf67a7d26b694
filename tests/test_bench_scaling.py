"""recpipe.bench.scaling on CPU: two `recpipe bench` runs of the smoke config, on 1 and
2 Gloo ranks with the same per-rank batch, become one weak-scaling report (rows, the rate of
each row as a share of its one-rank rate, the fastest of each implementation, the plot)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recpipe.bench.scaling import main
from recpipe.cli import main as recpipe

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "configs" / "bench" / "smoke_cpu.yaml")


@pytest.mark.slow
def test_scaling_report_from_bench_runs_at_two_rank_counts(tmp_path: Path):
    for n in (1, 2):
        assert recpipe(["bench", "--config", SMOKE, "--set", f"distributed.nproc={n}", "--pipelines", "base,sparse_dist",
                        "--steps", "3", "--warmup", "1", "--trace-steps", "0", "--no-plots",
                        "--out", str(tmp_path / f"run{n}")]) == 0
    assert main([str(tmp_path / "run2"), str(tmp_path / "run1"), "--out", str(tmp_path / "scaling")]) == 0
    record = json.loads((tmp_path / "scaling" / "scaling.json").read_text())
    rows = {(r["pipeline"], r["gpus"]): r for r in record["rows"]}
    assert set(rows) == {("base", 1), ("base", 2), ("sparse_dist", 1), ("sparse_dist", 2)}
    for (name, gpus), r in rows.items():
        assert r["efficiency"] == pytest.approx(r["samples_per_s_per_gpu"] / rows[name, 1]["samples_per_s_per_gpu"])
    assert rows["base", 1]["efficiency"] == 1.0
    md = (tmp_path / "scaling" / "scaling.md").read_text()
    assert "| 2 | " in md and "Fastest of each implementation" in md
    assert record["plots"]["written"] == ["scaling.png"] or record["plots"]["reason"]


def test_runs_of_other_per_gpu_batches_are_refused(tmp_path: Path, capsys):
    for n, batch in ((1, 64), (2, 128)):
        (tmp_path / f"r{n}").mkdir()
        (tmp_path / f"r{n}" / "bench.json").write_text(json.dumps(
            {"world_size": n, "config": {"data": {"batch_size": batch}, "train": {"precision": "fp32"}}, "rows": []}))
    assert main([str(tmp_path / "r1"), str(tmp_path / "r2"), "--out", str(tmp_path / "out")]) == 2
    assert "different per-GPU batches [64, 128]" in capsys.readouterr().err
