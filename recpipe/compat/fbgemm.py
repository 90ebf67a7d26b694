"""fbgemm-gpu's private names recpipe reads (see :mod:`recpipe.compat`).

Checked against fbgemm-gpu 1.8.0 (``SplitTableBatchedEmbeddingBagsCodegen`` in
``fbgemm_gpu/split_table_batched_embeddings_ops_training.py``); fbgemm-gpu 1.6.0: to be
checked on the GPU machine (tests/test_compat.py).
"""

from __future__ import annotations

from typing import Any

import torch

# What a training TBE's forward keeps of its batch for its backward pre-hook
# (``_update_cache_counter_and_pointers`` with ``prefetch_pipeline``).
TBE_BATCH_FIELDS = ("_indices", "_offsets", "_vbe_B_offsets", "_vbe_max_B")


def tbe_last_batch(tbe: torch.nn.Module) -> tuple[Any, Any, Any, Any]:
    """(indices, offsets, vbe B offsets, vbe max B) of the TBE's last forward.

    speedups/cache_bookkeeping.py replays FBGEMM's backward pre-hook for a batch other than
    the last one, so it keeps what that hook reads. No public API: the TBE keeps them as
    private fields, set in ``forward`` and reset in ``reset_cache_states``."""
    return tuple(getattr(tbe, name) for name in TBE_BATCH_FIELDS)  # type: ignore[return-value]
