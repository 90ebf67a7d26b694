"""Weak-scaling model (recpipe.planner.scaling): all-to-all bytes against hand
computations on tiny configs, growth with W, zero traffic at W = 1, the time model's
combination rules, `recpipe plan --scaling`, and docs/scaling.md quoting the model's
current output."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from recpipe.cli import main
from recpipe.exit_codes import EXIT_BAD_CONFIG
from recpipe.config import load_config
from recpipe.planner import inputs_from_config, predict_scaling
from recpipe.planner.scaling import GPUS, a2a_bytes, growth, predict_point, render_scaling

ROOT = Path(__file__).resolve().parents[1]
B, PF, D = 4, 2.0, 8  # samples per rank, ids per sample, embedding dim


def tiny(rows, tables=None, default=None, **kv):
    """A small DLRM: len(rows) tables of dim D, B samples per rank, PF ids per sample."""
    data = {
        "model.embedding_dim": D, "model.num_embeddings_per_feature": list(rows),
        "model.dense_arch_layer_sizes": [16, D], "model.over_arch_layer_sizes": [16, 1],
        "data.batch_size": B, "data.synthetic.mean_pooling_factors": PF,
        "sharding.default": default or {"type": "table_wise", "kernel": "fused"},
        "sharding.tables": tables or {}, **kv,
    }
    return load_config(None, copy.deepcopy(data))


def point(cfg, W):
    return predict_point(inputs_from_config(cfg, world_size=W, hbm_capacity_bytes=1 << 34, fbgemm=(1, 8)))


# ------------------------------------------------------------------ bytes by hand
def test_two_table_wise_tables_on_two_ranks():
    cfg = tiny([100, 100])  # t_cat_0 -> rank 0, t_cat_1 -> rank 1
    row = point(cfg, 2)
    kjt = B * (4 + 8 * PF)  # B int32 lengths + B*PF int64 ids of the other rank's feature
    assert row["input_a2a_bytes"] == row["input_a2a_bytes_mean"] == kjt == 80
    pooled = B * D * 4  # the owner returns B pooled rows of the peer's samples
    assert row["output_a2a_bytes"] == row["backward_a2a_bytes"] == pooled == 128
    params = inputs_from_config(cfg, world_size=2, fbgemm=(1, 8)).dense.num_params
    assert row["allreduce_bytes"] == int(2 * (2 - 1) / 2 * 4 * params)
    assert row["n_collectives"] == 1 + 2 + 1 + 1 + 1  # splits, lengths, values, out, bwd, one DDP bucket


def test_table_wise_owner_sends_more_than_it_receives():
    cfg = tiny([100, 10, 10], tables={"t_cat_0": {"rank": 0}, "t_cat_1": {"rank": 0}, "t_cat_2": {"rank": 0}})
    W = 4
    per = a2a_bytes(inputs_from_config(cfg, world_size=W, fbgemm=(1, 8)))
    assert per["output_a2a"][0] == ((W - 1) * 3 * B * D * 4, 0)  # rank 0 owns all 3 tables
    assert per["output_a2a"][1] == (0, 3 * B * D * 4)
    assert per["backward_a2a"][0] == (0, (W - 1) * 3 * B * D * 4)
    assert per["input_a2a"][0] == (0, (W - 1) * 3 * B * (4 + 8 * PF))
    assert per["input_a2a"][2] == (3 * B * (4 + 8 * PF), 0)


def test_row_wise_bucketizes_ids_by_row_block():
    cfg = tiny([10], default={"type": "row_wise", "kernel": "fused"})
    W = 4  # rows per rank [3, 3, 3, 1]
    share = [0.3, 0.3, 0.3, 0.1]
    per = a2a_bytes(inputs_from_config(cfg, world_size=W, fbgemm=(1, 8)))
    for r in range(W):
        sent = sum(B * (4 + 8 * PF * share[s]) for s in range(W) if s != r)
        received = (W - 1) * B * (4 + 8 * PF * share[r])
        assert per["input_a2a"][r] == pytest.approx((sent, received))
        ring = (W - 1) * B * D * 4  # reduce-scatter of [W*B, D] partial sums
        assert per["output_a2a"][r] == per["backward_a2a"][r] == (ring, ring)
    row = point(cfg, W)
    assert row["input_a2a_bytes"] == int(max(max(p) for p in per["input_a2a"]))


def test_column_wise_replicates_the_feature_to_every_shard():
    cfg = tiny([100], default={"type": "column_wise", "kernel": "fused"})
    row = point(cfg, 2)  # two shards of D/2 columns
    assert row["input_a2a_bytes"] == B * (4 + 8 * PF)
    assert row["output_a2a_bytes"] == B * (D // 2) * 4


def test_data_parallel_has_no_all_to_all_and_all_reduces_the_table():
    cfg = tiny([50, 70], default={"type": "data_parallel", "kernel": "dense"})
    W = 4
    row = point(cfg, W)
    assert row["input_a2a_bytes"] == row["output_a2a_bytes"] == row["backward_a2a_bytes"] == 0
    params = inputs_from_config(cfg, world_size=W, fbgemm=(1, 8)).dense.num_params + (50 + 70) * D
    assert row["allreduce_bytes"] == int(2 * (W - 1) / W * 4 * params)


# ------------------------------------------------------------------ growth, W = 1
@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_off_rank_bytes_grow_with_world_size(sharding):
    cfg = tiny([1000] * 8, default={"type": sharding, "kernel": "fused"})
    rows = predict_scaling(cfg, (1, 2, 4, 8))
    for kind in ("input_a2a", "output_a2a", "backward_a2a", "allreduce"):
        series = [r[f"{kind}_bytes_mean"] for r in rows]
        assert series[0] == 0 and all(a < b for a, b in zip(series, series[1:])), (kind, series)
    assert all(x > 1 for _, _, x in growth(rows))


def test_one_rank_has_no_off_rank_traffic():
    cfg = tiny([100, 200, 300], tables={"t_cat_1": {"type": "row_wise"}, "t_cat_2": {"type": "column_wise"}})
    (row,) = predict_scaling(cfg, (1,))
    assert all(row[k] == 0 for k in row if k.endswith("_bytes") or k.endswith("_bytes_mean"))
    assert row["comm_ms"] == 0 and row["n_collectives"] == 0


def test_time_model_combines_as_documented():
    for r in predict_scaling(load_config(str(ROOT / "configs/bench/dlrm_criteo.yaml"), []), (1, 8), gpu="H100"):
        times = {"compute": r["compute_ms"], "comm": r["comm_ms"], "h2d": r["h2d_ms"]}
        assert r["bound_ms"] == max(times.values()) and r["bound_resource"] == max(times, key=times.get)
        assert r["serial_ms"] == pytest.approx(sum(times.values()))
        assert r["compute_ms"] == pytest.approx(r["emb_ms"] + r["dense_ms"] + r["stream_ms"])
        assert r["samples_per_s_per_gpu"] == pytest.approx(1e3 * 8192 / r["bound_ms"])
        assert r["assumptions"]["hbm_bytes_per_s"] == GPUS["H100"].hbm_bytes_per_s
        assert "not a measurement" in r["kind"]


def test_errors_name_the_world_size():
    with pytest.raises(ValueError, match="world size 3: t_cat_0: dim 8 does not split over 3"):
        predict_scaling(tiny([100], default={"type": "column_wise", "kernel": "fused"}), (2, 3))
    with pytest.raises(ValueError, match=r"world size 2: .*sharding.tables.t_cat_0.rank=3"):
        predict_scaling(tiny([100], tables={"t_cat_0": {"rank": 3}}, **{"distributed.nproc": 4}), (4, 2))
    with pytest.raises(ValueError, match="integers >= 1"):
        predict_scaling(tiny([100]), (0, 2))
    with pytest.raises(ValueError, match="gpu 'A100'"):
        predict_scaling(tiny([100]), (2,), gpu="A100")


# ------------------------------------------------------------------ CLI and docs
CRITEO = str(ROOT / "configs/bench/dlrm_criteo.yaml")


def test_cli_table_prints_the_prediction_after_the_memory_plan(capsys):
    assert main(["plan", "--config", CRITEO, "--scaling", "1,2,4,8"]) == 0
    out = capsys.readouterr().out
    memory, scaling = out.split("weak-scaling prediction")
    assert "rank 0" in memory and "not a measurement" in scaling
    lines = [ln.split() for ln in scaling.splitlines() if ln.strip()[:1].isdigit()]
    assert [ln[0] for ln in lines] == ["1", "2", "4", "8"]
    assert "grow x" in scaling


def test_cli_json_has_a_scaling_list(capsys):
    assert main(["plan", "--config", CRITEO, "--format", "json", "--scaling", "1,2,4,8"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["world_size"] for r in doc["scaling"]] == [1, 2, 4, 8] and "ranks" in doc
    assert main(["plan", "--config", CRITEO, "--format", "json"]) == 0
    assert "scaling" not in json.loads(capsys.readouterr().out)


def test_cli_bad_scaling_exits_2(capsys):
    assert main(["plan", "--config", CRITEO, "--scaling", "1,x"]) == EXIT_BAD_CONFIG
    cw = ["--set", "sharding.default.type=column_wise"]
    assert main(["plan", "--config", CRITEO, "--scaling", "3", *cw]) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert "--scaling '1,x'" in err and "world size 3" in err


@pytest.mark.parametrize("name", ["dlrm_criteo", "optimizer_heavy"])
def test_docs_quote_the_current_model(name):
    """docs/scaling.md pastes render_scaling's output; it must not drift from the code."""
    doc = (ROOT / "docs" / "scaling.md").read_text()
    rows = predict_scaling(load_config(str(ROOT / f"configs/bench/{name}.yaml"), []), (1, 2, 4, 8))
    for line in render_scaling(rows).splitlines():
        assert line.rstrip() in doc, line
