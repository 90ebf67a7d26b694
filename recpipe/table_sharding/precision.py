"""Each table's precisions: its weights, its HBM cache rows, FBGEMM's stochastic rounding,
and the rules and warnings about them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from recpipe.embedding_tables import find_embedding_modules, table_configs

if TYPE_CHECKING:
    from torch import nn

    from recpipe.config import ShardingConfig
    from recpipe.embedding_tables import TableInfo

# torch, torchrec and FBGEMM are imported by the functions that use them: the planner imports
# this module, and `recpipe plan` loads none of them.

__all__ = [
    "PRECISION_BYTES",
    "TRAINABLE_WEIGHTS",
    "apply_weights_precision",
    "cache_precision",
    "check_precisions",
    "precision_warnings",
    "stochastic_rounding",
    "weights_precision",
]

PRECISION_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
TRAINABLE_WEIGHTS = ("fp32", "fp16")  # FBGEMM's training dispatch (fp8 aside), CPU and CUDA


def weights_precision(sharding: "ShardingConfig", t: "TableInfo") -> str:
    """The table's weight precision: configured, else its table config's data_type."""
    return sharding.for_table(t.name).weights_precision or t.data_type


def cache_precision(sharding: "ShardingConfig", t: "TableInfo") -> str | None:
    """The HBM cache rows' precision of a fused_uvm_caching table (None otherwise)."""
    ts = sharding.for_table(t.name)
    if ts.kernel != "fused_uvm_caching":
        return None
    return ts.cache_precision or weights_precision(sharding, t)


def stochastic_rounding(sharding: "ShardingConfig", t: "TableInfo") -> bool | None:
    """What recpipe passes to FBGEMM for this table: None for fp32 weights (nothing
    to round; FBGEMM's default applies), else the configured value, on by default."""
    if weights_precision(sharding, t) == "fp32":
        return None
    configured = sharding.for_table(t.name).stochastic_rounding
    return True if configured is None else configured


def check_precisions(sharding: "ShardingConfig", tables: "Sequence[TableInfo]") -> list[str]:
    """Problems with the tables' resolved precisions (a model's own data_type
    included): FBGEMM trains fp32 and fp16 weights only, and replicated
    (data_parallel) tables stay fp32."""
    problems = []
    for t in tables:
        ts = sharding.for_table(t.name)
        wp = weights_precision(sharding, t)
        key = sharding.table_key(t.name)
        where = f"{key}.weights_precision" if ts.weights_precision else \
            f"table {t.name!r} ({t.module or '<model>'}): its config's data_type"
        if wp not in TRAINABLE_WEIGHTS:
            problems.append(f"  {where} is {wp!r}; FBGEMM trains fp32 and fp16 embedding weights only")
        elif ts.type == "data_parallel" and wp != "fp32":
            problems.append(f"  {where} is {wp!r} but {key}.type='data_parallel': replicated tables "
                            "are updated by the dense optimizer and stay fp32")
    return problems


def precision_warnings(sharding: "ShardingConfig", tables: "Sequence[TableInfo]", device_type: str) -> list[str]:
    """Configured precision options that will not take effect, one line per key."""
    ignored: dict[tuple[str, str], list[str]] = {}  # (setting, why) -> tables
    for t in tables:
        ts = sharding.for_table(t.name)
        setting = f"{sharding.table_key(t.name)}.stochastic_rounding={str(ts.stochastic_rounding).lower()}"
        if ts.stochastic_rounding is not None and weights_precision(sharding, t) == "fp32":
            ignored.setdefault((setting, "their weights are fp32"), []).append(t.name)
        elif ts.stochastic_rounding and device_type != "cuda":
            ignored.setdefault((setting, "on CPU: FBGEMM's CPU kernels round fp16 updates to nearest"), []).append(t.name)
    out = [f"{setting} is ignored for tables {', '.join(names)}: {why}" for (setting, why), names in ignored.items()]
    comm = sharding.comm_precision
    for direction in ("forward", "backward"):
        if device_type != "cuda" and getattr(comm, direction) == "bf16":
            out.append(f"sharding.comm_precision.{direction}='bf16' runs as fp16 on CPU: torchrec's quantized comms "
                       "have no bf16 over Gloo")
    return out


def apply_weights_precision(sharding: "ShardingConfig", model: "nn.Module", tables: "Sequence[TableInfo]") -> None:
    """Set each table's torchrec config ``data_type`` (what the sharded TBE's
    ``weights_precision`` comes from) and the unsharded weight's dtype to the
    resolved precision, before DistributedModelParallel builds the TBEs."""
    import torch
    from torchrec.types import DataType

    dtypes = {"fp32": torch.float32, "fp16": torch.float16}
    modules = find_embedding_modules(model)
    for t in tables:
        wp = weights_precision(sharding, t)
        if wp == t.data_type:
            continue
        (config,) = [c for c in table_configs(modules[t.module]) if c.name == t.name]
        config.data_type = DataType(wp.upper())
        for name, param in modules[t.module].named_parameters():
            if name.endswith(f".{t.name}.weight"):
                param.data = param.data.to(dtypes[wp])
