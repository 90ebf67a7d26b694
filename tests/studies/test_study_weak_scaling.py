"""benchmarks/studies/weak_scaling.py: a run's samples/s per GPU against an earlier run's
(efficiency) and the planner's model, from two bench.json records; bad records exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.studies.weak_scaling import main
from recpipe.bench.report import Row, write_outputs
from recpipe.config import load_config

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "bench" / "smoke_cpu.yaml"


def _record(out: Path, world: int, per_gpu: dict[str, float]) -> Path:
    cfg = load_config(SMOKE)
    rows = [Row(name, "recpipe", step_ms={"p50": 1.0}, samples_per_s=v * world, samples_per_s_per_gpu=v)
            for name, v in per_gpu.items()] + [Row("prefetch", "recpipe", status="skipped", reason="no cache")]
    header = {"date": "d", "versions": {k: "x" for k in ("torch", "fbgemm_gpu", "torchrec", "cuda", "nccl")},
              "gpu": {"name": "cpu", "count_visible": 0}, "world_size": world, "command": "c",
              "bench": {"steps": 3, "warmup": 1, "drain": 3, "global_batch": 64, "timing": "t",
                        "batches_per_rank": 10, "batch_generation_s": 1.0, "batch_generation_ms_per_batch": 1.0,
                        "pinned": False}}
    return write_outputs(out, cfg, header, rows)


def test_efficiency_against_a_baseline_and_the_planners_prediction(tmp_path: Path, capsys):
    base = _record(tmp_path / "w1", 1, {"base": 1000.0, "sparse_dist": 1200.0})
    run = _record(tmp_path / "w2", 2, {"base": 900.0, "sparse_dist": 1260.0, "semi_sync": 800.0})
    assert main([str(run), "--baseline", str(base), "--out", str(tmp_path / "ws")]) == 0
    ws = json.loads((tmp_path / "ws" / "weak_scaling.json").read_text())
    assert ws["baseline_world_size"] == 1 and ws["baseline"] == str(base) and ws["world_size"] == 2
    by = {r["pipeline"]: r for r in ws["rows"]}
    assert set(by) == {"base", "sparse_dist", "semi_sync"}  # measured rows only
    assert by["base"]["efficiency"] == pytest.approx(0.9) and by["sparse_dist"]["efficiency"] == pytest.approx(1.05)
    assert "efficiency" not in by["semi_sync"]  # not in the baseline
    pred = ws["prediction"]
    assert "samples_per_s_per_gpu" in pred or pred["reason"].startswith("n/a")
    if "samples_per_s_per_gpu" in pred:
        assert by["base"]["measured_over_predicted"] == pytest.approx(900.0 / pred["samples_per_s_per_gpu"])
    md = (tmp_path / "ws" / "weak_scaling.md").read_text()
    assert "| efficiency |" in md and "baseline samples/s/GPU" in md and "| base | recpipe | 2 | 900 |" in md
    assert md.strip() in capsys.readouterr().out
    assert main([str(run)]) == 0 and "No `--baseline` given" in capsys.readouterr().out


def test_a_bad_record_exits_2(tmp_path: Path, capsys):
    run = _record(tmp_path / "w2", 2, {"base": 900.0})
    assert main([str(run), "--baseline", str(tmp_path / "none.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "x.json").write_text("{}")
    assert main([str(run), "--baseline", str(tmp_path / "x.json")]) == 2
    assert "bench.json" in capsys.readouterr().err
