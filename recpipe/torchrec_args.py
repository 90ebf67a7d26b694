"""recpipe's config, translated into the arguments torchrec and FBGEMM take.

The one place that knows how a :class:`~recpipe.config.RecpipeConfig` becomes
torchrec/FBGEMM objects: compute kernels, the fused parameters every TBE receives
(the embedding optimizer runs inside the TBE backward), UVM-cache parameters, the
sharders, and which rank holds each table_wise table. Both
:mod:`recpipe.sharding` (which shards the model with them) and
:mod:`recpipe.planner` (which predicts the memory of exactly that sharding, and runs
torchrec's partitioner on it) import from here; neither imports the other's
internals. Nothing here touches a process group or a GPU, and importing it loads
neither torchrec nor FBGEMM (the functions do), so the planner's data classes stay
cheap to import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import CacheParams

    from recpipe.config import EmbeddingOptimizerConfig, RecpipeConfig, TableSharding

__all__ = [
    "DEFAULT_CACHE_LOAD_FACTOR",
    "KERNELS",
    "cache_params",
    "embedding_fused_params",
    "make_sharder",
    "parameter_sharding_generator",
    "table_wise_ranks",
]

# Fraction of rows an HBM cache holds when sharding.*.cache_load_factor is unset
# (FBGEMM's own default too).
DEFAULT_CACHE_LOAD_FACTOR = 0.2

# recpipe kernel name -> torchrec EmbeddingComputeKernel value (the same strings).
KERNELS = {"fused": "fused", "fused_uvm": "fused_uvm", "fused_uvm_caching": "fused_uvm_caching", "dense": "dense"}
# recpipe embedding optimizer -> FBGEMM EmbOptimType member name.
_EMB_OPT = {"sgd": "EXACT_SGD", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD", "adam": "ADAM"}


def embedding_fused_params(opt: "EmbeddingOptimizerConfig", cfg: "RecpipeConfig") -> dict:
    """Keyword arguments that reach every FBGEMM TBE (optimizer fused into backward)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    params: dict = {
        "optimizer": getattr(EmbOptimType, _EMB_OPT[opt.name]),
        "learning_rate": opt.lr,
        "eps": opt.eps,
        "weight_decay": opt.weight_decay,
    }
    if opt.name == "adam":
        params.update(beta1=opt.beta1, beta2=opt.beta2)
    if cfg.sharding.uvm_host_mapped:
        params["uvm_host_mapped"] = True
    return params


def make_sharder(cfg: "RecpipeConfig") -> "EmbeddingBagCollectionSharder":
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return EmbeddingBagCollectionSharder(fused_params=embedding_fused_params(cfg.optimizer.embedding, cfg))


def table_wise_ranks(cfg: "RecpipeConfig", world_size: int) -> dict[str, int]:
    """Rank of each table_wise table: the configured one, else the least-loaded rank
    (largest tables first, load = rows), so placement is deterministic."""
    loads = [0] * world_size
    placed: dict[str, int] = {}
    tables = cfg.table_sharding()
    rows = dict(zip(cfg.model.table_names, cfg.model.num_embeddings_per_feature))
    for name, t in tables.items():
        if t.type == "table_wise" and t.rank is not None:
            placed[name] = t.rank
            loads[t.rank] += rows[name]
    free = [n for n, t in tables.items() if t.type == "table_wise" and t.rank is None]
    for name in sorted(free, key=lambda n: (-rows[n], n)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        placed[name] = rank
        loads[rank] += rows[name]
    return placed


def parameter_sharding_generator(t: "TableSharding", rank: int | None, world_size: int) -> Callable:
    """torchrec's ``sharding_plan`` generator for one table (``rank``: table_wise only)."""
    from torchrec.distributed.sharding_plan import column_wise, data_parallel, row_wise, table_wise

    kernel = KERNELS[t.kernel]
    if t.type == "table_wise":
        return table_wise(rank=rank, compute_kernel=kernel)
    if t.type == "row_wise":
        return row_wise(compute_kernel=kernel)
    if t.type == "column_wise":
        return column_wise(ranks=list(range(world_size)), compute_kernel=kernel)
    return data_parallel()


def cache_params(t: "TableSharding", cfg: "RecpipeConfig") -> "CacheParams | None":
    """FBGEMM UVM-cache parameters of a fused_uvm_caching table (None otherwise)."""
    if t.kernel != "fused_uvm_caching":
        return None
    # Both live here in fbgemm-gpu 1.6 and 1.8 (1.8 also has fbgemm_gpu.tbe.cache).
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm, MultiPassPrefetchConfig
    from torchrec.distributed.types import CacheParams

    multipass = None
    if cfg.sharding.prefetch_passes > 1:
        multipass = MultiPassPrefetchConfig(
            num_passes=cfg.sharding.prefetch_passes,
            min_splitable_pass_size=cfg.sharding.prefetch_min_pass_size,
        )
    return CacheParams(
        algorithm=CacheAlgorithm.LRU,
        load_factor=t.cache_load_factor if t.cache_load_factor is not None else DEFAULT_CACHE_LOAD_FACTOR,
        prefetch_pipeline=cfg.sharding.prefetch_pipeline,
        multipass_prefetch_config=multipass,
    )
