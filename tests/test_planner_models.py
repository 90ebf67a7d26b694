"""The memory planner takes its tables from the model: any mix of
EmbeddingBagCollections (weighted or not), EmbeddingCollections (sequence: one
output row per id) and FeatureProcessedEmbeddingBagCollections, built on meta from
``model.factory``. Placement and TBE grouping match torchrec module by module, and
``recpipe plan`` works for a factory model."""

from __future__ import annotations

import json

import pytest
import torch

import sharding_models
from recpipe.cli import main
from recpipe.config import load_config
from recpipe.embedding_tables import find_embedding_modules, model_tables
from recpipe.planner import estimate_memory, inputs_from_config
from recpipe.planner.memory import batch_bytes
from recpipe.planner.spec import DenseSpec, PlannerInputs, TableSpec, pipeline_spec, shards_for_tables, shards_from_plan
from recpipe.planner.tbe import group_tbes
from recpipe.sharding import sharding_plan
from recpipe.table_sharding.sharders import make_sharders

_SPARSE = ("table_1: {type: row_wise}, table_2: {type: column_wise}, weighted_table_1: {type: row_wise}, "
           "table_4: {type: row_wise}, table_5: {type: column_wise}")
_TOWERS = "t_user_geo: {type: row_wise}, t_history_cat: {type: row_wise}, t_history_shop: {type: column_wise}"
_DP = "{type: data_parallel, kernel: dense}"
SPARSE_NN = ["model.factory=sharding_models:sparse_nn", "model.options={num_fp_tables: 2}",
             f"sharding.tables={{{_SPARSE}, weighted_table_3: {_DP}}}"]
TWO_TOWER = ["model.factory=sharding_models:two_tower", f"sharding.tables={{{_TOWERS}, t_item_cat: {_DP}}}"]
# torchrec's grouping helpers take sharded tables only
SPARSE_NN_SHARDED = SPARSE_NN[:2] + [f"sharding.tables={{{_SPARSE}}}"]
TWO_TOWER_SHARDED = TWO_TOWER[:1] + [f"sharding.tables={{{_TOWERS}}}"]


def test_table_specs_come_from_the_model():
    cfg = load_config(None, ["distributed.nproc=4", *SPARSE_NN,
                             "sharding.mean_pooling_factors={table_0: 3.5, weighted_table_2: 2}"])
    inputs = inputs_from_config(cfg)
    specs = {t.name: t for t in inputs.tables}
    assert [t.name for t in inputs.tables] == [t.name for t in model_tables(sharding_models.sparse_nn(cfg))]
    assert specs["table_0"].pooling_factor == 3.5 and specs["weighted_table_2"].pooling_factor == 2.0
    assert specs["table_3"].pooling_factor == 1.0  # unlisted: 1.0, and the plan says so
    assert specs["weighted_table_0"].weighted and not specs["table_0"].weighted
    assert specs["table_4"].feature_processed and specs["table_4"].module == "sparse.fp_ebc"
    assert specs["table_1"].sharding_type == "row_wise" and specs["weighted_table_3"].kernel == "dense"
    dense = sum(p.numel() for n, p in sharding_models.sparse_nn(cfg).named_parameters() if ".ebc." not in n
                and ".weighted_ebc." not in n and ".fp_ebc." not in n)
    assert inputs.dense.num_params == dense and inputs.dense.top_bytes == 0 and not inputs.dense_batch
    warnings = estimate_memory(inputs).warnings
    assert any("table_3" in w and "sharding.mean_pooling_factors.<table>" in w for w in warnings)
    assert any("not estimated" in w for w in warnings)
    builtin = inputs_from_config(load_config(None, ["data.synthetic.mean_pooling_factors=2.5"]))
    assert {t.pooling_factor for t in builtin.tables} == {2.5} and builtin.dense_batch and builtin.dense.top_bytes > 0


