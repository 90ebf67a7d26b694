"""The sharding rules that need a model's real tables: every configured table exists,
its sharding type is one its module's sharder offers on the device, column_wise dims
split over the ranks, and its precision is one FBGEMM trains. Every problem is a
``ConfigError`` (exit code 2), raised before any process starts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from recpipe.embedding_tables import (EC, MODULE_TYPES, check_table_names, model_on_meta, model_tables,
                                       unsupported_modules)
from recpipe.errors import ConfigError
from recpipe.table_sharding.precision import check_precisions
from recpipe.table_sharding.sharders import SHARDER_TYPES, sharders_offer

if TYPE_CHECKING:
    from torch import nn

    from recpipe.config import RecpipeConfig, ShardingConfig
    from recpipe.embedding_tables import TableInfo

__all__ = ["check_sharding_support", "check_tables", "supported_sharding_types", "validated_tables"]

# (module type, sharding type) -> why it cannot run on CPU, though torchrec lists it.
_NOT_ON_CPU = {
    (EC, "data_parallel"): "FBGEMM's CPU dense kernel pools the ids despite PoolingMode.NONE (fbgemm-gpu 1.8), so "
                           "sequence embeddings come out one per sample",
}


def supported_sharding_types(offered: tuple[str, ...], module_type: str, device_type: str) -> list[str]:
    """Of the sharding types ``offered`` for ``module_type``, those that run on ``device_type``."""
    return [t for t in offered if not (device_type != "cuda" and (module_type, t) in _NOT_ON_CPU)]


def check_sharding_support(sharding: "ShardingConfig", tables: "Sequence[TableInfo]", device_type: str = "cuda",
                           offered: dict[str, tuple[str, ...]] | None = None) -> None:
    """Every table's configured sharding type is one its module's sharder supports on
    ``device_type`` (``offered``: by module type, default
    :data:`recpipe.table_sharding.sharders.SHARDER_TYPES`); ``ConfigError`` naming the key,
    the table, its module and the allowed types otherwise."""
    offered = SHARDER_TYPES if offered is None else offered
    problems = []
    for t in tables:
        ts = sharding.for_table(t.name)
        allowed = supported_sharding_types(offered[t.module_type], t.module_type, device_type)
        if ts.type not in allowed:
            why = _NOT_ON_CPU.get((t.module_type, ts.type))
            problems.append(
                f"  {sharding.table_key(t.name)}.type={ts.type!r}: table {t.name!r} is in {t.module_type} "
                f"{t.module or '<model>'!r}, which recpipe shards on {device_type} only as {', '.join(allowed)}"
                + (f" ({why})" if why else "")
            )
    if problems:
        raise ConfigError("invalid config for this model:\n" + "\n".join(problems))


def validated_tables(
    cfg: "RecpipeConfig", model: "nn.Module | None" = None, device_type: str = "cuda"
) -> tuple[TableInfo, ...]:
    """The tables of ``model`` (default: ``cfg``'s model, built on meta), with every
    sharding rule that needs the real tables checked (:func:`check_tables`).
    ``recpipe train`` (with the run's device type) and ``recpipe plan`` (GPUs) call it
    before any process starts; every problem is a ``ConfigError`` (exit code 2)."""
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
    offered = sharders_offer(cfg.sharding, cfg.optimizer.embedding, device_type)
    return check_tables(cfg.sharding, cfg.distributed.nproc, tables, device_type, offered=offered)


def check_tables(sharding: "ShardingConfig", world_size: int, tables: tuple[TableInfo, ...], device_type: str = "cuda",
                 offered: dict[str, tuple[str, ...]] | None = None) -> tuple[TableInfo, ...]:
    """``tables`` with every sharding rule that needs the real tables checked: names under
    ``sharding.tables`` / ``sharding.mean_pooling_factors`` exist, each sharding type is one
    its module's sharder offers (``offered``, default
    :data:`recpipe.table_sharding.sharders.SHARDER_TYPES`) on ``device_type``, column_wise
    dims split over the ``world_size`` ranks (``distributed.nproc``), every table's precision (its own
    data_type included) is one FBGEMM trains. ConfigError otherwise."""
    check_table_names(sharding, tables)
    check_sharding_support(sharding, tables, device_type, offered)
    W = world_size
    problems = [
        f"  {sharding.table_key(t.name)}.type='column_wise' splits table {t.name!r} (dim {t.dim}) over "
        f"distributed.nproc={W} ranks; it must divide evenly"
        for t in tables if sharding.for_table(t.name).type == "column_wise" and t.dim % W
    ]
    problems += check_precisions(sharding, tables)
    if problems:
        raise ConfigError("invalid config for this model:\n" + "\n".join(problems))
    return tables
