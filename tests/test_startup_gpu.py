"""``recpipe train``'s start-up on one GPU with ``pipeline.step_graph`` and ``pipeline.compile``:
the start-up ends at the step after the capture (``warm_up`` holds the warm-up steps and the
capture), and a second run with the same inductor cache directory loads the compiled kernels
(FX graph and AOTAutograd cache hits, no miss) and spends less on its first step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recpipe.cli import main

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CONFIG = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
RUN = [
    "train.device=cuda", "distributed.backend=nccl", "distributed.nproc=1", "sharding.tables={}",
    "data.synthetic.mean_pooling_factors=1.0", "data.synthetic.num_eval_batches=1", "data.num_workers=1",
    "pipeline.name=sparse_dist", "pipeline.step_graph=true", "pipeline.compile.enabled=true",
    "train.steps=12", "train.log_every=4", "train.eval_every=0", "train.progress=false",
]


def _train(run_dir: Path, cache_dir: Path) -> dict:
    args = ["train", "--config", str(CONFIG), "--set", f"logging.run_dir={run_dir}",
            "--set", f"pipeline.compile.cache_dir={cache_dir}"]
    for pair in RUN:
        args += ["--set", pair]
    assert main(args) == 0
    return json.loads((run_dir / "summary.json").read_text())


def test_start_up_ends_after_the_capture_and_a_second_run_hits_the_compile_cache(tmp_path):
    cold = _train(tmp_path / "cold", tmp_path / "inductor")
    warm = _train(tmp_path / "warm", tmp_path / "inductor")
    for summary in (cold, warm):
        startup = summary["startup"]
        assert startup["first_timed_step"] >= 3, startup  # eager warm-up steps, then the capture
        assert "warm_up" in startup["phases_s"], startup
        assert summary["speedups"]["step_graph"]["replays"] >= summary["steps"] - startup["first_timed_step"] + 1
    assert cold["startup"]["compile_cache"].get("fx_graph_miss", 0) > 0, cold["startup"]
    assert warm["startup"]["compile_cache"].get("fx_graph_hit", 0) > 0, warm["startup"]
    assert warm["startup"]["compile_cache"].get("fx_graph_miss", 0) == 0, warm["startup"]
    assert warm["startup"]["phases_s"]["first_step"] < cold["startup"]["phases_s"]["first_step"]
