"""benchmarks/studies/eval_speed.py on CPU: a tiny model on one Gloo rank evaluated both ways by
every pipeline asked for, interleaved rounds, equal metrics, and the record and report that the
published ones (benchmarks/results/h100x1/eval_speed.md) come from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.studies.eval_speed import main


def test_eval_speed_times_both_ways_on_cpu(tmp_path: Path):
    out = tmp_path / "eval"
    argv = ["--device", "cpu", "--eval-batches", "4", "--warmup-batches", "1", "--rounds", "2",
            "--pipelines", "sparse_dist,base", "--out", str(out)]
    assert main(argv) == 0
    record = json.loads((out / "eval_speed.json").read_text())
    assert record["command"] == "python benchmarks/studies/eval_speed.py " + " ".join(argv)
    assert record["eval_batches_per_rank"] == 4 and record["batch_size"] == 256
    assert record["schedules"] == {"sparse_dist": {"plain": "plain_eval", "pipelined": "sparse_dist_eval"},
                                   "base": {"plain": "plain_eval", "pipelined": "base_eval"}}
    timed = [(p["pipeline"], p["way"], p["round"]) for p in record["passes"]]
    assert sorted(timed) == sorted((n, w, r) for n in ("sparse_dist", "base") for w in ("plain", "pipelined")
                                   for r in (0, 1))
    for p in record["passes"]:
        assert p["samples"] == 4 * 256 and p["samples_per_s"] == pytest.approx(p["samples"] / p["seconds"])
    for name, s in record["summary"].items():
        assert s["metrics_equal"] and set(s["metrics"]) >= {"auc"}, name
        assert len(s["ratio_by_round"]) == 2
        assert s["ratio_p50"] == pytest.approx(s["samples_per_s_p50"]["pipelined"] / s["samples_per_s_p50"]["plain"])
    md = (out / "eval_speed.md").read_text().splitlines()
    assert md[0] == "# Evaluation speed: plain loop against the pipeline's eval schedule"
    assert record["command"] in md[3]
    assert any(line.startswith("| sparse_dist | sparse_dist_eval | ") and line.endswith(" | yes |") for line in md)


def test_eval_speed_times_a_step_graph_against_its_training(tmp_path: Path, monkeypatch):
    """With pipeline.step_graph (a stand-in capture on CPU, tests/test_step_graph.py's) each
    pipeline trains first; its training rate is recorded and each way's eval rate set against it;
    the timed pipelined passes replay the eval graph."""
    from recpipe.speedups import step_graph

    monkeypatch.setattr(step_graph, "apply", lambda ctx, options: step_graph.apply_step_graph(ctx, options,
                                                                                          capture=lambda step: step))
    out = tmp_path / "eval"
    argv = ["--device", "cpu", "--eval-batches", "4", "--warmup-batches", "3", "--rounds", "1", "--train-steps", "4",
            "--pipelines", "sparse_dist", "--set", "pipeline.step_graph=true", "--out", str(out)]
    assert main(argv) == 0
    record = json.loads((out / "eval_speed.json").read_text())
    trained = record["training"]["sparse_dist"]
    assert trained["step_graph"]["replays"] > 0 and trained["samples_per_s"] > 0 and trained["step_ms"] > 0
    # the warm-up pass: a warm-up batch and the capture; the timed pass replays every batch
    assert trained["eval_graph"]["replays"] - trained["eval_graph_before_timing"]["replays"] == 4, trained
    s = record["summary"]["sparse_dist"]
    assert s["metrics_equal"]
    assert s["eval_over_train"]["pipelined"] == pytest.approx(s["samples_per_s_p50"]["pipelined"]
                                                              / trained["samples_per_s"])
    md = (out / "eval_speed.md").read_text()
    assert "| sparse_dist | " in md and "4 replays, 0 eager |" in md
