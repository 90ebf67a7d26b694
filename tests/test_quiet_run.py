"""A quiet first run (CPU): what ``recpipe train`` prints before its first log line.

The quickstart trains with a real pipeline; a CPU run prints no GPU memory plan; the
placement is one line; fbgemm-gpu's "_fbgemm_torch_compat_table has no entry" warning
is dropped in every recpipe process, and nothing else is.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from recpipe.config import load_config
from recpipe.table_sharding.checks import validated_tables
from recpipe.models import build_model
from recpipe.sharding import plan_summary, sharding_plan
from recpipe.preflight import Machine, check_memory

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"

# fbgemm_gpu/__init__.py, _load_library, for a release its table does not list (fbgemm-gpu 1.6.0)
FBGEMM_MESSAGE = """
            \033[33m
            _fbgemm_torch_compat_table has no entry for 1.6.0 of FBGEMM;
            cannot determine compatibility with PyTorch 2.11.0+cu130
            \033[0m
            """


def test_quickstart_trains_with_a_pipeline_that_pipelines():
    cfg = load_config(str(QUICKSTART))
    assert cfg.pipeline.name == "sparse_dist"
    assert cfg.train.device == "cpu" and cfg.distributed.nproc == 2


def test_cpu_run_prints_no_gpu_memory_plan(capsys):
    cfg = load_config(str(QUICKSTART))
    assert check_memory(cfg, Machine(cuda=True), world_size=2) is None  # train.device=cpu
    assert capsys.readouterr().out == ""
    # on CUDA the per-rank HBM summary is printed (a pure function: no GPU needed to compute it)
    assert check_memory(load_config(str(QUICKSTART), ["train.device=auto"]), Machine(cuda=True), world_size=2) is None
    out = capsys.readouterr().out
    assert out.startswith("memory plan: pipeline sparse_dist, 2 rank(s)") and "capacity" in out


def test_placement_is_one_line():
    cfg = load_config(str(QUICKSTART))
    plan = sharding_plan(build_model(cfg.model), cfg, 2, "cpu")
    line = plan_summary(plan, validated_tables(cfg))
    assert line == "sharding: 26 tables over 2 ranks: 22 table_wise (fused), 4 row_wise (fused)"


def _emit(*messages: str) -> subprocess.CompletedProcess:
    code = "import logging, recpipe\n" + "".join(f"logging.warning({m!r})\n" for m in messages)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_fbgemm_compat_table_warning_is_dropped_and_nothing_else():
    out = _emit(FBGEMM_MESSAGE, "a warning of someone else")
    assert out.returncode == 0, out.stderr
    assert "_fbgemm_torch_compat_table" not in out.stderr
    assert "a warning of someone else" in out.stderr
    # fbgemm's other check (a listed version that does not match torch) still prints
    other = _emit("FBGEMM_GPU version is 1.6.0, which is not guaranteed to be compatible with PyTorch 2.13.0")
    assert "not guaranteed to be compatible" in other.stderr


def test_importing_torchrec_after_recpipe_prints_no_compat_warning():
    """The real import chain (fbgemm-gpu loads its libraries when torchrec is imported)."""
    out = subprocess.run([sys.executable, "-c", "import recpipe, torchrec"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "_fbgemm_torch_compat_table" not in out.stderr
