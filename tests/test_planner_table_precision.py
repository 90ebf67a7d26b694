"""Precision in the memory planner: fp16 weights and caches are byte-equal to FBGEMM
TBEs built on meta with the same precisions, tables of different precisions get
their own TBEs as torchrec groups them, quantized comms halve the all-to-all volume
and add the encoded gradient, and the plan says what each precision saves. Config
checks for precisions FBGEMM cannot train."""

from __future__ import annotations

import copy
import json
import warnings
from unittest import mock

import pytest
import torch

import sharding_models
from recpipe.cli import main
from recpipe.config import ConfigError, load_config
from recpipe.exit_codes import EXIT_BAD_CONFIG
from recpipe.models import build_model
from recpipe.planner import estimate_memory, inputs_from_config, plan_from_config
from recpipe.planner.scaling import a2a_bytes
from recpipe.planner.spec import TableSpec
from recpipe.planner.tbe import group_tbes, tbe_static
from recpipe.sharding import check_model_config, sharding_plan
from recpipe.table_sharding.precision import apply_weights_precision
from test_planner_models import _torchrec_groups
from test_planner_tbe import _LOCATION, _OPT, _Props, inputs_for, real_terms

fbgemm_training = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
from fbgemm_gpu.split_embedding_configs import SparseType  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm  # noqa: E402

_SPARSE = {"fp32": SparseType.FP32, "fp16": SparseType.FP16}


def _real_tbe(inputs, tbe):
    """The FBGEMM TBE torchrec builds for ``tbe``, at its tables' precisions (meta)."""
    first = tbe.tables[0]
    specs = [(s.rows, s.cols, _LOCATION[t.kernel], fbgemm_training.ComputeDevice.CUDA)
             for s, t in zip(tbe.shards, tbe.tables)]
    kwargs = dict(optimizer=_OPT[inputs.embedding_optimizer], device="meta", cache_algorithm=CacheAlgorithm.LRU,
                  weights_precision=_SPARSE[first.weights_precision])
    if tbe.cached:
        cached = next(t for t in tbe.tables if t.cached)
        kwargs.update(cache_load_factor=tbe.cache_load_factor, prefetch_pipeline=inputs.prefetch_pipeline,
                      cache_precision=_SPARSE[cached.cache_precision or cached.weights_precision])
    with mock.patch("torch.cuda.get_device_properties", return_value=_Props()), \
            mock.patch("torch.cuda.memory_reserved", return_value=0):
        return fbgemm_training.SplitTableBatchedEmbeddingBagsCodegen(specs, feature_table_map=list(range(len(specs))),
                                                                     **kwargs)


def _tables(kernel, weights, cache=None):
    clf = 0.2 if kernel == "fused_uvm_caching" else None
    return [TableSpec(f"t{i}", rows, dim, 2.0, "table_wise", kernel, clf, weights_precision=weights,
                      cache_precision=cache if kernel == "fused_uvm_caching" else None)
            for i, (rows, dim) in enumerate([(1000, 16), (777, 32), (5003, 16)])]


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("kernel,weights,cache", [
    ("fused", "fp16", None), ("fused_uvm", "fp16", None), ("fused_uvm_caching", "fp16", None),
    ("fused_uvm_caching", "fp16", "fp32"), ("fused_uvm_caching", "fp32", "fp16"),
])
def test_static_terms_equal_fbgemm_buffers_at_each_precision(kernel, weights, cache, optimizer):
    inputs = inputs_for(_tables(kernel, weights, cache), optimizer=optimizer, tw_rank=0)
    (tbe,) = group_tbes(inputs, 0)
    module = _real_tbe(inputs, tbe)
    real, _ = real_terms(inputs, tbe, module)
    ours = {n: b for n, _, b, _ in tbe_static(inputs, tbe) if n != "tbe_metadata"}
    for name in set(real) | set(ours):
        assert ours.get(name, 0) == real.get(name, 0), (name, ours.get(name), real.get(name))
    weights_dev = "weights_dev" if kernel == "fused" else "weights_uvm"
    assert getattr(module, weights_dev).dtype == {"fp32": torch.float32, "fp16": torch.float16}[weights]
    if cache:
        assert module.lxu_cache_weights.dtype == {"fp32": torch.float32, "fp16": torch.float16}[cache]


