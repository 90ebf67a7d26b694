"""The model side of the planner's inputs, read from the unsharded model built on
the meta device (nothing allocated): one :class:`~recpipe.planner.spec.TableSpec`
per embedding table of any embedding module, and the dense part
(:class:`~recpipe.planner.spec.DenseSpec`). The built-in DLRM / DCNv2's are read off
its config instead (:func:`builtin_tables`, :func:`builtin_dense_spec`: what building it
on meta would give, tests/test_planner.py holds them to it), so that ``recpipe plan``
loads neither torchrec nor FBGEMM.

Mean pooling factors (ids per sample of each feature) are not in the model; they
come from, in this order:

1. ``sharding.mean_pooling_factors.<table>`` (any model);
2. the data, feature by feature (``cat_i``; the built-in model's table ``t_cat_i``
   reads feature ``cat_i``): ``data.multi_hot_sizes`` when set (the fixed ids per
   sample of multi-hot data), else one id each for ``criteo_tsv`` / ``binary`` data,
   else (built-in model) ``data.synthetic.mean_pooling_factors``;
3. 1.0, for a ``model.factory`` model's tables the data does not cover; the plan warns which.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from recpipe.embedding_tables import EBC, TableInfo
from recpipe.planner.spec import CACHED, DenseSpec, TableSpec, activation_bytes, dense_output_grad_bytes
from recpipe.table_sharding.cache import DEFAULT_CACHE_LOAD_FACTOR
from recpipe.table_sharding.placement import placed_type
from recpipe.table_sharding.precision import stochastic_rounding, weights_precision

if TYPE_CHECKING:
    from torch import nn

    from recpipe.config import DataConfig, ModelConfig, ShardingConfig


def data_ids_per_sample(data: "DataConfig", m: "ModelConfig") -> dict[str, float]:
    """Ids per sample of each feature of the configured data, by feature name:
    ``data.multi_hot_sizes`` when set; one each for ``criteo_tsv`` / ``binary`` data
    (the Criteo layout); the mean of ``data.synthetic.mean_pooling_factors`` for the
    built-in model otherwise; nothing known for a ``model.factory`` model's other data."""
    names = m.feature_names
    if data.multi_hot_sizes is not None:
        return {name: float(h) for name, h in zip(names, data.multi_hot_sizes)}
    if data.factory is None and data.source in ("criteo_tsv", "binary"):
        return dict.fromkeys(names, 1.0)
    if m.factory is None:
        pf = data.synthetic.mean_pooling_factors
        return dict(zip(names, list(pf) if isinstance(pf, list) else [float(pf)] * len(names)))
    return {}


def pooling_factors(tables: tuple["TableInfo", ...], explicit: dict[str, float],
                    by_feature: dict[str, float]) -> tuple[dict[str, float], list[str]]:
    """Mean ids per sample of each feature, per table (sources in the module
    docstring: ``explicit`` is ``sharding.mean_pooling_factors``, ``by_feature``
    :func:`data_ids_per_sample`), and the tables that got the 1.0 fallback."""
    out: dict[str, float] = {}
    assumed: list[str] = []
    for t in tables:
        if t.name in explicit:
            out[t.name] = float(explicit[t.name])
        elif all(f in by_feature for f in t.features):
            out[t.name] = float(sum(by_feature[f] for f in t.features) / len(t.features))
        else:
            out[t.name] = 1.0
            assumed.append(t.name)
    return out, assumed


def table_specs(
    sharding: "ShardingConfig", tables: tuple["TableInfo", ...], pfs: dict[str, float], world_size: int
) -> tuple[TableSpec, ...]:
    """The planner's view of every table, with its resolved sharding (the type as
    placed on ``world_size`` ranks: ``recpipe.table_sharding.placement.placed_type``)."""
    out = []
    for t in tables:
        ts = sharding.for_table(t.name)
        clf = None
        if ts.kernel == CACHED:
            clf = ts.cache_load_factor if ts.cache_load_factor is not None else DEFAULT_CACHE_LOAD_FACTOR
        # the configured cache precision, not the resolved one: torchrec groups tables
        # by it (an explicit value is a fused param, the default is not)
        cp = ts.cache_precision if ts.kernel == CACHED else None
        out.append(TableSpec(
            t.name, t.rows, t.dim, pfs[t.name], placed_type(ts, world_size), ts.kernel, clf, module=t.module,
            num_features=len(t.features), pooled=t.pooled, weighted=t.weighted, feature_processed=t.feature_processed,
            weights_precision=weights_precision(sharding, t), cache_precision=cp,
            stochastic_rounding=stochastic_rounding(sharding, t),
        ))
    return tuple(out)


