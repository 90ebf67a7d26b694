"""User code for the fault tests: a ``data.factory`` that yields no training batch at all
(a filter that drops everything, an empty query), ``model.factory`` models that build
slowly, raise on one rank mid-training or stop one rank in a checkpoint save, a
``launch_local`` target that fails unevenly."""

from __future__ import annotations

import os
import signal
import time
from typing import Iterator

from torch import nn


def no_batches(cfg, *, rank: int, world_size: int, split: str, epoch: int, start_batch: int) -> Iterator | None:
    if split == "eval":
        return None  # no eval data either
    return iter(())


def fail_unevenly() -> None:
    """A ``launch_local`` target: rank 0 exits with a code of its own (as a user error
    does), rank 1 raises (as a rank whose collective lost its peer does), so both
    ranks' traceback files exist, and the launcher reports rank 0."""
    import sys

    if os.environ["RANK"] == "0":
        sys.exit(5)
    time.sleep(0.5)
    raise RuntimeError("Connection closed by peer")


def fail_first_but_exit_last() -> None:
    """A ``launch_local`` target: rank 1 raises at once, but its process ends a second after
    its traceback is written (a slow teardown, as a CUDA context's on a busy host); rank 0
    raises a moment later, the consequence ("Connection closed by peer"), and ends first.
    The launcher reports rank 1."""
    from multiprocessing.util import Finalize

    if os.environ["RANK"] == "1":
        Finalize(None, time.sleep, args=(1.0,), exitpriority=0)  # runs as the process ends
        raise RuntimeError("the first failure, on rank 1")
    time.sleep(0.3)
    raise RuntimeError("Connection closed by peer")


def slow_build(cfg):
    """A ``model.factory``: the built-in model, after a long build in each rank (as a large
    model's initialization takes); at once in the launcher, which builds it on meta."""
    from recpipe.models.dlrm import build_model

    if "RANK" in os.environ:
        time.sleep(120)
    return build_model(cfg.model, precision=cfg.train.precision)


class FailsAt(nn.Module):
    """The built-in model whose forward raises on one rank at one training step: a bug in
    a model, a CUDA error, a failed capture, as it reaches recpipe."""

    def __init__(self, inner: nn.Module, rank: int, call: int) -> None:
        super().__init__()
        self.inner, self.rank, self.call, self.calls = inner, rank, call, 0

    def forward(self, batch):
        if self.training and os.environ.get("RANK") == str(self.rank):
            self.calls += 1
            if self.calls == self.call:
                raise RuntimeError(f"injected failure on rank {self.rank} at its training step {self.call}")
        return self.inner(batch)


def fails_on_rank_1(cfg):
    """A ``model.factory``: the built-in model, raising on rank 1 in its 6th training step."""
    from recpipe.models.dlrm import build_model

    return FailsAt(build_model(cfg.model, precision=cfg.train.precision), rank=1, call=6)


class StopsInASave(nn.Module):
    """The built-in model whose state (read by every checkpoint save, first by its check
    of the weights) stops its own process on one rank (SIGSTOP) once the step-4
    checkpoint exists: a rank stopped, or frozen, in the middle of a later save."""

    def __init__(self, inner: nn.Module, rank: int, after: str) -> None:
        super().__init__()
        self.inner = inner
        self.register_state_dict_pre_hook(lambda module, prefix, keep_vars: self._stop(rank, after))

    @staticmethod
    def _stop(rank: int, after: str) -> None:
        if os.environ.get("RANK") == str(rank) and os.path.exists(after):
            os.kill(os.getpid(), signal.SIGSTOP)

    def forward(self, batch):
        return self.inner(batch)


def _stops_in_a_save(cfg, rank: int):
    from recpipe.models.dlrm import build_model

    after = os.path.join(cfg.checkpoint.dir, "step_00000004", "metadata.json")
    return StopsInASave(build_model(cfg.model, precision=cfg.train.precision), rank=rank, after=after)


def rank_0_stops_in_a_save(cfg):
    """A ``model.factory``: see ``StopsInASave``; rank 0 stops."""
    return _stops_in_a_save(cfg, 0)


def rank_1_stops_in_a_save(cfg):
    """A ``model.factory``: see ``StopsInASave``; rank 1 stops."""
    return _stops_in_a_save(cfg, 1)


EVAL_STARTED = "eval_started"  # in logging.run_dir: an evaluation of ``endless_eval`` has started


def endless_eval(cfg, *, rank: int, world_size: int, split: str, epoch: int, start_batch: int) -> Iterator:
    """A ``data.factory``: the synthetic click log, but its eval split never ends (its
    batches again and again); when an evaluation starts, rank 0 creates
    ``logging.run_dir/eval_started``."""
    from recpipe.data import make_dataloader

    synthetic = cfg.model_copy(update={"data": cfg.data.model_copy(update={"factory": None})})
    batches = make_dataloader(synthetic, rank=rank, world_size=world_size, split=split, epoch=epoch,
                              start_batch=start_batch)
    if split != "eval":
        return iter(batches)
    return _again_and_again(list(batches), os.path.join(cfg.logging.run_dir, EVAL_STARTED) if rank == 0 else None)


def _again_and_again(batches: list, started: str | None) -> Iterator:
    if started is not None:
        open(started, "w").close()
    while True:
        yield from batches
