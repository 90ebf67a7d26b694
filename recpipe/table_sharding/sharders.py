"""torchrec's sharders as recpipe configures them: one per module type, every TBE with
the embedding optimizer fused into its backward, and the sharding types they offer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from recpipe.config import SHARDING_TYPES
from recpipe.embedding_tables import EBC, EC, FPEBC
from recpipe.table_sharding import comm

if TYPE_CHECKING:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ModuleSharder

    from recpipe.config import EmbeddingOptimizerConfig, ShardingConfig

# torch, torchrec and FBGEMM are imported by the functions that use them: the planner imports
# this module, and `recpipe plan` loads none of them.

__all__ = ["SHARDER_TYPES", "embedding_fused_params", "make_sharder", "make_sharders", "sharders_offer"]

# recpipe embedding optimizer -> FBGEMM EmbOptimType member name.
_EMB_OPT = {"sgd": "EXACT_SGD", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD", "adam": "ADAM"}

# recpipe's sharding types that torchrec's sharder of each module type offers on CUDA
# (``ModuleSharder.sharding_types("cuda")``, torchrec 1.6.1 to 1.8; recpipe also runs
# row_wise on CPU, which torchrec's CPU list omits): what the planner checks the built-in
# model's tables against without loading torchrec. tests/test_planner.py holds it to
# torchrec's sharders (:func:`sharders_offer`), which a model built on meta is checked
# against (``recpipe.table_sharding.checks.validated_tables``).
SHARDER_TYPES = {
    EBC: ("table_wise", "row_wise", "table_row_wise", "column_wise", "data_parallel"),
    EC: ("table_wise", "row_wise", "column_wise", "data_parallel"),
    FPEBC: ("table_wise", "row_wise", "table_row_wise", "column_wise", "data_parallel"),
}


def embedding_fused_params(opt: "EmbeddingOptimizerConfig", uvm_host_mapped: bool) -> dict:
    """Keyword arguments that reach every FBGEMM TBE (optimizer fused into backward;
    ``uvm_host_mapped``: ``sharding.uvm_host_mapped``)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    params: dict = {
        "optimizer": getattr(EmbOptimType, _EMB_OPT[opt.name]),
        "learning_rate": opt.lr,
        "eps": opt.eps,
        "weight_decay": opt.weight_decay,
    }
    if opt.name == "adam":
        params.update(beta1=opt.beta1, beta2=opt.beta2)
    if uvm_host_mapped:
        params["uvm_host_mapped"] = True
    return params


def make_sharder(sharding: "ShardingConfig", optimizer: "EmbeddingOptimizerConfig",
                 device_type: str = "cuda") -> "EmbeddingBagCollectionSharder":
    """The EmbeddingBagCollection sharder (what the built-in DLRM needs)."""
    return make_sharders(sharding, optimizer, device_type)[EBC]


def make_sharders(
    sharding: "ShardingConfig", optimizer: "EmbeddingOptimizerConfig", device_type: str = "cuda", *,
    comms: bool = True, extra_fused_params: dict | None = None, world_size: int = 1,
) -> dict[str, "ModuleSharder"]:
    """One torchrec sharder per module type recpipe shards (keys: the type names of
    :data:`recpipe.embedding_tables.MODULE_TYPES`), all with the same fused params
    (``optimizer``: ``optimizer.embedding``) and the same quantized-comm codecs
    (``sharding.comm_precision``; none when both directions are fp32; ``comms=False``
    leaves them out, for checks that only ask the sharders what they support). Each gets
    its own fused-params dict: torchrec's lookups may add keys to the one they hold.
    ``extra_fused_params``: more TBE keyword arguments (the bench turns on FBGEMM's cache
    statistics, ``gather_uvm_cache_stats``). ``world_size``: the ranks the model is sharded
    over (:func:`recpipe.table_sharding.comm.tbe_output_precision` needs it; building a
    plan does not)."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder

    output = comm.tbe_output_precision(sharding, world_size, device_type) if comms else None

    def fused() -> dict:
        params = {**embedding_fused_params(optimizer, sharding.uvm_host_mapped), **(extra_fused_params or {})}
        if output is not None:
            from fbgemm_gpu.split_embedding_configs import SparseType

            params["output_dtype"] = SparseType(output)
        return params

    codecs = comm.qcomm_codecs_registry(sharding, device_type, world_size) if comms else None
    return {
        EBC: EmbeddingBagCollectionSharder(fused_params=fused(), qcomm_codecs_registry=codecs),
        EC: EmbeddingCollectionSharder(fused_params=fused(), qcomm_codecs_registry=codecs),
        FPEBC: FeatureProcessedEmbeddingBagCollectionSharder(
            ebc_sharder=EmbeddingBagCollectionSharder(fused_params=fused(), qcomm_codecs_registry=codecs),
            qcomm_codecs_registry=codecs,
        ),
    }


def sharders_offer(sharding: "ShardingConfig", optimizer: "EmbeddingOptimizerConfig",
                   device_type: str = "cuda") -> dict[str, tuple[str, ...]]:
    """recpipe's sharding types that torchrec's sharders offer, by module type (asks them)."""
    offered = {kind: set(sharder.sharding_types("cuda"))
               for kind, sharder in make_sharders(sharding, optimizer, device_type, comms=False).items()}
    return {kind: tuple(t for t in SHARDING_TYPES if t in types) for kind, types in offered.items()}