def _inside(name: str, prefixes: set[str]) -> bool:
    return any(p == "" or name.startswith(f"{p}.") for p in prefixes)


# Where the built-in model (recpipe.models.dlrm.RecModel around torchrec's DLRM) keeps its tables.
BUILTIN_EMBEDDING_MODULE = "model.sparse_arch.embedding_bag_collection"


def builtin_tables(m: "ModelConfig") -> tuple[TableInfo, ...]:
    """The built-in model's tables: one fp32 table ``t_cat_i`` of feature ``cat_i`` each, in
    one EmbeddingBagCollection (``recpipe.models.dlrm.embedding_configs``)."""
    return tuple(TableInfo(name=table, module=BUILTIN_EMBEDDING_MODULE, module_type=EBC, rows=rows,
                           dim=m.embedding_dim, features=(feature,), pooled=True, weighted=False,
                           feature_processed=False, data_type="fp32")
                 for table, feature, rows in zip(m.table_names, m.feature_names, m.num_embeddings_per_feature))


def _mlp_params(sizes: list[int]) -> int:
    """Weights and biases of torchrec's MLP / a chain of nn.Linear through ``sizes``."""
    return sum(a * b + b for a, b in itertools.pairwise(sizes))


def builtin_dense_spec(m: "ModelConfig", precision: str) -> DenseSpec:
    """:func:`dense_spec` of the built-in model, from its config: torchrec's DenseArch
    (an MLP), the interaction (DLRM: no parameters, the upper-triangle indices as an int64
    buffer; DCNv2: a low-rank cross network of ``dcn_num_layers`` layers over the
    ``(F + 1) * D`` concatenation) and the OverArch (an MLP and a final Linear)."""
    F, D = m.num_sparse_features, m.embedding_dim
    params = _mlp_params([m.num_dense_features, *m.dense_arch_layer_sizes])
    if m.arch == "dlrm":
        pairs = (F + 1) * F // 2
        interaction, buffers = D + pairs, 2 * pairs * 8  # triu_indices: int64 [2, pairs]
    else:
        interaction, buffers = (F + 1) * D, 0
        params += m.dcn_num_layers * (2 * interaction * m.dcn_low_rank_dim + interaction)  # W, V, bias per layer
    params += _mlp_params([interaction, *m.over_arch_layer_sizes])
    dense, top = activation_bytes(m, precision)
    return DenseSpec(num_params=params, buffer_bytes=buffers, dense_arch_bytes=dense, top_bytes=top,
                     dense_out_grad_bytes=dense_output_grad_bytes(m, precision))


def dense_spec(m: "ModelConfig", precision: str, model: "nn.Module", tables: tuple["TableInfo", ...]) -> DenseSpec:
    """Count the dense parameters and buffers exactly (everything outside the
    embedding modules) and, for the built-in DLRM / DCNv2, the activations saved per
    sample (formula: approximate, see docs/planner.md). A ``model.factory`` model's
    activations are unknown: 0 (the plan says so)."""
    emb = {t.module for t in tables}
    params = sum(p.numel() for n, p in model.named_parameters() if not _inside(n, emb))
    buffers = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if not _inside(n, emb))
    if m.factory is not None:
        return DenseSpec(num_params=params, buffer_bytes=buffers)
    dense, top = activation_bytes(m, precision)
    return DenseSpec(num_params=params, buffer_bytes=buffers, dense_arch_bytes=dense, top_bytes=top,
                     dense_out_grad_bytes=dense_output_grad_bytes(m, precision))


def model_notes(m: "ModelConfig", assumed: list[str]) -> tuple[str, ...]:
    """What the estimate cannot know about this model (the plan's warnings)."""
    notes = []
    if m.factory is not None:
        notes.append(f"model.factory={m.factory!r}: the dense activations saved for backward and the batch's "
                     "non-KJT tensors are not estimated (0); only parameters, tables and KJTs are")
    if assumed:
        notes.append(f"tables {', '.join(assumed)}: no mean pooling factor configured, 1.0 id per sample and feature "
                     "assumed; set sharding.mean_pooling_factors.<table>")
    return tuple(notes)
