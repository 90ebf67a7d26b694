"""recpipe.sharding shards any model: its embedding modules are found by type
(EmbeddingBagCollection, weighted or not, EmbeddingCollection,
FeatureProcessedEmbeddingBagCollection), each gets torchrec's sharder for its type,
and the sharded model computes what the unsharded one computes, for every sharding
type each module supports on CPU (2 Gloo processes). Config errors that need the
model's tables name the key, the table and its module."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

import sharding_models
from pipeline_harness import local_state
from recpipe.cli import main
from recpipe.config import ConfigError, load_config
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from recpipe.embedding_tables import find_embedding_modules, model_tables
from recpipe.table_sharding.checks import validated_tables
from recpipe.exit_codes import EXIT_BAD_CONFIG
from recpipe.sharding import EBC_PATH, plan_table, shard_model, sharding_plan

TYPES = {"table_wise": "{type: table_wise}", "row_wise": "{type: row_wise}", "column_wise": "{type: column_wise}",
         "data_parallel": "{type: data_parallel, kernel: dense}"}


def _cfg(factory: str, tables: dict[str, str], options: str = "{}", nproc: int = 2, extra: tuple[str, ...] = ()):
    spec = ", ".join(f"{name}: {TYPES[kind]}" for name, kind in tables.items())
    return load_config(None, [f"distributed.nproc={nproc}", f"model.factory=sharding_models:{factory}",
                              f"model.options={options}", f"sharding.tables={{{spec}}}", "optimizer.embedding.lr=0.1",
                              *extra])


# One table of every sharding type in every module (TestSparseNN: ebc, weighted_ebc,
# fp_ebc; two towers: the user and item EmbeddingBagCollections, the history
# EmbeddingCollection, whose data_parallel does not run on CPU).
SPARSE_NN = ("sparse_nn", {"table_1": "row_wise", "table_2": "column_wise", "table_3": "data_parallel",
                           "weighted_table_1": "row_wise", "weighted_table_2": "column_wise",
                           "weighted_table_3": "data_parallel", "table_5": "row_wise", "table_6": "column_wise",
                           "table_7": "data_parallel"}, "{num_fp_tables: 4}")
TWO_TOWER = ("two_tower", {"t_user_geo": "row_wise", "t_item_id": "column_wise", "t_item_cat": "data_parallel",
                           "t_history_cat": "row_wise", "t_history_shop": "column_wise"}, "{}")


# ------------------------------------------------------------------ finding tables
def test_modules_found_by_type_outermost():
    cfg = _cfg(*SPARSE_NN)
    model = sharding_models.sparse_nn(cfg)
    assert list(find_embedding_modules(model)) == ["sparse.ebc", "sparse.fp_ebc", "sparse.weighted_ebc"]
    tables = {t.name: t for t in model_tables(model)}
    assert len(tables) == 12
    assert (tables["table_0"].module_type, tables["table_0"].weighted) == ("EmbeddingBagCollection", False)
    assert (tables["weighted_table_0"].module, tables["weighted_table_0"].weighted) == ("sparse.weighted_ebc", True)
    fp = tables["table_5"]  # the EmbeddingBagCollection inside the feature-processed one is part of it
    assert (fp.module, fp.module_type, fp.feature_processed) == ("sparse.fp_ebc", "FeatureProcessedEmbeddingBagCollection", True)
    towers = {t.name: t for t in model_tables(sharding_models.two_tower(cfg))}
    assert {t.module for t in towers.values()} == {"user.ebc", "item_ebc", "history"}
    history = towers["t_history_item"]
    assert (history.module_type, history.pooled, history.features, history.rows, history.dim) == (
        "EmbeddingCollection", False, ("history_item",), 60, sharding_models.DIM)


def test_duplicate_table_names_name_both_modules():
    model = nn.Module()
    config = EmbeddingBagConfig(name="shared", embedding_dim=8, num_embeddings=10, feature_names=["f"])
    model.a = EmbeddingBagCollection(tables=[config], device=torch.device("meta"))
    model.b = nn.Sequential(EmbeddingBagCollection(tables=[copy.copy(config)], device=torch.device("meta")))
    with pytest.raises(ValueError, match=r"'shared' is used by two modules, 'a' and 'b.0'"):
        model_tables(model)
    with pytest.raises(ConfigError, match=r"'shared' is used by two modules, 'a' and 'b.0'"):
        validated_tables(load_config(None, ["model.factory=x:y"]), model)


def test_unsupported_torchrec_module_is_refused():
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEBC

    model = nn.Module()
    model.quant = QuantEBC(tables=[EmbeddingBagConfig(name="q", embedding_dim=8, num_embeddings=10, feature_names=["f"])],
                           is_weighted=False, device=torch.device("meta"))
    with pytest.raises(ConfigError, match=r"cannot shard quant \(torchrec.quant.embedding_modules.EmbeddingBagCollection\)"):
        validated_tables(load_config(None, ["model.factory=x:y"]), model)


# ------------------------------------------------------------------ config errors that need the model
def test_unknown_table_of_a_factory_model_names_the_key_and_lists_the_tables():
    cfg = load_config(None, ["model.factory=sharding_models:two_tower", "sharding.tables={t_nope: {type: row_wise}}",
                             "sharding.mean_pooling_factors={t_nope2: 3}"])
    with pytest.raises(ConfigError) as err:
        validated_tables(cfg)
    msg = str(err.value)
    assert "sharding.tables.t_nope: no such table" in msg and "sharding.mean_pooling_factors.t_nope2" in msg
    assert "t_user_id (user.ebc)" in msg and "t_history_item (history)" in msg


def test_unsupported_sharding_type_names_table_module_and_allowed_types():
    cfg = _cfg("two_tower", {"t_history_cat": "data_parallel"})
    validated_tables(cfg, device_type="cuda")  # torchrec's EmbeddingCollectionSharder offers data_parallel
    with pytest.raises(ConfigError) as err:
        validated_tables(cfg, device_type="cpu")
    msg = str(err.value)
    assert "sharding.tables.t_history_cat.type='data_parallel'" in msg
    assert "EmbeddingCollection 'history'" in msg and "table_wise, row_wise, column_wise" in msg


def test_unsupported_type_from_torchrec_sharder(monkeypatch):
    """A type torchrec's sharder does not list (here: patched away) is refused too."""
    from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder

    monkeypatch.setattr(FeatureProcessedEmbeddingBagCollectionSharder, "sharding_types",
                        lambda self, device: ["table_wise", "data_parallel"])
    cfg = _cfg(*SPARSE_NN)
    with pytest.raises(ConfigError, match=r"sharding.tables.table_5.type='row_wise': table 'table_5' is in "
                                          r"FeatureProcessedEmbeddingBagCollection 'sparse.fp_ebc', which recpipe "
                                          r"shards on cuda only as table_wise, data_parallel"):
        validated_tables(cfg)


