"""Build DistributedModelParallel from config, with torchrec's public sharding APIs.

The plan is explicit (``construct_module_sharding_plan``), one entry per table from
``sharding.default`` / ``sharding.tables``: recpipe does not search for a plan, it
places what the config says, so the same YAML gives the same placement on CPU
(where torchrec's planner offers no row-wise) and on GPU. The planner issue plugs
its estimates in on top of this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import CacheParams, ShardingPlan
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from recpipe.config import DenseOptimizerConfig, EmbeddingOptimizerConfig, RecpipeConfig, TableSharding
from recpipe.models import RecModel

# Path of the EmbeddingBagCollection inside RecModel (RecModel.model = DLRM).
EBC_PATH = "model.sparse_arch.embedding_bag_collection"

_KERNEL = {"fused": "fused", "fused_uvm": "fused_uvm", "fused_uvm_caching": "fused_uvm_caching", "dense": "dense"}
_EMB_OPT = {
    "sgd": EmbOptimType.EXACT_SGD,
    "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "adam": EmbOptimType.ADAM,
}


def embedding_fused_params(opt: EmbeddingOptimizerConfig, cfg: RecpipeConfig) -> dict:
    """Keyword arguments that reach every FBGEMM TBE (optimizer fused into backward)."""
    params: dict = {
        "optimizer": _EMB_OPT[opt.name],
        "learning_rate": opt.lr,
        "eps": opt.eps,
        "weight_decay": opt.weight_decay,
    }
    if opt.name == "adam":
        params.update(beta1=opt.beta1, beta2=opt.beta2)
    if cfg.sharding.uvm_host_mapped:
        params["uvm_host_mapped"] = True
    return params


def table_wise_ranks(cfg: RecpipeConfig, world_size: int) -> dict[str, int]:
    """Rank of each table_wise table: the configured one, else the least-loaded rank
    (largest tables first, load = rows x dim), so placement is deterministic."""
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


def _cache_params(t: TableSharding, cfg: RecpipeConfig) -> CacheParams | None:
    if t.kernel != "fused_uvm_caching":
        return None
    # Both live here in fbgemm-gpu 1.6 and 1.8 (1.8 also has fbgemm_gpu.tbe.cache).
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm, MultiPassPrefetchConfig

    multipass = None
    if cfg.sharding.prefetch_passes > 1:
        multipass = MultiPassPrefetchConfig(
            num_passes=cfg.sharding.prefetch_passes,
            min_splitable_pass_size=cfg.sharding.prefetch_min_pass_size,
        )
    return CacheParams(
        algorithm=CacheAlgorithm.LRU,
        load_factor=t.cache_load_factor if t.cache_load_factor is not None else 0.2,
        prefetch_pipeline=cfg.sharding.prefetch_pipeline,
        multipass_prefetch_config=multipass,
    )


def sharding_plan(model: RecModel, cfg: RecpipeConfig, world_size: int, device_type: str) -> ShardingPlan:
    ebc = model.get_submodule(EBC_PATH)
    ranks = table_wise_ranks(cfg, world_size)
    generators = {}
    for name, t in cfg.table_sharding().items():
        kernel = _KERNEL[t.kernel]
        if t.type == "table_wise":
            generators[name] = table_wise(rank=ranks[name], compute_kernel=kernel)
        elif t.type == "row_wise":
            generators[name] = row_wise(compute_kernel=kernel)
        elif t.type == "column_wise":
            generators[name] = column_wise(ranks=list(range(world_size)), compute_kernel=kernel)
        else:
            generators[name] = data_parallel()
    module_plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding=generators,
        sharder=make_sharder(cfg),
        local_size=world_size,
        world_size=world_size,
        device_type=device_type,
    )
    for name, t in cfg.table_sharding().items():
        module_plan[name].cache_params = _cache_params(t, cfg)
    return ShardingPlan({EBC_PATH: module_plan})


def planner_placement(cfg: RecpipeConfig, world_size: int, device: torch.device) -> ShardingPlan:
    """torchrec's partitioner on recpipe's memory estimates (``sharding.placement:
    planner``). Rank 0 plans and broadcasts, so every rank shards identically."""
    from recpipe.planner.estimator import plan_with_torchrec
    from recpipe.planner.spec import inputs_from_config

    if device.type != "cuda":
        raise ValueError("sharding.placement='planner' places shards on GPUs; use placement 'config' on CPU")
    box = [plan_with_torchrec(cfg, inputs_from_config(cfg, world_size=world_size)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def make_sharder(cfg: RecpipeConfig, extra_fused_params: dict | None = None) -> EmbeddingBagCollectionSharder:
    """``extra_fused_params``: more TBE keyword arguments (the bench turns on FBGEMM's
    cache statistics, ``gather_uvm_cache_stats``)."""
    params = {**embedding_fused_params(cfg.optimizer.embedding, cfg), **(extra_fused_params or {})}
    return EmbeddingBagCollectionSharder(fused_params=params)


def dense_optimizer(model: nn.Module, opt: DenseOptimizerConfig) -> KeyedOptimizer:
    """torch.optim over every parameter that is not updated inside the TBE backward."""
    params = dict(in_backward_optimizer_filter(model.named_parameters()))
    if opt.name == "sgd":
        make = lambda p: torch.optim.SGD(p, lr=opt.lr, weight_decay=opt.weight_decay)  # noqa: E731
    elif opt.name == "adagrad":
        make = lambda p: torch.optim.Adagrad(p, lr=opt.lr, eps=opt.eps, weight_decay=opt.weight_decay)  # noqa: E731
    else:
        make = lambda p: torch.optim.Adam(  # noqa: E731
            p, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay
        )
    return KeyedOptimizerWrapper(params, make)


@dataclass
class ShardedModel:
    model: DistributedModelParallel
    optimizer: CombinedOptimizer  # fused embedding optimizer + dense optimizer
    plan: ShardingPlan


def shard_model(
    model: RecModel, cfg: RecpipeConfig, device: torch.device, pg: dist.ProcessGroup | None = None,
    extra_fused_params: dict | None = None,
) -> ShardedModel:
    """Shard ``model`` (embedding tables on meta) over the default process group;
    ``extra_fused_params`` reach every FBGEMM TBE (``make_sharder``)."""
    world_size = dist.get_world_size(pg)
    if cfg.sharding.placement == "planner":
        plan = planner_placement(cfg, world_size, device)
    else:
        plan = sharding_plan(model, cfg, world_size, device.type)
    dmp = DistributedModelParallel(
        module=model, device=device, plan=plan, sharders=[make_sharder(cfg, extra_fused_params)], env=None
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense_optimizer(dmp, cfg.optimizer.dense)])
    return ShardedModel(model=dmp, optimizer=optimizer, plan=plan)


def plan_table(plan: ShardingPlan, cfg: RecpipeConfig) -> str:
    """The resolved placement as a fixed-width table, one row per table."""
    module_plan = plan.plan[EBC_PATH]
    rows = dict(zip(cfg.model.table_names, cfg.model.num_embeddings_per_feature))
    header = ("table", "rows", "dim", "sharding", "kernel", "ranks", "shards (rows x cols)", "cache")
    lines = []
    for name in cfg.model.table_names:
        ps = module_plan[name]
        shards = ps.sharding_spec.shards if ps.sharding_spec is not None else []
        sizes = ",".join(f"{s.shard_sizes[0]}x{s.shard_sizes[1]}" for s in shards) or "replicated"
        ranks = ",".join(str(r) for r in (ps.ranks or [])) or "all"
        cache = f"lf={ps.cache_params.load_factor}" if ps.cache_params is not None else "-"
        if ps.cache_params is not None and ps.cache_params.prefetch_pipeline:
            cache += " prefetch"
        lines.append((name, str(rows[name]), str(cfg.model.embedding_dim), ps.sharding_type, ps.compute_kernel, ranks, sizes, cache))
    widths = [max(len(h), *(len(r[i]) for r in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*r) for r in lines]
    return "\n".join(out)
