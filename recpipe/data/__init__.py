"""Input data: the :class:`Batch` type and loaders that yield it.

``make_dataloader(cfg, rank=, world_size=, split=, epoch=, start_batch=)`` yields
rank-local batches in index order (synthetic click log, Criteo TSV, or a binary
dataset made by ``recpipe data convert``, by ``data.source``); ``num_batches`` says
how many a rank has (None for TSV); ``check_data`` checks the configured files
before any process starts.
"""

from recpipe.data.batch import Batch
from recpipe.data.loader import check_data, make_dataloader, num_batches

__all__ = ["Batch", "check_data", "make_dataloader", "num_batches"]
