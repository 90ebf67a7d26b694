"""benchmarks/studies/loader_gil.py on CPU, small: every loader mode (none, inline, a producer
thread, a producer process) times the calibrated loop, and the loop's time splits into on-CPU,
core wait and GIL wait (the rows of benchmarks/results/cpu/data_loader.md's GIL microbenchmark)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.studies.loader_gil import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_loader_gil_times_every_loader_mode(tmp_path: Path, capsys):
    path = tmp_path / "gil.json"
    main(["--config", str(ROOT / "configs" / "quickstart.yaml"), "--set", "data.batch_size=64", "--steps", "4",
          "--warmup", "1", "--rounds", "2", "--workers", "1", "--step-ms", "2", "--json", str(path)])
    rows = json.loads(path.read_text())["rows"]
    assert [(r["mode"], r["workers"]) for r in rows] == [("none", 0), ("inline", 0), ("thread", 1), ("process", 1)]
    for r in rows:
        assert r["busy_ms"] > 0 and 0 < r["on_cpu_ms"] <= r["busy_ms"] * 1.05 and r["core_wait_ms"] >= 0
        assert r["gil_wait_ms"] == pytest.approx(r["busy_ms"] - r["on_cpu_ms"] - r["core_wait_ms"])
        assert r["samples_per_s"] == pytest.approx(r["steps_per_s"] * 64)
    table = capsys.readouterr().out.splitlines()
    assert table[-6].startswith("| loader | busy ms/step | on CPU | core wait | GIL wait |")
    assert [line.split(" | ")[0] for line in table[-4:]] == ["| none", "| inline", "| thread x1", "| process x1"]