def test_ids_per_sample_come_from_the_data(tmp_path):
    """Multi-hot TSV / binary data: each feature's ids per sample are data.multi_hot_sizes,
    exactly what a batch holds, and the per-step terms follow them; one-hot TSV data has
    one id each; data.synthetic's mean does not apply to either; an explicit
    sharding.mean_pooling_factors entry still wins."""
    from test_data_binary import HOT, batches, config, random_lines, write

    from recpipe.planner.memory import local_ids, local_sparse_bytes

    multi = [write(tmp_path / "mh.tsv", random_lines(40, 2, HOT))]
    one = [write(tmp_path / "one.tsv", random_lines(40, 2))]
    other = ["data.synthetic.mean_pooling_factors=5.0", "distributed.nproc=2"]
    hot, plain = (inputs_from_config(config("criteo_tsv", *other, files=files, hot=h)) for files, h in ((multi, True), (one, False)))
    assert [t.pooling_factor for t in hot.tables] == HOT and [t.pooling_factor for t in plain.tables] == [1.0] * 4
    real = batches(config("criteo_tsv", *other, files=multi, hot=True))[0].sparse_features
    assert local_ids(hot) == real.values().numel() == 16 * sum(HOT)
    extra_ids = 16 * (sum(HOT) - 4)
    assert batch_bytes(hot) - batch_bytes(plain) == 8 * extra_ids
    assert local_sparse_bytes(hot) - local_sparse_bytes(plain) == 8 * extra_ids
    kjts = [estimate_memory(i).ranks[0].term("input_dist_kjts") for i in (hot, plain)]
    assert kjts[0] > kjts[1]
    pinned = inputs_from_config(config("criteo_tsv", *other, "sharding.mean_pooling_factors={t_cat_0: 7}", files=multi, hot=True))
    assert [t.pooling_factor for t in pinned.tables] == [7.0, *HOT[1:]]


@pytest.mark.parametrize("options", [SPARSE_NN, TWO_TOWER], ids=["TestSparseNN", "two_tower_with_EC"])
def test_shards_match_the_real_sharding_plan_of_every_module(options):
    cfg = load_config(None, ["distributed.nproc=4", *options])
    inputs = inputs_from_config(cfg)
    model = getattr(sharding_models, cfg.model.factory.split(":")[1])(cfg)
    real = shards_from_plan(sharding_plan(model, cfg, 4, "cuda"), inputs.tables)
    assert sorted(inputs.shards, key=str) == sorted(real, key=str)


def _torchrec_groups(model, plan, cfg, world_size: int) -> dict[tuple, list]:
    """torchrec's TBE grouping on every rank, per module and sharding type."""
    from torchrec.distributed import embedding, embeddingbag
    from torchrec.distributed.sharding import cw_sequence_sharding, cw_sharding, rw_sequence_sharding, rw_sharding
    from torchrec.distributed.sharding import tw_sequence_sharding, tw_sharding
    from torchrec.distributed.types import ShardingEnv

    pooled = {"table_wise": tw_sharding.TwPooledEmbeddingSharding, "row_wise": rw_sharding.RwPooledEmbeddingSharding,
              "column_wise": cw_sharding.CwPooledEmbeddingSharding}
    sequence = {"table_wise": tw_sequence_sharding.TwSequenceEmbeddingSharding,
                "row_wise": rw_sequence_sharding.RwSequenceEmbeddingSharding,
                "column_wise": cw_sequence_sharding.CwSequenceEmbeddingSharding}
    sharders = make_sharders(cfg.sharding, cfg.optimizer.embedding)
    out: dict[tuple, list] = {}
    for fqn, module in find_embedding_modules(model).items():
        kind = type(module).__name__
        fused = sharders[kind].fused_params
        sharded = dict(plan.plan[fqn])
        if kind == "EmbeddingCollection":
            infos = embedding.create_sharding_infos_by_sharding_device_group(module, sharded, fused)
            classes = sequence
        else:
            ebc = module.split()[1] if kind.startswith("FeatureProcessed") else module
            infos = embeddingbag.create_sharding_infos_by_sharding_device_group(ebc, sharded, "embedding_bags.", fused)
            classes = pooled
        for (st, _), info in infos.items():
            sharding = classes[st](info, ShardingEnv(world_size=world_size, rank=0, pg=None), device=torch.device("meta"))
            for rank, groups in enumerate(sharding._grouped_embedding_configs_per_rank):
                out[(fqn, st, rank)] = [([t.name for t in g.embedding_tables], [t.local_rows for t in g.embedding_tables])
                                        for g in groups]
    return {k: v for k, v in out.items() if v}


@pytest.mark.parametrize("options", [SPARSE_NN_SHARDED, TWO_TOWER_SHARDED], ids=["TestSparseNN", "two_tower_with_EC"])
def test_tbes_per_module_match_torchrec(options):
    cfg = load_config(None, ["distributed.nproc=4", *options])
    inputs = inputs_from_config(cfg)
    model = getattr(sharding_models, cfg.model.factory.split(":")[1])(cfg)
    theirs = _torchrec_groups(model, sharding_plan(model, cfg, 4, "cuda"), cfg, 4)
    ours: dict[tuple, list] = {}
    for rank in range(4):
        for g in group_tbes(inputs, rank):
            module = g.tables[0].module
            ours.setdefault((module, g.sharding_type, rank), []).append(
                ([s.table for s in g.shards], [s.rows for s in g.shards]))
            assert g.name.startswith(f"{module}:")  # several modules: the TBE names say whose
    assert ours == theirs and len({module for module, _, _ in ours}) == 3  # every module has TBEs


