"""FBGEMM's UVM-cache parameters of a ``fused_uvm_caching`` table."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchrec.distributed.types import CacheParams

    from recpipe.config import ShardingConfig, TableSharding

# torch, torchrec and FBGEMM are imported by the functions that use them: the planner imports
# this module, and `recpipe plan` loads none of them.

__all__ = ["DEFAULT_CACHE_LOAD_FACTOR", "cache_params"]

# Fraction of rows an HBM cache holds when sharding.*.cache_load_factor is unset
# (FBGEMM's own default too).
DEFAULT_CACHE_LOAD_FACTOR = 0.2


def cache_params(t: "TableSharding", sharding: "ShardingConfig", prefetch_pipeline: bool) -> "CacheParams | None":
    """FBGEMM UVM-cache parameters of a fused_uvm_caching table (None otherwise).
    ``prefetch_pipeline``: FBGEMM's cache-line locking (``RecpipeConfig.cache_line_locking``)."""
    if t.kernel != "fused_uvm_caching":
        return None
    # Both live here in fbgemm-gpu 1.6 and 1.8 (1.8 also has fbgemm_gpu.tbe.cache).
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm, MultiPassPrefetchConfig
    from torchrec.distributed.types import CacheParams

    multipass = None
    if sharding.prefetch_passes > 1:
        multipass = MultiPassPrefetchConfig(
            num_passes=sharding.prefetch_passes,
            min_splitable_pass_size=sharding.prefetch_min_pass_size,
        )
    precision = None
    if t.cache_precision is not None:  # else torchrec's default: the weights' precision
        from torchrec.types import DataType

        precision = DataType(t.cache_precision.upper())
    return CacheParams(
        algorithm=CacheAlgorithm.LRU,
        load_factor=t.cache_load_factor if t.cache_load_factor is not None else DEFAULT_CACHE_LOAD_FACTOR,
        precision=precision,
        prefetch_pipeline=prefetch_pipeline,
        multipass_prefetch_config=multipass,
    )
