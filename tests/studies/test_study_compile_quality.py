"""benchmarks/studies/compile_quality.py on CPU: the quickstart model trained eagerly and compiled
(``recpipe train``, inductor's C++ backend) for a few steps on two seeds, the AUCs compared seed
by seed, and the record and report that benchmarks/results/cpu/compile_quality.md comes from."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["train.steps=8", "train.eval_every=0", "data.synthetic.num_eval_batches=2", "data.batch_size=128",
         "distributed.nproc=1"]


@pytest.mark.slow
def test_compile_quality_compares_eager_and_compiled_runs_on_cpu(tmp_path: Path):
    out = tmp_path / "cq"
    argv = ["--config", "configs/quickstart.yaml", "--seeds", "0,1", *(x for o in SMALL for x in ("--set", o)),
            "--out", str(out)]
    done = subprocess.run([sys.executable, "benchmarks/studies/compile_quality.py", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((out / "compile_quality.json").read_text())
    assert record["command"] == "python benchmarks/studies/compile_quality.py " + " ".join(argv)
    assert [(r["seed"], r["compiled"]) for r in record["runs"]] == [(0, False), (0, True), (1, False), (1, True)]
    auc = {(r["seed"], r["compiled"]): r["eval_auc"] for r in record["runs"]}
    diffs = [auc[(s, True)] - auc[(s, False)] for s in (0, 1)]
    assert record["auc_difference_mean"] == pytest.approx(sum(diffs) / 2)
    assert record["auc_difference_se"] == pytest.approx(abs(diffs[0] - diffs[1]) / 2)
    assert record["same_quality"] and all(0.0 < a < 1.0 and not math.isnan(a) for a in auc.values())
    md = (out / "compile_quality.md").read_text()
    assert f"Command: `{record['command']}`" in md and "| 1 | " in md and "the same quality" in md
    assert done.stdout.splitlines()[-1].startswith("compile quality: mean AUC difference")