def _one_table(**kw) -> PlannerInputs:
    t = TableSpec("t", 1000, 16, 3.0, kw.pop("sharding_type", "table_wise"), "fused", **kw)
    tables = (t,)
    return PlannerInputs(tables=tables, shards=shards_for_tables(tables, 2, {"t": 0}), world_size=2, batch_size=64,
                         num_dense_features=13, dense=DenseSpec(num_params=100), embedding_optimizer="rowwise_adagrad",
                         dense_optimizer="adagrad", pipeline=pipeline_spec("sparse_dist"), hbm_capacity_bytes=80 << 30)


@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise"])
def test_sequence_tables_output_one_row_per_id(sharding_type):
    pooled = estimate_memory(_one_table(sharding_type=sharding_type, num_features=2))
    seq = estimate_memory(_one_table(sharding_type=sharding_type, num_features=2, pooled=False))
    W, B, pf, F, D = 2, 64, 3.0, 2, 16
    ids = {"table_wise": W * B * pf * F, "row_wise": W * B * pf * F * 500 / 1000}[sharding_type]
    first = lambda plan: next(t.bytes for t in plan.shards[0].terms if t.name == "pooled_lookup")  # noqa: E731
    assert first(pooled) == 4 * W * B * F * D  # a bag per sample and feature
    assert first(seq) == int(4 * ids * D)  # a row per id
    # after the output dist: [B, D] per feature pooled, [B * pf, D] per feature as a sequence
    assert dict(seq.ranks[1].phases)["forward_lookup"] - dict(pooled.ranks[1].phases)["forward_lookup"] \
        == 4 * B * F * D * (pf - 1) + (first(seq) - first(pooled) if sharding_type == "row_wise" else 0)


def test_weighted_ids_carry_fp32_weights():
    plain, weighted = _one_table(), _one_table(weighted=True)
    assert batch_bytes(weighted) - batch_bytes(plain) == 4 * 64 * 3
    kjts = [estimate_memory(x).ranks[0].term("input_dist_kjts") for x in (plain, weighted)]
    assert kjts[1] - kjts[0] == 2 * 4 * int(2 * 64 * 3)  # 2 received KJTs in flight, W * B * pf ids each
    processed = estimate_memory(_one_table(feature_processed=True)).ranks[0].term("input_dist_kjts")
    assert processed == kjts[1] and batch_bytes(_one_table(feature_processed=True)) == batch_bytes(plain)


def test_cli_plans_a_factory_model(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "c.yaml"
    path.write_text("# two towers and a history EmbeddingCollection\n{}\n")
    args = ["plan", "--config", str(path), "--format", "json", "--set", "distributed.nproc=2"]
    for pair in [*TWO_TOWER, "sharding.mean_pooling_factors={t_history_item: 20}"]:
        args += ["--set", pair]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    names = {f"t_{f}" for spec in sharding_models.TOWER_TABLES.values() for f, _ in spec}
    names |= {f"t_{f}" for f, _ in sharding_models.HISTORY_TABLES}
    assert {s["table"] for s in doc["shards"]} == names
    assert any("no mean pooling factor configured" in w for w in doc["warnings"])
    history = [s for s in doc["shards"] if s["table"] == "t_history_item"]
    lookup = next(t for t in history[0]["terms"] if t["name"] == "pooled_lookup")
    assert lookup["bytes"] == 4 * 2 * 512 * 20 * sharding_models.DIM  # W * B * 20 ids, one row each


@pytest.mark.parametrize("dim,world_size", [(16, 8), (8, 4), (12, 2), (16, 2), (64, 4)])
def test_column_wise_blocks_match_torchrec(dim, world_size):
    """torchrec cuts column_wise tables into blocks of a multiple of 4 columns: dim 16
    on 8 ranks is 4 shards of 4, dim 12 on 2 ranks one shard of 12."""
    from recpipe.models import build_model

    cfg = load_config(None, [f"distributed.nproc={world_size}", f"model.embedding_dim={dim}",
                             f"model.dense_arch_layer_sizes=[32,{dim}]", "model.num_embeddings_per_feature=[100,200]",
                             "sharding.default={type: column_wise}"])
    inputs = inputs_from_config(cfg)
    real = shards_from_plan(sharding_plan(build_model(cfg.model), cfg, world_size, "cuda"), inputs.tables)
    assert sorted(inputs.shards, key=str) == sorted(real, key=str)
