"""DataLoaders of whole :class:`Batch` objects, for the synthetic log or Criteo TSV.

Contract of :func:`make_dataloader`: iterating yields ``Batch`` objects in
batch-index order ``start_batch, start_batch + 1, ...`` of ``rank``'s ``split``
stream, bit-for-bit identical whatever ``data.num_workers`` is. Worker ``w`` of
``n`` makes batch indices ``start_batch + w, start_batch + w + n, ...`` and torch's
DataLoader takes one result from each worker in turn, which restores the order.
Everything handed to workers is a module-level class or function, so the loader
also works inside ``torch.multiprocessing.spawn``-ed trainers.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Iterator, Literal

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from recpipe.config import RecpipeConfig
from recpipe.data.batch import Batch
from recpipe.data.criteo import CriteoTsvReader
from recpipe.data.synthetic import SyntheticClickLog, num_synthetic_batches

__all__ = ["make_dataloader", "num_batches"]


def _check(cfg: RecpipeConfig, rank: int, world_size: int, split: str) -> None:
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1} (world_size={world_size})")


def _tsv_files(cfg: RecpipeConfig, split: str) -> list[str]:
    crit = cfg.data.criteo
    return list(crit.train_files if split == "train" else crit.eval_files)


def num_batches(cfg: RecpipeConfig, *, rank: int, world_size: int, split: str) -> int | None:
    """Batches ``rank`` has in ``split`` per epoch; None when only reading would tell (TSV).

    A TSV split without files has 0 batches. TSV ranks always have equal counts.
    """
    _check(cfg, rank, world_size, split)
    if cfg.data.factory is not None:
        return None
    if cfg.data.source == "synthetic":
        return num_synthetic_batches(cfg, rank=rank, split=split)
    return None if _tsv_files(cfg, split) else 0


def _worker_slice(start: int, stop: int | None) -> Iterator[int]:
    """This worker's batch indices out of ``start .. stop-1`` (open-ended if stop is None)."""
    info = get_worker_info()
    worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
    return itertools.islice(itertools.count(start), worker, None if stop is None else max(stop - start, 0), workers)


class SyntheticDataset(IterableDataset):
    """Batches ``start_batch ..`` of one rank's synthetic split."""

    def __init__(self, cfg: RecpipeConfig, *, rank: int, split: str, epoch: int, start_batch: int) -> None:
        self.log = SyntheticClickLog(cfg)
        self.rank, self.split, self.epoch = rank, split, epoch
        self.start = start_batch
        self.stop = num_synthetic_batches(cfg, rank=rank, split=split)

    def __len__(self) -> int:
        return max(self.stop - self.start, 0)

    def __iter__(self) -> Iterator[Batch]:
        for index in _worker_slice(self.start, self.stop):
            yield self.log.batch(rank=self.rank, split=self.split, epoch=self.epoch, index=index)


class CriteoTsvDataset(IterableDataset):
    """Batches ``start_batch ..`` of one rank's part of the TSV files (see ``criteo``).

    Each worker scans the files itself and parses only its own batches' lines
    (skipping is cheap next to parsing).
    """

    def __init__(self, reader: CriteoTsvReader, *, start_batch: int) -> None:
        self.reader = reader
        self.start = start_batch

    def __iter__(self) -> Iterator[Batch]:
        return self.reader.batches(_worker_slice(self.start, None))


def user_batches(cfg: RecpipeConfig, *, rank: int, world_size: int, split: str, epoch: int, start_batch: int) -> Iterable[Any]:
    """``data.factory(cfg, rank=, world_size=, split=, epoch=, start_batch=)``: the
    user's batches (None = no batches for this split, e.g. no eval data)."""
    from recpipe.config import ConfigError
    from recpipe.models.factory import load_callable

    fn = load_callable(cfg.data.factory, "data.factory")
    batches = fn(cfg, rank=rank, world_size=world_size, split=split, epoch=epoch, start_batch=start_batch)
    if batches is None:
        return []
    if not hasattr(batches, "__iter__"):
        raise ConfigError(
            f"data.factory={cfg.data.factory!r} returned {type(batches).__name__} for split={split!r}; it must "
            "return an iterable of batches (or None when the split has no data)"
        )
    return batches


def identity_collate(batch: Batch) -> Batch:
    """The dataset yields finished batches; module-level so spawn can pickle it."""
    return batch


def init_worker(worker_id: int) -> None:
    """Each worker makes whole batches alone: intra-op threads would only oversubscribe."""
    torch.set_num_threads(1)


def make_dataloader(
    cfg: RecpipeConfig,
    *,
    rank: int,
    world_size: int,
    split: Literal["train", "eval"],
    epoch: int = 0,
    start_batch: int = 0,
) -> Iterable[Any]:
    """A DataLoader over ``rank``'s ``split`` batches from index ``start_batch`` on
    (with ``data.factory``: whatever the user's function returns for the same arguments)."""
    _check(cfg, rank, world_size, split)
    if start_batch < 0:
        raise ValueError(f"start_batch must be >= 0, got {start_batch}")
    if cfg.data.factory is not None:
        return user_batches(cfg, rank=rank, world_size=world_size, split=split, epoch=epoch, start_batch=start_batch)
    dataset: IterableDataset
    if cfg.data.source == "synthetic":
        dataset = SyntheticDataset(cfg, rank=rank, split=split, epoch=epoch, start_batch=start_batch)
    else:
        reader = CriteoTsvReader(cfg, _tsv_files(cfg, split), rank=rank, world_size=world_size)
        dataset = CriteoTsvDataset(reader, start_batch=start_batch)
    workers = cfg.data.num_workers
    return DataLoader(
        dataset,
        batch_size=None,
        num_workers=workers,
        collate_fn=identity_collate,
        pin_memory=cfg.data.pin_memory and torch.cuda.is_available(),
        worker_init_fn=init_worker if workers > 0 else None,
        persistent_workers=False,
    )