def test_cli_refuses_before_any_process_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the factory module is imported from tests/ (on sys.path)
    path = tmp_path / "c.yaml"
    path.write_text("# factory model with a misspelt table\n{}\n")
    base = ["--config", str(path), "--set", "model.factory=sharding_models:two_tower", "--set", "train.device=cpu"]
    assert main(["train", *base, "--set", "sharding.tables={t_nope: {type: row_wise}}"]) == EXIT_BAD_CONFIG
    assert "sharding.tables.t_nope: no such table" in capsys.readouterr().err
    assert main(["plan", *base, "--set", "sharding.tables={t_nope: {type: row_wise}}"]) == EXIT_BAD_CONFIG
    assert main(["train", *base, "--set", "sharding.tables={t_history_cat: {type: data_parallel, kernel: dense}}"]) \
        == EXIT_BAD_CONFIG
    assert "which recpipe shards on cpu only as" in capsys.readouterr().err


# ------------------------------------------------------------------ plans and the plan table
def test_plan_and_table_cover_every_module():
    cfg = _cfg(*TWO_TOWER)
    model = sharding_models.two_tower(cfg)
    plan = sharding_plan(model, cfg, 2, "cpu")
    assert sorted(plan.plan) == ["history", "item_ebc", "user.ebc"]
    assert plan.plan["history"]["t_history_cat"].sharding_type == "row_wise"
    assert plan.plan["item_ebc"]["t_item_cat"].sharding_type == "data_parallel"
    lines = plan_table(plan, model_tables(model)).splitlines()
    assert lines[0].split()[:2] == ["module", "table"] and len(lines) == 2 + 8
    assert any(line.startswith("history (EmbeddingCollection)") and "t_history_shop" in line and "column_wise" in line
               for line in lines)
    builtin = load_config(None, ["distributed.nproc=2"])
    from recpipe.models import build_model

    model = build_model(builtin.model)
    table = plan_table(sharding_plan(model, builtin, 2, "cpu"), model_tables(model))
    assert table.splitlines()[0].split()[0] == "table" and "t_cat_25" in table  # one module: no module column
    assert list(sharding_plan(build_model(builtin.model), builtin, 2, "cpu").plan) == [EBC_PATH]


