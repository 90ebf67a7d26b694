"""Input data: the :class:`Batch` type and loaders that yield it.

``make_dataloader(cfg, rank=, world_size=, split=, epoch=, start_batch=)`` yields
rank-local batches in index order (synthetic click log, Criteo TSV, a binary
dataset made by ``recpipe data convert``, or TorchRec's / MLPerf's Criteo ``.npy``
days, by ``data.source``; docs/data.md); ``num_batches`` says
how many a rank has (None for TSV), ``no_eval_data`` names the key that leaves a
source without eval batches; ``check_data`` checks the configured files before any
process starts.

The names are imported on first use, so that ``recpipe.data.binary_format`` (numpy
only) can be imported without torch and torchrec.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Batch", "check_data", "make_dataloader", "no_eval_data", "num_batches"]


def __getattr__(name: str) -> Any:
    # Imported here, on first use: see the module's docstring.
    if name == "Batch":
        from recpipe.data.batch import Batch

        return Batch
    if name in ("check_data", "make_dataloader", "no_eval_data", "num_batches"):
        from recpipe.data import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'recpipe.data' has no attribute {name!r}")
