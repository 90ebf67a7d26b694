"""A ``data.factory`` for tests/test_eval_pipeline.py: the synthetic click log, with an eval
split whose batch count differs between ranks (rank r: 3 + r batches), as a user's factory
may give it."""

from __future__ import annotations

import itertools
from typing import Iterable


def uneven_eval(cfg, *, rank: int, world_size: int, split: str, epoch: int, start_batch: int) -> Iterable:
    from recpipe.data import make_dataloader

    synthetic = cfg.model_copy(update={"data": cfg.data.model_copy(update={"factory": None})})
    batches = make_dataloader(synthetic, rank=rank, world_size=world_size, split=split, epoch=epoch,
                              start_batch=start_batch)
    return itertools.islice(batches, 3 + rank) if split == "eval" else batches
