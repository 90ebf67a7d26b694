"""``recpipe bench --rounds``: interleaved run order, merged rows, paired ratios,
the sign test and the target checks (recpipe.bench.compare), and one CPU run with
two rounds end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recpipe.bench.compare import check_targets, merge_rounds, paired, round_order, sign_test_p, targets_md
from recpipe.bench.report import Row
from recpipe.cli import main
from recpipe.exit_codes import EXIT_BAD_CONFIG

SMOKE = str(Path(__file__).parent.parent / "configs" / "bench" / "smoke_cpu.yaml")
RUNS = [("base", "recpipe"), ("base", "torchrec"), ("sparse_dist", "recpipe"), ("sparse_dist", "torchrec"),
        ("semi_sync", "recpipe")]


def test_round_order_rotates_pipelines_and_alternates_implementations():
    assert round_order(RUNS, 0) == RUNS
    assert round_order(RUNS, 1) == [("sparse_dist", "torchrec"), ("sparse_dist", "recpipe"), ("semi_sync", "recpipe"),
                                    ("base", "torchrec"), ("base", "recpipe")]
    assert round_order(RUNS, 2) == [("semi_sync", "recpipe"), ("base", "recpipe"), ("base", "torchrec"),
                                    ("sparse_dist", "recpipe"), ("sparse_dist", "torchrec")]
    for r in range(7):  # every run exactly once per round
        assert sorted(round_order(RUNS, r)) == sorted(RUNS)


def _row(pipeline: str, impl: str, steps: list[float], alloc: float = 10.0, reserved: float = 10.2,
         step_alloc: float = 0.4) -> Row:
    from recpipe.bench.measure import summarize_ms

    s = summarize_ms(steps)
    return Row(pipeline=pipeline, impl=impl, steps=len(steps), step_ms=s, step_ms_per_step=list(steps),
               step_ms_p50_per_rank=[s["p50"], s["p50"] - 0.1], round_p50_ms=[s["p50"]], host_ms_per_step=list(steps),
               host_ms=s, samples_per_s=1000 / (s["p50"] / 1e3), wall_s=sum(steps) / 1e3, build_s=0.1,
               memory={"peak_alloc_gib": alloc, "peak_reserved_gib": reserved, "reserved_over_alloc": reserved / alloc,
                       "step_peak_alloc_above_build_gib": step_alloc, "per_rank": [{"peak_alloc_gib": alloc}]})


def test_merge_rounds_pools_steps_and_keeps_each_round():
    a = _row("base", "recpipe", [1.0, 2.0, 3.0], alloc=10.0, reserved=10.4)
    b = _row("base", "recpipe", [4.0, 5.0, 6.0], alloc=10.1, reserved=10.2)
    m = merge_rounds([a, b], global_batch=1000)
    assert m.steps == 6 and m.step_ms_per_step == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert m.round_p50_ms == [2.0, 5.0]
    assert m.step_ms["p50"] == pytest.approx(3.5) and m.step_ms["max"] == 6.0
    assert m.samples_per_s == pytest.approx(1000 / 3.5e-3)
    assert m.memory["peak_alloc_gib"] == 10.1 and m.memory["peak_reserved_gib"] == 10.4
    assert m.memory["reserved_over_alloc"] == pytest.approx(1.04)  # the worst round's ratio
    assert m.step_ms_p50_per_rank == [pytest.approx(3.5), pytest.approx(3.4)]
    assert m.wall_s == pytest.approx(0.021)
    bad = Row(pipeline="base", impl="recpipe", status="failed", reason="boom")
    assert merge_rounds([a, bad], 1000).status == "failed"


def test_sign_test_and_paired_ratios():
    assert sign_test_p(5, 5) == pytest.approx(2 / 32)
    assert sign_test_p(0, 6) == pytest.approx(2 / 64)
    assert sign_test_p(3, 6) == 1.0
    assert sign_test_p(1, 1) is None
    a = merge_rounds([_row("x", "recpipe", [9.0]), _row("x", "recpipe", [10.0]), _row("x", "recpipe", [12.0])], 1)
    b = merge_rounds([_row("x", "torchrec", [10.0]), _row("x", "torchrec", [10.0]), _row("x", "torchrec", [10.0])], 1)
    pair = paired(a, b)
    assert pair["round_ratios"] == pytest.approx([0.9, 1.0, 1.2])
    assert pair["median_ratio"] == pytest.approx(1.0) and pair["a_faster_rounds"] == 1
    assert pair["pooled_ratio"] == pytest.approx(1.0)
    assert pair["sign_test_p"] == 1.0


def test_check_targets_reports_measured_values_and_misses():
    rows = [
        _row("base", "recpipe", [10.0]), _row("base", "torchrec", [10.5]),
        _row("sparse_dist", "recpipe", [10.1], step_alloc=0.40), _row("sparse_dist", "torchrec", [9.8]),
        _row("semi_sync", "recpipe", [9.5], alloc=10.3, reserved=11.0, step_alloc=0.60),
    ]
    rows[2].x_bound = 1.10
    rows[4].x_busy = 1.20  # semi_sync, recpipe's fastest (9.5 ms)
    checks = check_targets(rows, {"bound_resource": "compute"})
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


@pytest.mark.slow
def test_two_rounds_end_to_end_on_cpu(tmp_path: Path):
    out = tmp_path / "rounds"
    code = main(["bench", "--config", SMOKE, "--steps", "3", "--warmup", "1", "--rounds", "2",
                 "--pipelines", "base,sparse_dist", "--with-torchrec", "--no-plots", "--out", str(out)])
    assert code == 0
    record = json.loads((out / "bench.json").read_text())
    assert record["bench"]["rounds"] == 2 and "--rounds 2" in record["command"]
    for row in record["rows"]:
        assert row["status"] == "ok", row
        assert row["steps"] == 6 and len(row["step_ms_per_step"]) == 6 and len(row["round_p50_ms"]) == 2
        trace = row["trace"]  # the profiled steps of both rounds, averaged; CPU: no busy time in either
        assert trace["status"] == "ok" and trace["rounds"] == 2 and trace["gpu_busy_ms_per_round"] == [None, None]
        assert trace["host_ms_p50"] > 0 and all(v is not None for v in trace["phases_ms"].values())
    targets = {(c["target"], c["pipeline"]) for c in record["targets"]}
    assert {("vs_torchrec", "base"), ("vs_torchrec", "sparse_dist"), ("vs_base", "sparse_dist")} <= targets
    pair = next(c["paired"] for c in record["targets"] if c["target"] == "vs_torchrec")
    assert pair["rounds"] == 2 and len(pair["round_ratios"]) == 2
    assert "## Targets" in (out / "bench.md").read_text()


def test_rounds_must_be_positive():
    assert main(["bench", "--config", SMOKE, "--rounds", "0"]) == EXIT_BAD_CONFIG
