"""The embedding tables of any model, found by module type (no tracing).

recpipe shards every torchrec ``EmbeddingBagCollection`` (weighted or not),
``EmbeddingCollection`` (sequence embeddings: one vector per id, no pooling) and
``FeatureProcessedEmbeddingBagCollection`` anywhere in a model's tree; the
outermost one counts (the EmbeddingBagCollection inside a
FeatureProcessedEmbeddingBagCollection is part of it). :func:`model_tables` lists
their tables as plain data (:class:`TableInfo`), which is what
:mod:`recpipe.sharding` resolves ``sharding.tables.<name>`` against and what the
memory planner plans. Build the model on the meta device for this: nothing is
allocated.

The memory planner reads this module without torch (``recpipe plan``): torch, torchrec and the
models are imported by the functions that use them.

Other torchrec modules (managed-collision, quantized inference modules) are not
sharded by recpipe; :func:`unsupported_modules` names them so the caller can refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from recpipe.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from recpipe.config import RecpipeConfig, ShardingConfig

__all__ = [
    "MODULE_TYPES",
    "TableInfo",
    "check_table_names",
    "find_embedding_modules",
    "model_tables",
    "model_on_meta",
    "table_configs",
    "unsupported_modules",
]

# Short names of the module types recpipe shards, in messages and plan tables.
EBC, EC, FPEBC = "EmbeddingBagCollection", "EmbeddingCollection", "FeatureProcessedEmbeddingBagCollection"
MODULE_TYPES = (EBC, EC, FPEBC)


@dataclass(frozen=True)
class TableInfo:
    """One embedding table of a model, as the planner and the plan table need it."""

    name: str
    module: str  # fully qualified name of the embedding module that holds it
    module_type: str  # one of MODULE_TYPES
    rows: int
    dim: int
    features: tuple[str, ...]  # the KJT keys it looks up
    pooled: bool  # False for EmbeddingCollection: one output row per id, not per bag
    weighted: bool  # the module's input KJT carries per-id weights (weighted EmbeddingBagCollection)
    feature_processed: bool  # a feature processor adds per-id weights after the input all-to-all
    data_type: str  # the table config's torchrec DataType, lower case ("fp32", "fp16", ...)


def _module_type(module: nn.Module) -> str | None:
    """MODULE_TYPES name, "" for a torchrec embedding module recpipe does not shard
    (managed-collision, quantized inference modules), None for anything else."""
    from torchrec.modules.embedding_modules import (
        EmbeddingBagCollection,
        EmbeddingBagCollectionInterface,
        EmbeddingCollection,
        EmbeddingCollectionInterface,
    )
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

    if isinstance(module, FeatureProcessedEmbeddingBagCollection):
        return FPEBC
    if isinstance(module, EmbeddingBagCollection):
        return EBC
    if isinstance(module, EmbeddingCollection):
        return EC
    if isinstance(module, (BaseManagedCollisionEmbeddingCollection, EmbeddingBagCollectionInterface,
                           EmbeddingCollectionInterface)):
        return ""
    return None


def _outermost(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """fqn -> (type name, module) of every outermost torchrec embedding module."""
    found: dict[str, tuple[str, nn.Module]] = {}
    for fqn, module in model.named_modules():
        if any(p == "" or fqn.startswith(f"{p}.") for p in found):
            continue  # inside one already found: it is part of that module
        kind = _module_type(module)
        if kind is not None:
            found[fqn] = (kind, module)
    return found


def find_embedding_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every embedding module recpipe shards, by fully qualified name ("" when the
    model itself is one), outermost only, in ``named_modules`` order."""
    return {fqn: m for fqn, (kind, m) in _outermost(model).items() if kind}


def unsupported_modules(model: nn.Module) -> dict[str, str]:
    """torchrec embedding modules recpipe does not shard (managed-collision and
    quantized inference modules): fqn -> class name."""
    found = _outermost(model).items()
    return {fqn: f"{type(m).__module__}.{type(m).__name__}" for fqn, (kind, m) in found if not kind}


def table_configs(module: nn.Module) -> list:
    """The torchrec table configs (``EmbeddingBagConfig`` / ``EmbeddingConfig``) of an
    embedding module; mutable: :mod:`recpipe.sharding` sets their ``data_type``."""
    kind = _module_type(module)
    if kind == FPEBC:
        return module.split()[1].embedding_bag_configs()
    if kind == EBC:
        return module.embedding_bag_configs()
    if kind == EC:
        return module.embedding_configs()
    raise TypeError(f"{type(module).__name__} is not one of {', '.join(MODULE_TYPES)}")


def model_tables(model: nn.Module) -> tuple[TableInfo, ...]:
    """Every table of every embedding module of ``model``, in module order. Table
    names must be unique over the model (they key ``sharding.tables`` and the plan):
    ``ValueError`` naming both module paths otherwise."""
    out: list[TableInfo] = []
    where: dict[str, str] = {}
    for fqn, module in find_embedding_modules(model).items():
        kind = _module_type(module)
        weighted = kind == EBC and module.is_weighted()
        for c in table_configs(module):
            if c.name in where:
                raise ValueError(
                    f"embedding table name {c.name!r} is used by two modules, {where[c.name] or '<model>'!r} and "
                    f"{fqn or '<model>'!r}; recpipe keys sharding.tables by table name, so names must be unique "
                    "over the model: rename one of the tables"
                )
            where[c.name] = fqn
            out.append(TableInfo(
                name=c.name, module=fqn, module_type=kind, rows=int(c.num_embeddings), dim=int(c.embedding_dim),
                features=tuple(c.feature_names), pooled=kind != EC, weighted=weighted,
                feature_processed=kind == FPEBC, data_type=str(c.data_type.value).lower(),
            ))
    return tuple(out)


def check_table_names(sharding: "ShardingConfig", tables: tuple[TableInfo, ...]) -> None:
    """Every table named under ``sharding.tables`` and ``sharding.mean_pooling_factors``
    exists in the model; ``ConfigError`` naming the key and listing the model's tables
    otherwise (for a ``model.factory`` model the names are only known once it is built)."""
    known = {t.name for t in tables}
    listed = ", ".join(f"{t.name} ({t.module or '<model>'})" for t in tables) or "none"
    problems = [
        f"  sharding.{key}.{name}: no such table in the model; its tables are: {listed}"
        for key in ("tables", "mean_pooling_factors")
        for name in getattr(sharding, key)
        if name not in known
    ]
    if problems:
        raise ConfigError("invalid config for this model:\n" + "\n".join(problems))


def model_on_meta(cfg: "RecpipeConfig") -> "nn.Module":
    """The unsharded model of ``cfg`` (``recpipe.models.make_model``) built under the
    meta device: parameters have shapes but no memory."""
    import torch

    from recpipe.models import make_model

    with torch.device("meta"):
        return make_model(cfg)
