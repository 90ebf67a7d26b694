"""Build DistributedModelParallel from config, with torchrec's public sharding APIs.

The plan is explicit (``construct_module_sharding_plan``), one entry per table from
``sharding.default`` / ``sharding.tables``: recpipe does not search for a plan, it
places what the config says, so the same YAML gives the same placement on CPU
(where torchrec's planner offers no row-wise) and on GPU. With
``sharding.placement: planner`` torchrec's partitioner places the shards on the
memory planner's estimates instead. What each config value becomes in torchrec and
FBGEMM (kernels, fused params, cache params, sharders, table_wise ranks) lives in
:mod:`recpipe.table_sharding`, which the memory planner shares.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan
from torchrec.distributed.types import ShardingPlan
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from recpipe.config import PLANNER_ON_CPU, ConfigError, DenseOptimizerConfig, RecpipeConfig
from recpipe.embedding_tables import TableInfo, find_embedding_modules
from recpipe.planner.inputs import inputs_from_config
from recpipe.planner.torchrec_planner import plan_with_torchrec
from recpipe.sharding.data_parallel import DataParallelAcrossRanks
from recpipe.system import local_world_size
from recpipe.table_sharding.cache import cache_params
from recpipe.table_sharding.checks import validated_tables
from recpipe.table_sharding.placement import parameter_sharding_generator, table_row_wise_hosts, table_wise_ranks
from recpipe.table_sharding.precision import apply_weights_precision, precision_warnings, stochastic_rounding
from recpipe.table_sharding.sharders import make_sharders

# Path of the EmbeddingBagCollection inside the built-in model (RecModel.model = DLRM).
EBC_PATH = "model.sparse_arch.embedding_bag_collection"


def sharding_plan(
    model: nn.Module, cfg: RecpipeConfig, world_size: int, device_type: str,
    tables: tuple[TableInfo, ...] | None = None,
) -> ShardingPlan:
    """One module plan per embedding module of ``model`` (found by type), one entry
    per table from ``sharding.default`` / ``sharding.tables``; table_wise tables are
    balanced over all of the model's tables together. ``tables``: the model's
    (:func:`recpipe.table_sharding.checks.validated_tables`), computed when not given."""
    tables = validated_tables(cfg, model, device_type) if tables is None else tables
    ranks = {**table_wise_ranks(cfg.sharding, world_size, tables), **table_row_wise_hosts(cfg.sharding, world_size, tables)}
    sharders = make_sharders(cfg.sharding, cfg.optimizer.embedding, device_type)
    plan = {}
    for fqn, module in find_embedding_modules(model).items():
        mine = [t for t in tables if t.module == fqn]
        generators = {
            t.name: parameter_sharding_generator(cfg.sharding.for_table(t.name), ranks.get(t.name), world_size)
            for t in mine
        }
        module_plan = construct_module_sharding_plan(
            module,
            per_param_sharding=generators,
            sharder=sharders[mine[0].module_type],
            local_size=local_world_size(world_size),
            world_size=world_size,
            device_type=device_type,
        )
        for t in mine:
            ts = cfg.sharding.for_table(t.name)
            module_plan[t.name].cache_params = cache_params(ts, cfg.sharding, cfg.cache_line_locking)
            module_plan[t.name].stochastic_rounding = stochastic_rounding(cfg.sharding, t)
        plan[fqn] = module_plan
    return ShardingPlan(plan)


def planner_placement(
    cfg: RecpipeConfig, world_size: int, device: torch.device, model: nn.Module, tables: tuple[TableInfo, ...]
) -> ShardingPlan:
    """torchrec's partitioner on recpipe's memory estimates (``sharding.placement:
    planner``). Rank 0 plans and broadcasts, so every rank shards identically."""
    if device.type != "cuda":  # recpipe train refuses it before any process starts (recpipe.preflight.check_machine)
        raise ConfigError(PLANNER_ON_CPU)
    box = [plan_with_torchrec(cfg.sharding, cfg.optimizer.embedding, inputs_from_config(cfg, world_size=world_size),
                              model)
           if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    plan = box[0]
    for t in tables:
        plan.plan[t.module][t.name].stochastic_rounding = stochastic_rounding(cfg.sharding, t)
    return plan


def dense_optimizer(model: nn.Module, opt: DenseOptimizerConfig) -> KeyedOptimizer:
    """torch.optim over every parameter that is not updated inside the TBE backward.

    With a schedule that changes the rate (``optimizer.dense.schedule``), SGD's and
    Adagrad's ``lr`` is a 0-dim float32 tensor on the parameters' device, which
    ``recpipe.train.learning_rates`` fills before each step: the steps read it on the device,
    so a captured step (``pipeline.cuda_graphs``, ``pipeline.step_graph``) follows the
    schedule. Their torch paths that do so: fused SGD (foreach SGD passes ``alpha=-lr``,
    read on the host) and foreach Adagrad (its single-tensor step calls ``.item()``); on
    the same values both are bit-identical to the float-``lr`` steps (tests/test_lr_schedule.py).
    Adam keeps a float ``lr``, set on the host."""
    params = dict(in_backward_optimizer_filter(model.named_parameters()))
    lr: float | torch.Tensor = opt.lr
    if not opt.schedule.constant and opt.name in ("sgd", "adagrad") and params:
        lr = torch.tensor(opt.lr, dtype=torch.float32, device=next(iter(params.values())).device)
    on_device = isinstance(lr, torch.Tensor)
    if opt.name == "sgd":
        make = lambda p: torch.optim.SGD(p, lr=lr, weight_decay=opt.weight_decay,  # noqa: E731
                                         **({"fused": True} if on_device else {}))
    elif opt.name == "adagrad":
        make = lambda p: torch.optim.Adagrad(p, lr=lr, eps=opt.eps, weight_decay=opt.weight_decay,  # noqa: E731
                                             **({"foreach": True} if on_device else {}))
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
    tables: tuple[TableInfo, ...]  # the model's embedding tables, in module order


def shard_model(
    model: nn.Module, cfg: RecpipeConfig, device: torch.device, pg: dist.ProcessGroup | None = None,
    extra_fused_params: dict | None = None,
) -> ShardedModel:
    """Shard ``model`` (any module holding torchrec EmbeddingBagCollection,
    EmbeddingCollection or FeatureProcessedEmbeddingBagCollection modules, tables on
    meta) over the default process group; the rest of the model is replicated, its
    gradients averaged as ``sharding.dense_gradients`` says (``data_parallel``).
    ``extra_fused_params`` reach every FBGEMM TBE (``recpipe.table_sharding.sharders.make_sharders``)."""
    world_size = dist.get_world_size(pg)
    tables = validated_tables(cfg, model, device.type)
    apply_weights_precision(cfg.sharding, model, tables)  # before DMP builds the TBEs from the table configs
    if cfg.sharding.placement == "planner":
        plan = planner_placement(cfg, world_size, device, model, tables)
    else:
        plan = sharding_plan(model, cfg, world_size, device.type, tables)
    dmp = DistributedModelParallel(
        module=model, device=device, plan=plan, env=None,
        sharders=list(make_sharders(cfg.sharding, cfg.optimizer.embedding, device.type,
                                    extra_fused_params=extra_fused_params, world_size=world_size).values()),
        data_parallel_wrapper=DataParallelAcrossRanks(cfg.sharding.dense_gradients),
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense_optimizer(dmp, cfg.optimizer.dense)])
    return ShardedModel(model=dmp, optimizer=optimizer, plan=plan, tables=tables)


def check_model_config(cfg: RecpipeConfig, model: nn.Module | None = None, device_type: str = "cuda") -> tuple[TableInfo, ...]:
    """For the launcher, before any process starts: the model's tables (``cfg``'s
    model built on meta unless given) with the config checked against them
    (``ConfigError``, exit code 2), and a warning for every precision option that
    will not take effect on ``device_type``."""
    tables = validated_tables(cfg, model, device_type)
    for line in precision_warnings(cfg.sharding, tables, device_type):
        warnings.warn(line, stacklevel=2)
    return tables


def plan_summary(plan: ShardingPlan, tables: tuple[TableInfo, ...]) -> str:
    """The resolved placement in one line (what ``recpipe train`` prints at start): how many
    tables of each sharding type and kernel, over how many ranks. ``recpipe plan`` prints
    every shard (:func:`plan_table`)."""
    kinds: dict[str, int] = {}
    ranks: set[int] = set()
    for t in tables:
        ps = plan.plan[t.module][t.name]
        kind = f"{ps.sharding_type} ({ps.compute_kernel})"
        kinds[kind] = kinds.get(kind, 0) + 1
        ranks.update(ps.ranks or [])
    where = f" over {len(ranks)} rank{'s' if len(ranks) != 1 else ''}" if ranks else ""
    parts = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"sharding: {len(tables)} table{'s' if len(tables) != 1 else ''}{where}: {parts}"


def plan_table(plan: ShardingPlan, tables: tuple[TableInfo, ...]) -> str:
    """The resolved placement as a fixed-width table, one row per table of every
    embedding module (``tables``: ``ShardedModel.tables``). A ``module`` column appears
    when the model has several."""
    several = len({t.module for t in tables}) > 1
    header = ("table", "rows", "dim", "sharding", "kernel", "ranks", "shards (rows x cols)", "cache")
    header = (("module",) + header) if several else header
    lines = []
    for t in tables:
        ps = plan.plan[t.module][t.name]
        shards = ps.sharding_spec.shards if ps.sharding_spec is not None else []
        sizes = ",".join(f"{s.shard_sizes[0]}x{s.shard_sizes[1]}" for s in shards) or "replicated"
        ranks = ",".join(str(r) for r in (ps.ranks or [])) or "all"
        cache = f"lf={ps.cache_params.load_factor}" if ps.cache_params is not None else "-"
        if ps.cache_params is not None and ps.cache_params.prefetch_pipeline:
            cache += " prefetch"
        row = (t.name, str(t.rows), str(t.dim), ps.sharding_type, ps.compute_kernel, ranks, sizes, cache)
        lines.append(((f"{t.module or '<model>'} ({t.module_type})",) + row) if several else row)
    widths = [max(len(h), *(len(r[i]) for r in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*r) for r in lines]
    return "\n".join(out)
