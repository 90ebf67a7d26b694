"""Input data: the :class:`Batch` type and DataLoaders that yield it.

``make_dataloader(cfg, rank=, world_size=, split=, epoch=, start_batch=)`` yields
rank-local batches in index order (synthetic click log or Criteo TSV, by
``data.source``); ``num_batches`` says how many a rank has (None for TSV).
"""

from recpipe.data.batch import Batch
from recpipe.data.loader import make_dataloader, num_batches

__all__ = ["Batch", "make_dataloader", "num_batches"]
