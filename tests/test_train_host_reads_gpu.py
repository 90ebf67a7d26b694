"""Between two log points a trained step on CUDA makes no host sync (torch's sync debug
mode set to error, so a sync raises naming the op): the trainer's own path around the step
(loss log, click metrics, non-finite check, stop agreement) on 1 and 2 GPUs with the plain
pipeline; and the whole step, the pipeline's included, with ``pipeline.step_graph`` once
its graph is captured (from the first log point on)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipeline_harness import small_config
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from recpipe.train.trainer import Trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LOG_EVERY = 8
STEPS = 4 * LOG_EVERY


def _config(nproc: int, run_dir, overrides: list[str]):
    return small_config(nproc, [
        "train.device=cuda", "distributed.backend=nccl", f"train.steps={STEPS}", f"train.log_every={LOG_EVERY}",
        "train.eval_every=0", "train.progress=false", "data.source=synthetic", "data.synthetic.num_eval_batches=1",
        f"logging.run_dir={run_dir}", *overrides,
    ])


def _sync_errors_between_log_points(trainer: Trainer, whole_step: bool) -> None:
    """Sync debug mode "error" in ``_train_steps``, "default" inside log points, and inside the
    pipeline's step unless ``whole_step`` (then from the first log point on: warm-up and capture
    before it may sync)."""
    train_steps, log_train, progress = trainer._train_steps, trainer._log_train, trainer.pipeline.progress
    count_time = trainer._count_time
    armed = {"steps": False, "step": False}

    def mode(on: bool) -> None:
        torch.cuda.set_sync_debug_mode("error" if on else "default")

    def counted_steps(batches: Any) -> int:
        armed["steps"] = True
        mode(True)
        try:
            return train_steps(batches)
        finally:
            armed["steps"] = False
            mode(False)

    def log_point(*args: Any, **kwargs: Any) -> None:
        mode(False)
        try:
            log_train(*args, **kwargs)
        finally:
            armed["step"] = whole_step
            mode(armed["steps"])

    def step(batches: Any) -> Any:
        mode(armed["step"])
        try:
            return progress(batches)
        finally:
            mode(armed["steps"])

    def clock(since: float, synchronize: bool) -> float:
        mode(armed["steps"] and not synchronize)  # a segment's end waits for the device, by design
        try:
            return count_time(since, synchronize)
        finally:
            mode(armed["steps"])

    trainer._train_steps, trainer._log_train, trainer.pipeline.progress = counted_steps, log_point, step
    trainer._count_time = clock


def _rank(cfg, whole_step: bool) -> None:
    device = init_process_group(cfg)
    try:
        trainer = Trainer(cfg, device)
        _sync_errors_between_log_points(trainer, whole_step)
        trainer.fit()
        assert trainer.position.step == STEPS
        if whole_step:
            assert trainer.summary()["speedups"]["step_graph"]["replays"] >= STEPS - LOG_EVERY
    finally:
        torch.cuda.set_sync_debug_mode("default")
        dist.destroy_process_group()


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("on_nonfinite", ["error", "skip_step"])
def test_trainer_path_makes_no_host_sync_between_log_points(tmp_path, nproc, on_nonfinite):
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    launch_local(_rank, nproc, _config(nproc, tmp_path / "run", [f"train.on_nonfinite={on_nonfinite}"]), False)


def test_step_graph_step_makes_no_host_sync_between_log_points(tmp_path):
    cfg = _config(1, tmp_path / "run", ["pipeline.name=sparse_dist", "pipeline.step_graph=true", "sharding.tables={}",
                                        "data.synthetic.mean_pooling_factors=1.0"])
    launch_local(_rank, 1, cfg, True)
