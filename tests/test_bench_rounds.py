"""``recpipe bench --rounds``: interleaved run order, merged rows, paired ratios and
comparisons, the sign test (recpipe.bench.compare), and one CPU run with two rounds end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recpipe.bench.compare import comparisons, comparisons_md, merge_rounds, paired, round_order, sign_test_p
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


def test_comparisons_pair_each_recpipe_row_with_torchrec_and_base():
    rounds = {"base": (10.0, 11.0), "sparse_dist": (9.0, 10.5)}
    rows = [merge_rounds([_row(n, impl, [p * (1.05 if impl != "recpipe" else 1.0)]) for p in ps], 1000)
            for n, ps in rounds.items() for impl in ("recpipe", "torchrec")]
    rows.append(merge_rounds([_row("base", "torchrec_pt2", [p * 0.9]) for p in rounds["base"]], 1000))
    rows.append(Row(pipeline="semi_sync", impl="recpipe", status="failed", reason="boom"))
    pairs = {(p["a"], p["b"]): p for p in comparisons(rows)}
    assert set(pairs) == {("base (recpipe)", "base (torchrec)"), ("base (recpipe)", "base (torchrec_pt2)"),
                          ("sparse_dist (recpipe)", "sparse_dist (torchrec)"),
                          ("sparse_dist (recpipe)", "base (recpipe)")}
    vs_base = pairs[("sparse_dist (recpipe)", "base (recpipe)")]
    assert vs_base["round_ratios"] == pytest.approx([0.9, 10.5 / 11]) and vs_base["a_faster_rounds"] == 2
    assert pairs[("base (recpipe)", "base (torchrec)")]["median_ratio"] == pytest.approx(1 / 1.05)
    assert pairs[("base (recpipe)", "base (torchrec_pt2)")]["a_faster_rounds"] == 0
    md = "\n".join(comparisons_md(comparisons(rows)))
    assert "## Paired comparisons" in md and "| sparse_dist (recpipe) | base (recpipe) | " in md
    assert "| 2/2 | 0.5 |" in md  # two rounds: the sign test cannot say much
    assert comparisons_md([]) == []


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
    pairs = {(p["a"], p["b"]) for p in record["comparisons"]}
    assert {("base (recpipe)", "base (torchrec)"), ("sparse_dist (recpipe)", "sparse_dist (torchrec)"),
            ("sparse_dist (recpipe)", "base (recpipe)")} == pairs
    pair = next(p for p in record["comparisons"] if p["b"] == "base (torchrec)")
    assert pair["rounds"] == 2 and len(pair["round_ratios"]) == 2
    assert "## Paired comparisons" in (out / "bench.md").read_text()
    assert "plots" not in record and not list(out.glob("*.png"))  # --no-plots


def test_rounds_must_be_positive():
    assert main(["bench", "--config", SMOKE, "--rounds", "0"]) == EXIT_BAD_CONFIG
