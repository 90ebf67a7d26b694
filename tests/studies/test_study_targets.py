"""benchmarks/studies/targets.py: every target a record's rows speak to, with its measured
value, limit and verdict, from rows (and the bound study's section) or a bench.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.studies.targets import check_targets, main, targets_md, x_bound_of
from recpipe.bench.report import Row


def _row(pipeline: str, impl: str, steps: list[float], alloc: float = 10.0, reserved: float = 10.2,
         step_alloc: float = 0.4) -> Row:
    from recpipe.bench.measure import summarize_ms

    s = summarize_ms(steps)
    return Row(pipeline=pipeline, impl=impl, steps=len(steps), step_ms=s, step_ms_per_step=list(steps),
               step_ms_p50_per_rank=[s["p50"], s["p50"] - 0.1], round_p50_ms=[s["p50"]], host_ms_per_step=list(steps),
               host_ms=s, samples_per_s=1000 / (s["p50"] / 1e3), wall_s=sum(steps) / 1e3, build_s=0.1,
               memory={"peak_alloc_gib": alloc, "peak_reserved_gib": reserved, "reserved_over_alloc": reserved / alloc,
                       "step_peak_alloc_above_build_gib": step_alloc, "per_rank": [{"peak_alloc_gib": alloc}]})


def test_check_targets_reports_measured_values_and_misses():
    rows = [
        _row("base", "recpipe", [10.0]), _row("base", "torchrec", [10.5]),
        _row("sparse_dist", "recpipe", [10.1], step_alloc=0.40), _row("sparse_dist", "torchrec", [9.8]),
        _row("semi_sync", "recpipe", [9.5], alloc=10.3, reserved=11.0, step_alloc=0.60),
    ]
    rows[4].x_busy = 1.20  # semi_sync, recpipe's fastest (9.5 ms)
    bound = {"bound_resource": "compute", "x_bound": [{"pipeline": "sparse_dist", "impl": "recpipe", "x_bound": 1.10}]}
    checks = check_targets(rows, bound)
    by = {(c["target"], c["pipeline"]): c for c in checks}
    assert by[("vs_torchrec", "base")]["met"] and by[("vs_torchrec", "base")]["value"] == pytest.approx(10 / 10.5)
    assert by[("vs_torchrec", "sparse_dist")]["met"] is False
    assert by[("vs_base", "sparse_dist")]["value"] == pytest.approx(1.01) and by[("vs_base", "sparse_dist")]["met"]
    assert by[("vs_base", "semi_sync")]["met"]
    assert by[("x_bound", "sparse_dist")]["met"] and ("x_bound", "base") not in by
    assert by[("reserved_over_alloc", "semi_sync")]["met"] is False  # 11.0 / 10.3
    assert by[("semi_sync_extra_peak", "semi_sync")]["value"] == pytest.approx(0.03)
    assert by[("semi_sync_extra_peak", "semi_sync (step only)")]["value"] == pytest.approx(0.5)
    fastest = by[("fastest_vs_torchrec", "semi_sync vs TorchRec sparse_dist")]
    assert fastest["value"] == pytest.approx(9.5 / 9.8) and fastest["met"] is False  # 1.5 x needs <= 0.667
    assert by[("x_gpu_busy", "semi_sync")]["value"] == 1.20 and by[("x_gpu_busy", "semi_sync")]["met"]
    md = "\n".join(targets_md(checks, rounds=1))
    assert "| P50 at or below TorchRec's | sparse_dist | 1.031 | 1.00 | **no** |" in md
    assert "+50.0%" in md and "checks met." in md


def test_targets_of_a_published_record(capsys):
    """An older bench.json (its rows carry x_bound, its targets stored): the same checks recomputed."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h100x1" / "opt_heavy.json"
    record = json.loads(path.read_text())
    rows = [Row.from_dict(r) for r in record["rows"]]
    checks = check_targets(rows, x_bound_of(record))
    again = {(c["target"], c["pipeline"]): c["value"] for c in checks}
    assert len(record["targets"]) == 16 and {(c["target"], c["pipeline"]) for c in record["targets"]} <= set(again)
    for c in record["targets"]:  # every stored check, x_bound (from the rows) included, recomputed the same
        assert again[(c["target"], c["pipeline"])] == pytest.approx(c["value"]), c
    assert main([str(path)]) == 0 and "## Targets" in capsys.readouterr().out
