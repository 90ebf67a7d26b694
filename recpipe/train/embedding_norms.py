"""The L2 norms of the embedding rows this rank holds, for TensorBoard histograms.

Read through the model's public ``state_dict``: a sharded table is a ShardedTensor (or a
DTensor) whose local shards are views of this rank's FBGEMM weights, a replicated
(data_parallel) or unsharded one a plain tensor, so nothing is copied but the rows
sampled. A shard holds whole rows (table_wise, row_wise, table_row_wise, data_parallel)
or a slice of every row's columns (column_wise); the norm of a slice is not the row's,
so column_wise shards are left out. At most ``MAX_ROWS`` rows a table, evenly strided
(the same rows at every evaluation, so that histograms over steps compare).
"""

from __future__ import annotations

import re

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from recpipe.compat import torch as compat_torch

__all__ = ["MAX_ROWS", "local_row_norms"]

MAX_ROWS = 100_000
# EmbeddingBagCollection's and EmbeddingCollection's keys: "...embedding_bags.<table>.weight"
_TABLE_KEY = re.compile(r"(?:^|\.)(?:embedding_bags|embeddings)\.([^.]+)\.weight$")


@torch.no_grad()
def local_row_norms(model: nn.Module, max_rows: int = MAX_ROWS) -> dict[str, torch.Tensor]:
    """Table name -> float32 CPU tensor of the L2 norms of up to ``max_rows`` of the whole
    rows this rank holds of it; tables with none here are left out."""
    out = {}
    for key, value in model.state_dict().items():
        found = _TABLE_KEY.search(key)
        if found is None or not isinstance(value, torch.Tensor):
            continue
        blocks = [b for b in _whole_row_blocks(value) if b.numel() and b.is_floating_point()]
        if not blocks:
            continue
        share = max(1, max_rows // len(blocks))
        out[found.group(1)] = torch.cat([_sampled_norms(b, share) for b in blocks])
    return out


def _whole_row_blocks(value: torch.Tensor) -> list[torch.Tensor]:
    """This rank's blocks of ``value`` (a table's 2-d weight) that hold every column of
    their rows. A ShardedTensor is read through its metadata and local shards: a torch
    function called on it warns that ShardedTensor is deprecated."""
    if compat_torch.is_sharded_tensor(value):
        size = value.metadata().size
        blocks = [shard.tensor for shard in value.local_shards()]
    elif isinstance(value, DTensor):
        size, blocks = value.shape, [value.to_local()]
    else:
        size, blocks = value.shape, [value]
    if len(size) != 2:
        return []
    return [b for b in blocks if b.dim() == 2 and b.size(1) == size[1]]


def strided_rows(count: int, max_rows: int, device: torch.device | None = None) -> torch.Tensor:
    """``min(count, max_rows)`` row indices evenly strided over ``0 .. count - 1``, the first
    and the last included, in int64 arithmetic: a float32 ``linspace`` rounds ``count - 1``
    up past the last row once a table has more than 2**24 rows (40M rows: 40,000,000)."""
    if count <= max_rows:
        return torch.arange(count, device=device)
    if max_rows == 1:
        return torch.zeros(1, dtype=torch.int64, device=device)
    return torch.arange(max_rows, device=device) * (count - 1) // (max_rows - 1)


def _sampled_norms(rows: torch.Tensor, max_rows: int) -> torch.Tensor:
    if rows.size(0) > max_rows:
        rows = rows.index_select(0, strided_rows(rows.size(0), max_rows, rows.device))
    return rows.float().norm(dim=1).cpu()
