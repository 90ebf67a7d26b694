"""User code for the fault tests: a ``data.factory`` that yields no training batch at all
(a filter that drops everything, an empty query), ``model.factory`` models that build
slowly or raise on one rank mid-training, a ``launch_local`` target that fails unevenly."""

from __future__ import annotations

import os
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