def test_fp16_halves_the_weights_and_nothing_else_static():
    fp32 = estimate_memory(inputs_for(_tables("fused", "fp32")))
    fp16 = estimate_memory(inputs_for(_tables("fused", "fp16")))
    r32, r16 = fp32.ranks[0], fp16.ranks[0]
    assert r16.term("emb_weights") * 2 == r32.term("emb_weights") > 0
    assert r16.term("emb_optimizer_rowwise") == r32.term("emb_optimizer_rowwise")  # state stays fp32
    assert r16.term("pooled_lookup") == r32.term("pooled_lookup")  # TBE outputs stay fp32
    (saving,) = fp16.precision
    assert saving.saved_hbm_bytes == r32.hbm_bytes - r16.hbm_bytes == r32.term("emb_weights") // 2
    assert not fp32.precision and "precision" not in fp32.to_json()


def test_precisions_split_tbes_as_torchrec_groups_them():
    """fp16 and fp32 tables, an explicit cache precision and stochastic rounding are
    torchrec grouping keys: the planner's TBEs per rank equal torchrec's."""
    cfg = load_config(None, [
        "distributed.nproc=2", "model.num_embeddings_per_feature=[100,200,300,400,500,600]",
        "sharding.default={weights_precision: fp16}",
        "sharding.tables={t_cat_0: {weights_precision: fp32, rank: 0}, t_cat_1: {weights_precision: fp16, "
        "stochastic_rounding: false, rank: 0}, t_cat_2: {type: row_wise, weights_precision: fp16}, t_cat_3: {type: row_wise, "
        "weights_precision: fp32}, t_cat_4: {kernel: fused_uvm_caching, weights_precision: fp16, "
        "cache_precision: fp32, rank: 0}, t_cat_5: {kernel: fused_uvm_caching, weights_precision: fp16, rank: 0}}",
    ])
    model = build_model(cfg.model)
    tables = check_model_config(cfg, model)
    apply_weights_precision(cfg.sharding, model, tables)
    theirs = _torchrec_groups(model, sharding_plan(model, cfg, 2, "cuda", tables), cfg, 2)
    inputs = inputs_from_config(cfg)
    ours: dict[tuple, list] = {}
    for rank in range(2):
        for g in group_tbes(inputs, rank):
            ours.setdefault((g.tables[0].module, g.sharding_type, rank), []).append(
                ([s.table for s in g.shards], [s.rows for s in g.shards]))
    assert ours == theirs
    assert len(ours[("model.sparse_arch.embedding_bag_collection", "table_wise", 0)]) == 4  # one TBE per setting
    assert len(ours[("model.sparse_arch.embedding_bag_collection", "row_wise", 1)]) == 2


def test_comm_precision_halves_the_output_all_to_all_and_adds_the_encoded_gradient():
    base = ["distributed.nproc=2", "data.batch_size=2048", "model.num_embeddings_per_feature=[1000000,2000,3000,4000]"]
    fp32 = inputs_from_config(load_config(None, base))
    fp16 = inputs_from_config(load_config(None, base + ["sharding.comm_precision={forward: fp16, backward: bf16}"]))
    a, b = a2a_bytes(fp32), a2a_bytes(fp16)
    for kind in ("output_a2a", "backward_a2a"):
        assert [(s / 2, r / 2) for s, r in a[kind]] == b[kind]
    assert a["input_a2a"] == b["input_a2a"]  # ids are ids
    plan32, plan16 = estimate_memory(fp32), estimate_memory(fp16)
    r32, r16 = plan32.ranks[0], plan16.ranks[0]
    grads = dict(r16.phases)["backward_output_dist"] - dict(r32.phases)["backward_output_dist"]
    pooled = 4 * 2048 * 4 * 16  # B x sum of dims, fp32
    assert grads == 2 * pooled // 4  # bf16: 2 bytes per value of the gradient
    assert r16.term("emb_weights") == r32.term("emb_weights")
    (saving, _) = plan16.precision
    assert saving.output_a2a_bytes * 2 == saving.output_a2a_bytes_fp32 > 0
    one = plan_from_config(load_config(None, ["sharding.comm_precision={forward: fp16, backward: fp16}"]))
    assert "backward_output_dist" not in dict(one.ranks[0].phases)  # one rank: no output dist at all


