"""Between two log points the trainer reads nothing of the device on the host: the loss,
the click metrics and the non-finite check stay on the device until ``train.log_every``
(``tests/host_reads.py`` counts every ``item``, ``tolist``, ``bool``, ``float``, ``cpu``, ...
on the training thread outside the pipeline's step and the log points), with 1 and 2 ranks
and both ``train.on_nonfinite`` modes; and a read added to the per-step path is caught."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from host_reads import HostReads, between_log_points
from pipeline_harness import small_config
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from recpipe.train.nonfinite import NonFiniteCheck
from recpipe.train.trainer import Trainer

LOG_EVERY = 4


def _config(nproc: int, run_dir, on_nonfinite: str = "error"):
    return small_config(nproc, [
        f"train.steps={3 * LOG_EVERY}", f"train.log_every={LOG_EVERY}", "train.eval_every=0", "train.progress=false",
        f"train.on_nonfinite={on_nonfinite}", "data.source=synthetic", "data.synthetic.num_eval_batches=1",
        f"logging.run_dir={run_dir}",
    ])


def _fit_counting(cfg, device: torch.device) -> HostReads:
    trainer = Trainer(cfg, device)
    with HostReads() as reads:
        between_log_points(trainer, reads)
        trainer.fit()
    assert trainer.position.step == 3 * LOG_EVERY
    return reads


def _fit_one_rank(cfg) -> HostReads:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return _fit_counting(cfg, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("on_nonfinite", ["error", "skip_step"])
def test_one_rank_reads_nothing_between_log_points(tmp_path, on_nonfinite):
    reads = _fit_one_rank(_config(1, tmp_path / "run", on_nonfinite))
    assert not reads.reads, f"host reads between log points:\n{reads.describe()}"


def _rank(cfg) -> None:
    device = init_process_group(cfg)
    try:
        reads = _fit_counting(cfg, device)
        assert not reads.reads, f"rank {dist.get_rank()}: host reads between log points:\n{reads.describe()}"
    finally:
        dist.destroy_process_group()


def test_two_ranks_read_nothing_between_log_points(tmp_path):
    launch_local(_rank, 2, _config(2, tmp_path / "run"))


def test_a_read_in_the_step_path_is_counted(tmp_path, monkeypatch):
    """The count can fail: a non-finite check that reads every step's loss is caught, once a step."""
    record = NonFiniteCheck.record

    def reading_record(self, loss):
        if not torch.isfinite(loss).all():
            pass
        record(self, loss)

    monkeypatch.setattr(NonFiniteCheck, "record", reading_record)
    reads = _fit_one_rank(_config(1, tmp_path / "run"))
    assert sum(reads.reads.values()) == 3 * LOG_EVERY, reads.describe()
    assert all(name == "__bool__" for name, _ in reads.reads), reads.describe()