# ------------------------------------------------------------------ sharded == unsharded, on 2 ranks
def _copy_weights(sharded: nn.Module, reference: nn.Module) -> None:
    """Every local shard of ``sharded`` from the same rows / columns of ``reference``."""
    full = reference.state_dict()
    for key, value in sharded.state_dict().items():
        if hasattr(value, "local_shards"):
            for shard in value.local_shards():
                (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.detach().copy_(full[key][r:r + h, c:c + w])
        else:
            value.detach().copy_(full[key])


def _shard_and_compare_worker(cfg, factory: str, make_batches: str, rtol: float = 1e-6) -> None:
    device = init_process_group(cfg)  # CPU, or this rank's GPU with train.device=cuda
    rank = dist.get_rank()
    build = getattr(sharding_models, factory)
    reference = sharding_models.reference_model(build, cfg, device)
    sharded = shard_model(build(cfg), cfg, device)
    for t in sharded.tables:  # the plan holds what the config says, module by module; on one rank a
        configured = cfg.sharding.for_table(t.name).type  # row_wise table is placed table_wise (placed_type)
        one_rank_rw = dist.get_world_size() == 1 and configured == "row_wise"
        assert sharded.plan.plan[t.module][t.name].sharding_type == ("table_wise" if one_rank_rw else configured)
    _copy_weights(sharded.model, reference)
    batches = [b.to(device) for b in getattr(sharding_models, make_batches)(cfg, rank, dist.get_world_size(), 3)]
    loss, _ = sharded.model(batches[0])
    expected, _ = reference(batches[0])
    torch.testing.assert_close(loss, expected, rtol=rtol, atol=rtol / 10)  # same computation, any placement
    before = local_state(sharded.model)
    for batch in batches:
        sharded.optimizer.zero_grad()
        loss, _ = sharded.model(batch)
        loss.backward()
        sharded.optimizer.step()
        assert torch.isfinite(loss)
    after = local_state(sharded.model)
    for t in sharded.tables:  # every table trained, wherever its shards live
        mine = [k for k in after if f".{t.name}.weight" in k]
        moved = torch.tensor([int(any(not torch.equal(before[k], after[k]) for k in mine))], device=device)
        dist.all_reduce(moved)
        assert moved.item() > 0, f"{t.name} ({t.module}) did not train"


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("model", [SPARSE_NN, TWO_TOWER], ids=["TestSparseNN", "two_tower_with_EC"])
def test_every_module_shards_every_type_like_the_unsharded_model(model, nproc):
    """Every module type (EBC, EC, feature-processed EBC) and sharding type; on one rank
    the row_wise tables are placed table_wise and must train the same computation."""
    name, tables, options = model
    launch_local(_shard_and_compare_worker, nproc, _cfg(name, tables, options, nproc=nproc), name, f"{name}_batches")
