"""benchmarks/studies/convert_speed.py on CPU, small: every run converts the file's rows and the
best rates are printed last (the figures of benchmarks/results/cpu/convert.md)."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.studies.convert_speed import main

ROOT = Path(__file__).resolve().parents[2]


def test_convert_speed_times_each_run_and_prints_the_best(tmp_path: Path, capsys):
    line = "\t".join(["1", *map(str, range(13)), *(format(v, "x") for v in range(26))]) + "\n"
    path = tmp_path / "day_0.tsv"
    path.write_text(line * 300)
    assert main(["--config", str(ROOT / "configs" / "bench" / "dlrm_criteo.yaml"), "--repeat", "2", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == ["run 1", "run 2", "best of 2"]
    assert all(re.match(r"run \d: 300 rows in [\d.]+ s wall, [\d.]+ s CPU: [\d,]+ rows/s", line) for line in out[:2])
    assert re.match(r"best of 2: [\d,]+ rows/s with 1 worker\(s\), [\d,]+ rows per CPU-second$", out[2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["day_0.tsv"]  # the datasets are removed