def test_cli_shows_what_each_precision_saves(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("# precision\n{}\n")
    args = ["plan", "--config", str(path), "--set", "distributed.nproc=2",
            "--set", "sharding.default={weights_precision: fp16}", "--set", "sharding.comm_precision.forward=bf16"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "precision (configured vs every precision fp32)" in out and "HBM saved" in out
    assert main(args + ["--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["precision"]) == 2 and all(p["saved_hbm_bytes"] > 0 for p in doc["precision"])


# ------------------------------------------------------------------ config checks
@pytest.mark.parametrize("override,message", [
    ("sharding.default={weights_precision: bf16}", "sharding.default.weights_precision='bf16': FBGEMM's training"),
    ("sharding.tables={t_cat_1: {kernel: fused_uvm_caching, cache_precision: bf16}}",
     "sharding.tables.t_cat_1.cache_precision='bf16'"),
    ("sharding.tables={t_cat_1: {cache_precision: fp16}}", "cache_precision='fp16' needs kernel 'fused_uvm_caching'"),
    ("sharding.tables={t_cat_1: {type: data_parallel, kernel: dense, weights_precision: fp16}}",
     "with type 'data_parallel'"),
])
def test_precisions_fbgemm_cannot_train_are_refused(tmp_path, capsys, override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [override])
    path = tmp_path / "c.yaml"
    path.write_text("# x\n{}\n")
    assert main(["train", "--config", str(path), "--set", override, "--set", "train.device=cpu"]) == EXIT_BAD_CONFIG
    assert message in capsys.readouterr().err


def test_a_models_own_untrainable_data_type_is_refused():
    from torchrec.types import DataType

    cfg = load_config(None, ["model.factory=sharding_models:two_tower"])
    model = sharding_models.two_tower(cfg)
    model.history.embedding_configs()[0].data_type = DataType.BF16
    with pytest.raises(ConfigError, match=r"table 't_history_item' \(history\): its config's data_type is 'bf16'"):
        check_model_config(cfg, model)
    fp16 = load_config(None, ["model.factory=sharding_models:two_tower",
                              "sharding.tables={t_history_item: {weights_precision: fp16}}"])
    assert check_model_config(fp16, copy.deepcopy(model))  # the configured precision wins


def test_ignored_precision_options_warn():
    cfg = load_config(None, ["sharding.tables={t_cat_0: {stochastic_rounding: false}, t_cat_1: {weights_precision: "
                             "fp16, stochastic_rounding: true}}", "sharding.comm_precision.backward=bf16"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_model_config(cfg, device_type="cpu")
    text = "\n".join(str(w.message) for w in caught)
    assert "sharding.tables.t_cat_0.stochastic_rounding=false is ignored for tables t_cat_0: their weights are fp32" \
        in text
    assert "sharding.tables.t_cat_1.stochastic_rounding=true is ignored for tables t_cat_1: on CPU" in text
    assert "sharding.comm_precision.backward='bf16' runs as fp16 on CPU" in text
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_model_config(cfg, device_type="cuda")
    assert [str(w.message) for w in caught] == [text.splitlines()[0]]


def test_plan_from_config_follows_table_precision():
    cfg = load_config(None, ["distributed.nproc=1", "sharding.tables={t_cat_0: {weights_precision: fp16}}"])
    plan = plan_from_config(cfg)
    shard = next(s for s in plan.shards if s.table == "t_cat_0")
    other = next(s for s in plan.shards if s.table == "t_cat_1")
    weights = lambda s: next(t.bytes for t in s.terms if t.name == "emb_weights")  # noqa: E731
    assert weights(shard) * 2 == weights(other) == 1000 * 16 * 4


def test_tbe_outputs_follow_the_wire_precision_where_the_tbes_write_it():
    """The planner's TBE outputs take the comm precision exactly where sharding does
    (recpipe.table_sharding.comm.tbe_output_precision): several ranks, both directions alike,
    no data_parallel table."""
    from recpipe.planner.memory import rank_io
    from recpipe.table_sharding.comm import tbe_output_precision

    base = ["distributed.nproc=2", "data.batch_size=2048", "model.num_embeddings_per_feature=[1000000,2000,3000,4000]"]
    cases = {
        "fp32": ([], 4),
        "bf16 both ways": (["sharding.comm_precision={forward: bf16, backward: bf16}"], 2),
        "fp16 forward only": (["sharding.comm_precision={forward: fp16, backward: fp32}"], 4),
        "with a data_parallel table": (["sharding.comm_precision={forward: bf16, backward: bf16}",
                                        "sharding.tables={t_cat_3: {type: data_parallel}}"], 4),
    }
    lookups = {}
    for name, (extra, nbytes) in cases.items():
        cfg = load_config(None, base + extra)
        inputs = inputs_from_config(cfg)
        assert inputs.tbe_output_bytes == nbytes, name
        assert (tbe_output_precision(cfg.sharding, 2) is not None) == (nbytes == 2), name
        lookups[name] = rank_io(inputs, 0).lookup
    assert lookups["bf16 both ways"] * 2 == lookups["fp32"] == lookups["fp16 forward only"] > 0
    one = inputs_from_config(load_config(None, base[1:] + cases["bf16 both ways"][0]))
    assert one.world_size == 1 and one.tbe_output_bytes == 4
    assert tbe_output_precision(load_config(None, base[1:] + cases["bf16 both ways"][0]).sharding, 1) is None
