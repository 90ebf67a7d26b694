"""A user's pipeline class for ``pipeline.class`` (tests/test_pipeline_class.py): imported by
name in every rank. Each rank prints a line per trained step, which the test reads."""

from __future__ import annotations

import torch.distributed as dist

from recpipe.pipelines import SparseDistPipeline


class CountingSparseDist(SparseDistPipeline):
    """``sparse_dist`` that prints ``counted rank R step N (schedule S, max_batches_ahead M)``
    after every optimizer step: the class ran, in every rank, with the configured options."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps = 0

    def after_optimizer_step(self, batch) -> None:
        self.steps += 1
        print(f"counted rank {dist.get_rank()} step {self.steps} (schedule {self.schedule.name}, "
              f"max_batches_ahead {self.max_batches_ahead})", flush=True)


def not_a_class(cfg):
    """A function, where pipeline.class names a class."""
