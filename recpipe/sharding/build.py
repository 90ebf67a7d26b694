"""Build DistributedModelParallel from config, with torchrec's public sharding APIs.

The plan is explicit (``construct_module_sharding_plan``), one entry per table from
``sharding.default`` / ``sharding.tables``: recpipe does not search for a plan, it
places what the config says, so the same YAML gives the same placement on CPU
(where torchrec's planner offers no row-wise) and on GPU. With
``sharding.placement: planner`` torchrec's partitioner places the shards on the
memory planner's estimates instead. What each config value becomes in torchrec and
FBGEMM (kernels, fused params, cache params, sharders, table_wise ranks) lives in
:mod:`recpipe.torchrec_args`, which the memory planner shares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan
from torchrec.distributed.types import ShardingPlan
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from recpipe.config import DenseOptimizerConfig, RecpipeConfig
from recpipe.models import RecModel
from recpipe.torchrec_args import cache_params, make_sharder, parameter_sharding_generator, table_wise_ranks

# Path of the EmbeddingBagCollection inside RecModel (RecModel.model = DLRM).
EBC_PATH = "model.sparse_arch.embedding_bag_collection"


def sharding_plan(model: RecModel, cfg: RecpipeConfig, world_size: int, device_type: str) -> ShardingPlan:
    ebc = model.get_submodule(EBC_PATH)
    ranks = table_wise_ranks(cfg, world_size)
    generators = {
        name: parameter_sharding_generator(t, ranks.get(name), world_size) for name, t in cfg.table_sharding().items()
    }
    module_plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding=generators,
        sharder=make_sharder(cfg),
        local_size=world_size,
        world_size=world_size,
        device_type=device_type,
    )
    for name, t in cfg.table_sharding().items():
        module_plan[name].cache_params = cache_params(t, cfg)
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
    model: RecModel, cfg: RecpipeConfig, device: torch.device, pg: dist.ProcessGroup | None = None
) -> ShardedModel:
    """Shard ``model`` (embedding tables on meta) over the default process group."""
    world_size = dist.get_world_size(pg)
    if cfg.sharding.placement == "planner":
        plan = planner_placement(cfg, world_size, device)
    else:
        plan = sharding_plan(model, cfg, world_size, device.type)
    dmp = DistributedModelParallel(
        module=model, device=device, plan=plan, sharders=[make_sharder(cfg)], env=None
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
