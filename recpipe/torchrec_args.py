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

import logging
from typing import TYPE_CHECKING, Callable, Sequence

from recpipe.embedding_tables import (EBC, EC, FPEBC, MODULE_TYPES, check_table_names, model_on_meta, model_tables,
                                       unsupported_modules)
from recpipe.system import local_world_size

if TYPE_CHECKING:
    from torch import nn
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import CacheParams, ModuleSharder

    from recpipe.config import EmbeddingOptimizerConfig, RecpipeConfig, TableSharding
    from recpipe.embedding_tables import TableInfo

__all__ = [
    "CastCodec",
    "DEFAULT_CACHE_LOAD_FACTOR",
    "KERNELS",
    "PRECISION_BYTES",
    "SHARDER_TYPES",
    "apply_weights_precision",
    "cache_params",
    "cache_precision",
    "check_precisions",
    "check_sharding_support",
    "check_tables",
    "sharders_offer",
    "embedding_fused_params",
    "make_sharder",
    "make_sharders",
    "parameter_sharding_generator",
    "precision_warnings",
    "qcomm_codecs_registry",
    "stochastic_rounding",
    "tbe_output_precision",
    "supported_sharding_types",
    "placed_type",
    "table_wise_ranks",
    "weights_precision",
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


def make_sharder(cfg: "RecpipeConfig", device_type: str = "cuda") -> "EmbeddingBagCollectionSharder":
    """The EmbeddingBagCollection sharder (what the built-in DLRM needs)."""
    return make_sharders(cfg, device_type)[EBC]


def make_sharders(
    cfg: "RecpipeConfig", device_type: str = "cuda", *, comms: bool = True, extra_fused_params: dict | None = None,
    world_size: int = 1,
) -> dict[str, "ModuleSharder"]:
    """One torchrec sharder per module type recpipe shards (keys: the type names of
    :data:`recpipe.embedding_tables.MODULE_TYPES`), all with the same fused params
    and the same quantized-comm codecs (``sharding.comm_precision``; none when both
    directions are fp32; ``comms=False`` leaves them out, for checks that only ask
    the sharders what they support). Each gets its own fused-params dict: torchrec's
    lookups may add keys to the one they hold. ``extra_fused_params``: more TBE keyword
    arguments (the bench turns on FBGEMM's cache statistics, ``gather_uvm_cache_stats``).
    ``world_size``: the ranks the model is sharded over (:func:`tbe_output_precision`
    needs it; building a plan does not)."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder

    output = tbe_output_precision(cfg, world_size, device_type) if comms else None

    def fused() -> dict:
        params = {**embedding_fused_params(cfg.optimizer.embedding, cfg), **(extra_fused_params or {})}
        if output is not None:
            from fbgemm_gpu.split_embedding_configs import SparseType

            params["output_dtype"] = SparseType(output)
        return params

    codecs = qcomm_codecs_registry(cfg, device_type, world_size) if comms else None
    return {
        EBC: EmbeddingBagCollectionSharder(fused_params=fused(), qcomm_codecs_registry=codecs),
        EC: EmbeddingCollectionSharder(fused_params=fused(), qcomm_codecs_registry=codecs),
        FPEBC: FeatureProcessedEmbeddingBagCollectionSharder(
            ebc_sharder=EmbeddingBagCollectionSharder(fused_params=fused(), qcomm_codecs_registry=codecs),
            qcomm_codecs_registry=codecs,
        ),
    }


def tbe_output_precision(cfg: "RecpipeConfig", world_size: int, device_type: str = "cuda") -> str | None:
    """The precision the TBEs write their pooled outputs in, or None (fp32).

    When ``sharding.comm_precision`` sends both directions in the same half precision
    over several ranks, the TBEs write their outputs in it (FBGEMM ``output_dtype``)
    and :class:`CastCodec` replaces torchrec's codecs: nothing is encoded before the
    all-to-all (the TBE's output is what travels), the received values are decoded to
    fp32 for the model, the gradient is encoded once and handed to the TBE backward in
    the half precision (FBGEMM accumulates it in fp32). Two conversions a step instead
    of torchrec's four, and the TBEs write half the bytes. On one rank torchrec's
    all-to-alls return their input without decoding, so the outputs stay fp32 there;
    so do they with a data_parallel table anywhere: the TBE setting reaches its lookup
    too, whose output goes to the model without an all-to-all (torchrec's codecs then).
    On CPU FBGEMM writes fp16 only, as torchrec's codecs send bf16 as fp16 there."""
    comm = cfg.sharding.comm_precision
    if world_size <= 1 or comm.forward != comm.backward or comm.forward == "fp32":
        return None
    if "data_parallel" in {cfg.sharding.default.type, *(t.type for t in cfg.sharding.tables.values())}:
        return None
    return "fp16" if device_type != "cuda" else comm.forward


class CastCodec:
    """A torchrec ``QuantizedCommCodec`` that only casts: values travel as ``wire``;
    ``decode`` casts them to ``decoded`` (None: leaves them as they came)."""

    def __init__(self, wire: "torch.dtype", decoded: "torch.dtype | None") -> None:
        self.wire, self.decoded = wire, decoded

    def __repr__(self) -> str:
        return f"CastCodec(wire={self.wire}, decoded={self.decoded})"

    def encode(self, input_tensor: "torch.Tensor", ctx: object = None) -> "torch.Tensor":
        return input_tensor if input_tensor.dtype == self.wire else input_tensor.to(self.wire)

    def decode(self, input_grad: "torch.Tensor", ctx: object = None) -> "torch.Tensor":
        if self.decoded is None or input_grad.dtype == self.decoded:
            return input_grad
        return input_grad.to(self.decoded)

    @property
    def quantized_dtype(self) -> "torch.dtype":
        return self.wire

    def calc_quantized_size(self, input_len: int, ctx: object = None) -> int:
        return input_len

    def create_context(self) -> None:
        return None

    def padded_size(self, input_tensor: "torch.Tensor", dim_per_rank: list[int], my_rank: int,
                    qcomm_ctx: object) -> tuple[int, int]:
        return (input_tensor.shape[1] if input_tensor.dim() > 1 else input_tensor.shape[0]), 0


def qcomm_codecs_registry(cfg: "RecpipeConfig", device_type: str = "cuda", world_size: int = 1) -> dict | None:
    """The quantized-comm codecs for ``sharding.comm_precision`` (pooled and sequence
    all-to-alls, reduce-scatter), or None when both directions are fp32: recpipe's
    :class:`CastCodec` pair where the TBEs write the wire precision themselves
    (:func:`tbe_output_precision`), else torchrec's codecs. On CPU torchrec replaces
    bf16 by fp16 (Gloo); :func:`precision_warnings` says so."""
    comm = cfg.sharding.comm_precision
    if comm.forward == "fp32" and comm.backward == "fp32":
        return None
    import torch
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
    from torchrec.distributed.types import CommOp, QuantizedCommCodecs

    output = tbe_output_precision(cfg, world_size, device_type)
    if output is not None:
        wire = {"fp16": torch.float16, "bf16": torch.bfloat16}[output]
        pair = lambda: QuantizedCommCodecs(forward=CastCodec(wire, torch.float32), backward=CastCodec(wire, None))  # noqa: E731
        ops = (CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL, CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER,
               CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL)
        return {op.name: pair() for op in ops}

    config = QCommsConfig(forward_precision=CommType(comm.forward), backward_precision=CommType(comm.backward))
    # torchrec logs its bf16 -> fp16 fallback on CPU to the root logger once per comm
    # op and sharder; recpipe's launcher warns once instead (precision_warnings).
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        return get_qcomm_codecs_registry(config, device=torch.device(device_type))
    finally:
        root.setLevel(level)


# ------------------------------------------------------------------ precision
PRECISION_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
TRAINABLE_WEIGHTS = ("fp32", "fp16")  # FBGEMM's training dispatch (fp8 aside), CPU and CUDA


def weights_precision(cfg: "RecpipeConfig", t: "TableInfo") -> str:
    """The table's weight precision: configured, else its table config's data_type."""
    return cfg.sharding.for_table(t.name).weights_precision or t.data_type


def cache_precision(cfg: "RecpipeConfig", t: "TableInfo") -> str | None:
    """The HBM cache rows' precision of a fused_uvm_caching table (None otherwise)."""
    ts = cfg.sharding.for_table(t.name)
    if ts.kernel != "fused_uvm_caching":
        return None
    return ts.cache_precision or weights_precision(cfg, t)


def stochastic_rounding(cfg: "RecpipeConfig", t: "TableInfo") -> bool | None:
    """What recpipe passes to FBGEMM for this table: None for fp32 weights (nothing
    to round; FBGEMM's default applies), else the configured value, on by default."""
    if weights_precision(cfg, t) == "fp32":
        return None
    configured = cfg.sharding.for_table(t.name).stochastic_rounding
    return True if configured is None else configured


def check_precisions(cfg: "RecpipeConfig", tables: "Sequence[TableInfo]") -> list[str]:
    """Problems with the tables' resolved precisions (a model's own data_type
    included): FBGEMM trains fp32 and fp16 weights only, and replicated
    (data_parallel) tables stay fp32."""
    problems = []
    for t in tables:
        ts = cfg.sharding.for_table(t.name)
        wp = weights_precision(cfg, t)
        where = f"{_key(cfg, t.name)}.weights_precision" if ts.weights_precision else \
            f"table {t.name!r} ({t.module or '<model>'}): its config's data_type"
        if wp not in TRAINABLE_WEIGHTS:
            problems.append(f"  {where} is {wp!r}; FBGEMM trains fp32 and fp16 embedding weights only")
        elif ts.type == "data_parallel" and wp != "fp32":
            problems.append(f"  {where} is {wp!r} but {_key(cfg, t.name)}.type='data_parallel': replicated tables "
                            "are updated by the dense optimizer and stay fp32")
    return problems


def precision_warnings(cfg: "RecpipeConfig", tables: "Sequence[TableInfo]", device_type: str) -> list[str]:
    """Configured precision options that will not take effect, one line per key."""
    ignored: dict[tuple[str, str], list[str]] = {}  # (setting, why) -> tables
    for t in tables:
        ts = cfg.sharding.for_table(t.name)
        setting = f"{_key(cfg, t.name)}.stochastic_rounding={str(ts.stochastic_rounding).lower()}"
        if ts.stochastic_rounding is not None and weights_precision(cfg, t) == "fp32":
            ignored.setdefault((setting, "their weights are fp32"), []).append(t.name)
        elif ts.stochastic_rounding and device_type != "cuda":
            ignored.setdefault((setting, "on CPU: FBGEMM's CPU kernels round fp16 updates to nearest"), []).append(t.name)
    out = [f"{setting} is ignored for tables {', '.join(names)}: {why}" for (setting, why), names in ignored.items()]
    comm = cfg.sharding.comm_precision
    for direction in ("forward", "backward"):
        if device_type != "cuda" and getattr(comm, direction) == "bf16":
            out.append(f"sharding.comm_precision.{direction}='bf16' runs as fp16 on CPU: torchrec's quantized comms "
                       "have no bf16 over Gloo")
    return out


def apply_weights_precision(cfg: "RecpipeConfig", model: "nn.Module", tables: "Sequence[TableInfo]") -> None:
    """Set each table's torchrec config ``data_type`` (what the sharded TBE's
    ``weights_precision`` comes from) and the unsharded weight's dtype to the
    resolved precision, before DistributedModelParallel builds the TBEs."""
    import torch
    from torchrec.types import DataType

    from recpipe.embedding_tables import find_embedding_modules, table_configs

    dtypes = {"fp32": torch.float32, "fp16": torch.float16}
    modules = find_embedding_modules(model)
    for t in tables:
        wp = weights_precision(cfg, t)
        if wp == t.data_type:
            continue
        (config,) = [c for c in table_configs(modules[t.module]) if c.name == t.name]
        config.data_type = DataType(wp.upper())
        for name, param in modules[t.module].named_parameters():
            if name.endswith(f".{t.name}.weight"):
                param.data = param.data.to(dtypes[wp])


def _key(cfg: "RecpipeConfig", name: str) -> str:
    return f"sharding.tables.{name}" if name in cfg.sharding.tables else "sharding.default"


# (module type, sharding type) -> why it cannot run on CPU, though torchrec lists it.
_NOT_ON_CPU = {
    (EC, "data_parallel"): "FBGEMM's CPU dense kernel pools the ids despite PoolingMode.NONE (fbgemm-gpu 1.8), so "
                           "sequence embeddings come out one per sample",
}


# recpipe's sharding types that torchrec's sharder of each module type offers on CUDA
# (``ModuleSharder.sharding_types("cuda")``, torchrec 1.6.1 to 1.8; recpipe also runs
# row_wise on CPU, which torchrec's CPU list omits): what the planner checks the built-in
# model's tables against without loading torchrec. tests/test_planner.py holds it to
# torchrec's sharders, which a model built on meta is checked against (``validated_tables``).
SHARDER_TYPES = {
    EBC: ("table_wise", "row_wise", "table_row_wise", "column_wise", "data_parallel"),
    EC: ("table_wise", "row_wise", "column_wise", "data_parallel"),
    FPEBC: ("table_wise", "row_wise", "table_row_wise", "column_wise", "data_parallel"),
}


def sharders_offer(cfg: "RecpipeConfig", device_type: str = "cuda") -> dict[str, tuple[str, ...]]:
    """recpipe's sharding types that torchrec's sharders offer, by module type (asks them)."""
    from recpipe.config import SHARDING_TYPES

    offered = {kind: set(sharder.sharding_types("cuda"))
               for kind, sharder in make_sharders(cfg, device_type, comms=False).items()}
    return {kind: tuple(t for t in SHARDING_TYPES if t in types) for kind, types in offered.items()}


def supported_sharding_types(offered: tuple[str, ...], module_type: str, device_type: str) -> list[str]:
    """Of the sharding types ``offered`` for ``module_type``, those that run on ``device_type``."""
    return [t for t in offered if not (device_type != "cuda" and (module_type, t) in _NOT_ON_CPU)]


def check_sharding_support(cfg: "RecpipeConfig", tables: "Sequence[TableInfo]", device_type: str = "cuda",
                           offered: dict[str, tuple[str, ...]] | None = None) -> None:
    """Every table's configured sharding type is one its module's sharder supports on
    ``device_type`` (``offered``: by module type, default :data:`SHARDER_TYPES`);
    ``ConfigError`` naming the key, the table, its module and the allowed types otherwise."""
    from recpipe.config import ConfigError

    offered = SHARDER_TYPES if offered is None else offered
    problems = []
    for t in tables:
        ts = cfg.sharding.for_table(t.name)
        allowed = supported_sharding_types(offered[t.module_type], t.module_type, device_type)
        if ts.type not in allowed:
            key = _key(cfg, t.name)
            why = _NOT_ON_CPU.get((t.module_type, ts.type))
            problems.append(
                f"  {key}.type={ts.type!r}: table {t.name!r} is in {t.module_type} {t.module or '<model>'!r}, "
                f"which recpipe shards on {device_type} only as {', '.join(allowed)}" + (f" ({why})" if why else "")
            )
    if problems:
        raise ConfigError("invalid config for this model:\n" + "\n".join(problems))


def placed_type(t: "TableSharding", world_size: int) -> str:
    """The sharding type recpipe asks torchrec for: the configured one, except that on
    one rank a row_wise table is placed table_wise. Both hold every row on the one GPU;
    as table_wise, torchrec batches the table into one TBE with the other table_wise
    tables: per step one lookup and one output dist fewer, and no row-wise bucketize
    of the ids. The numbers are the same (tests/test_pipelines.py, tests/test_sharding.py;
    with fp16 weights, stochastic rounding draws from the merged TBE's random stream instead)."""
    return "table_wise" if world_size == 1 and t.type in ("row_wise", "table_row_wise") else t.type


def table_wise_ranks(cfg: "RecpipeConfig", world_size: int, tables: "Sequence[TableInfo]") -> dict[str, int]:
    """Rank of each table placed table_wise (``placed_type``) of ``tables`` (the
    model's, in model order): the configured one, else the least-loaded rank (largest
    tables first, load = rows), so placement is deterministic."""
    loads = [0] * world_size
    placed: dict[str, int] = {}
    resolved = {t.name: cfg.sharding.for_table(t.name) for t in tables}
    rows = {t.name: t.rows for t in tables}
    tw = {name for name, t in resolved.items() if placed_type(t, world_size) == "table_wise"}
    for name, t in resolved.items():
        if name in tw and t.rank is not None:
            placed[name] = t.rank
            loads[t.rank] += rows[name]
    free = [n for n, t in resolved.items() if n in tw and t.rank is None]
    for name in sorted(free, key=lambda n: (-rows[n], n)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        placed[name] = rank
        loads[rank] += rows[name]
    return placed


def _with_kernel(generator: Callable, kernel: str) -> Callable:
    """``generator`` with its ParameterSharding's compute kernel set to ``kernel`` (torchrec's
    ``table_row_wise`` takes none and picks its own)."""

    def with_kernel(*args, **kwargs):
        sharding = generator(*args, **kwargs)
        sharding.compute_kernel = kernel
        return sharding

    return with_kernel


def table_row_wise_hosts(cfg: "RecpipeConfig", world_size: int, tables: "Sequence[TableInfo]") -> dict[str, int]:
    """Host of each table_row_wise table of ``tables``: the least-loaded host (largest
    tables first, load = rows), so placement is deterministic."""
    hosts = world_size // local_world_size(world_size)
    loads = [0] * hosts
    placed: dict[str, int] = {}
    twrw = [t for t in tables if cfg.sharding.for_table(t.name).type == "table_row_wise"]
    for t in sorted(twrw, key=lambda t: (-t.rows, t.name)):
        host = min(range(hosts), key=lambda h: (loads[h], h))
        placed[t.name] = host
        loads[host] += t.rows
    return placed


def parameter_sharding_generator(t: "TableSharding", rank: int | None, world_size: int) -> Callable:
    """torchrec's ``sharding_plan`` generator for one table (``rank``: the rank of a table
    placed table_wise, the host of a table_row_wise one; the type is ``placed_type``'s)."""
    from torchrec.distributed.sharding_plan import column_wise, data_parallel, row_wise, table_row_wise, table_wise

    kernel = KERNELS[t.kernel]
    kind = placed_type(t, world_size)
    if kind == "table_wise":
        return table_wise(rank=rank, compute_kernel=kernel)
    if kind == "row_wise":
        return row_wise(compute_kernel=kernel)
    if kind == "table_row_wise":
        return _with_kernel(table_row_wise(host_index=rank or 0), kernel)
    if kind == "column_wise":
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
    precision = None
    if t.cache_precision is not None:  # else torchrec's default: the weights' precision
        from torchrec.types import DataType

        precision = DataType(t.cache_precision.upper())
    return CacheParams(
        algorithm=CacheAlgorithm.LRU,
        load_factor=t.cache_load_factor if t.cache_load_factor is not None else DEFAULT_CACHE_LOAD_FACTOR,
        precision=precision,
        prefetch_pipeline=cfg.cache_line_locking,
        multipass_prefetch_config=multipass,
    )


def validated_tables(
    cfg: "RecpipeConfig", model: "nn.Module | None" = None, device_type: str = "cuda"
) -> tuple[TableInfo, ...]:
    """The tables of ``model`` (default: ``cfg``'s model, built on meta), with every
    sharding rule that needs the real tables checked (:func:`check_tables`).
    ``recpipe train`` (with the run's device type) and ``recpipe plan`` (GPUs) call it
    before any process starts; every problem is a ``ConfigError`` (exit code 2)."""
    from recpipe.config import ConfigError

    if model is None:
        model = model_on_meta(cfg)
    source = f"model.factory={cfg.model.factory!r}" if cfg.model.factory else "the built-in model"
    bad = unsupported_modules(model)
    if bad:
        listed = ", ".join(f"{fqn or '<model>'} ({kind})" for fqn, kind in bad.items())
        raise ConfigError(f"{source}: recpipe cannot shard {listed}; it shards {', '.join(MODULE_TYPES)}")
    try:
        tables = model_tables(model)
    except ValueError as err:
        raise ConfigError(f"{source}: {err}") from None
    if not tables:
        raise ConfigError(f"{source}: the model holds no {', '.join(MODULE_TYPES)}; there is nothing to shard")
    return check_tables(cfg, tables, device_type, offered=sharders_offer(cfg, device_type))


def check_tables(cfg: "RecpipeConfig", tables: tuple[TableInfo, ...], device_type: str = "cuda",
                 offered: dict[str, tuple[str, ...]] | None = None) -> tuple[TableInfo, ...]:
    """``tables`` with every sharding rule that needs the real tables checked: names under
    ``sharding.tables`` / ``sharding.mean_pooling_factors`` exist, each sharding type is one
    its module's sharder offers (``offered``, default :data:`SHARDER_TYPES`) on
    ``device_type``, column_wise dims split over the ranks, every table's precision (its own
    data_type included) is one FBGEMM trains. ConfigError otherwise."""
    from recpipe.config import ConfigError

    check_table_names(cfg, tables)
    check_sharding_support(cfg, tables, device_type, offered)
    W = cfg.distributed.nproc
    problems = [
        f"  {_key(cfg, t.name)}.type='column_wise' splits table {t.name!r} (dim {t.dim}) over distributed.nproc={W} "
        "ranks; it must divide evenly"
        for t in tables if cfg.sharding.for_table(t.name).type == "column_wise" and t.dim % W
    ]
    problems += check_precisions(cfg, tables)
    if problems:
        raise ConfigError("invalid config for this model:\n" + "\n".join(problems))
    return tables
