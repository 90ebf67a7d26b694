"""A ``data.factory`` for tests/test_data_workers.py: the synthetic click log, each training
batch handed over 50 ms late, as a loader too slow for its trainer would."""

from __future__ import annotations

import time
from typing import Iterable, Iterator

DELAY_S = 0.05


def _late(batches: Iterable) -> Iterator:
    for batch in batches:
        time.sleep(DELAY_S)
        yield batch


def slow_train(cfg, *, rank: int, world_size: int, split: str, epoch: int, start_batch: int) -> Iterable:
    from recpipe.data import make_dataloader

    synthetic = cfg.model_copy(update={"data": cfg.data.model_copy(update={"factory": None})})
    batches = make_dataloader(synthetic, rank=rank, world_size=world_size, split=split, epoch=epoch,
                              start_batch=start_batch)
    return _late(batches) if split == "train" else batches


class _Recorded:
    """An iterable of ``batches`` that appends "<split> start" to ``log`` when iterated and
    "<split> <i>" for each batch taken."""

    def __init__(self, batches: Iterable, split: str, log: str) -> None:
        self.batches, self.split, self.log = batches, split, log

    def _note(self, what: str) -> None:
        with open(self.log, "a") as f:
            f.write(f"{self.split} {what}\n")

    def __iter__(self) -> Iterator:
        self._note("start")  # when iter() is called, as a loader starts its producers then
        return self._taken(iter(self.batches))

    def _taken(self, batches: Iterator) -> Iterator:
        for i, batch in enumerate(batches):
            self._note(str(i))
            yield batch


def recorded(cfg, *, rank: int, world_size: int, split: str, epoch: int, start_batch: int) -> Iterable:
    """The synthetic click log, each split's start and batches noted in ``data.options.log``."""
    from recpipe.data import make_dataloader

    synthetic = cfg.model_copy(update={"data": cfg.data.model_copy(update={"factory": None})})
    batches = make_dataloader(synthetic, rank=rank, world_size=world_size, split=split, epoch=epoch,
                              start_batch=start_batch)
    return _Recorded(batches, split, cfg.data.options["log"])
