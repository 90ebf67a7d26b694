"""``recpipe export``: a sharded checkpoint (row- and column-wise tables, an fp16
table, 1 and 2 Gloo ranks) -> one state_dict; the unsharded model built on CPU and
loaded from it predicts exactly what the sharded model predicts on the same batch.
``--format program``: the servable torch.export program, loaded in a fresh process that
imports neither recpipe nor torchrec, predicts the same bit for bit (fp32 tables) or within
the stated tolerance (fp16, TorchRec's int8 / int4 tables), at any batch size from one sample,
loads without a line of output, and its quantized tables take their bits' share of the bytes.
A model.factory model (tests/serving_models.py) is served the same way through its ``serve``;
one that torch.export cannot trace is one line naming the module and the line (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recpipe.cli import main
from recpipe.config import load_config
from recpipe.data import make_dataloader
from recpipe.launcher import launch_local
from recpipe.errors import CheckpointError
from recpipe.exit_codes import EXIT_BAD_CONFIG, EXIT_CHECKPOINT, EXIT_OK

CONFIG = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
TINY = [
    "model.num_embeddings_per_feature=[100, 300, 500, 1000]",
    "model.embedding_dim=8",
    "model.dense_arch_layer_sizes=[16, 8]",
    "model.over_arch_layer_sizes=[16, 1]",
    "sharding.tables={t_cat_1: {type: row_wise}, t_cat_2: {type: column_wise}, t_cat_3: {weights_precision: fp16}}",
    "data.batch_size=32",
    "data.synthetic.num_eval_batches=1",
    "train.steps=3",
    "train.eval_every=0",
    "train.log_every=3",
    "train.progress=false",
    "logging.tensorboard=false",
]


def _config(tmp_path: Path, nproc: int):
    return load_config(CONFIG, [*TINY, f"distributed.nproc={nproc}", f"logging.run_dir={tmp_path / 'run'}",
                                f"checkpoint.dir={tmp_path / 'ckpt'}"])


def _logits(model, batch) -> torch.Tensor:
    from recpipe.train.metrics import click_outputs

    return click_outputs(model(batch)[1])[0]


def _train_then_predict(cfg, out: Path) -> None:
    """One rank: train ``train.steps`` steps (saving a checkpoint at the end), then
    the sharded model's eval-mode logits of this rank's first eval batch."""
    import torch.distributed as dist

    from recpipe.train.trainer import Trainer, start_rank

    trainer = Trainer(cfg, torch.device("cpu") if dist.is_initialized() else start_rank(cfg))
    trainer.fit()
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = next(iter(make_dataloader(cfg, rank=rank, world_size=world, split="eval")))
    model = trainer.sharded.model
    model.eval()
    with torch.no_grad(), trainer.pipeline.detached():
        torch.save(_logits(model, batch), out / f"logits_rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_exported_model_predicts_what_the_sharded_model_predicts(tmp_path, nproc, capsys, monkeypatch):
    from recpipe import export
    from recpipe.models import build_model

    cfg = _config(tmp_path, nproc)
    if nproc == 1:  # in this process: no rank to start
        import torch.distributed as dist

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            _train_then_predict(cfg, tmp_path)
        finally:
            dist.destroy_process_group()
    else:
        launch_local(_train_then_predict, nproc, cfg, tmp_path)
    reads = []
    real_load = export._load
    monkeypatch.setattr(export, "_load", lambda path, tensors: (reads.append(sorted(tensors)), real_load(path, tensors)))
    out = tmp_path / "model.pt"
    overrides = [arg for pair in [*TINY, f"distributed.nproc={nproc}"] for arg in ("--set", pair)]
    args = ["export", "--config", str(CONFIG), *overrides, "--checkpoint", str(tmp_path / "ckpt")]
    assert main([*args, "--out", str(out)]) == EXIT_OK
    printed = capsys.readouterr().out
    assert f"{out}: 4 embedding tables and 8 dense tensors from {tmp_path / 'ckpt' / 'step_00000003'}" in printed
    # Table by table: one read for the dense tensors, then one per table.
    tables = [f"model.model.sparse_arch.embedding_bag_collection.embedding_bags.t_cat_{i}.weight" for i in range(4)]
    assert len(reads) == 5 and [r for r in reads if len(r) == 1] == [[t] for t in tables]

    state = torch.load(out, weights_only=True)
    assert all(t.dtype == torch.float32 for t in state.values())
    model = build_model(cfg.model, device=torch.device("cpu"))
    model.load_state_dict(state)  # strict: every key, every shape
    model.eval()
    with torch.no_grad():
        for rank in range(nproc):
            batch = next(iter(make_dataloader(cfg, rank=rank, world_size=nproc, split="eval")))
            sharded = torch.load(tmp_path / f"logits_rank{rank}.pt", weights_only=True)
            assert torch.equal(_logits(model, batch), sharded), f"rank {rank}"

    # --fp16-tables: tables in half precision, dense weights as they were.
    half = tmp_path / "half.pt"
    assert main([*args, "--out", str(half), "--fp16-tables"]) == EXIT_OK
    halves = torch.load(half, weights_only=True)
    key = tables[0].removeprefix("model.")
    assert halves[key].dtype == torch.float16 and torch.equal(halves[key], state[key].half())
    assert all(v.dtype == torch.float32 for k, v in halves.items() if "embedding_bags" not in k)
    assert half.stat().st_size < out.stat().st_size

    # A config of another model: an error naming what differs, nothing written.
    other = tmp_path / "other.pt"
    assert main([*args, "--set", "model.num_embeddings_per_feature=[100, 300, 500, 999]", "--out", str(other)]) == EXIT_CHECKPOINT
    err = capsys.readouterr().err
    assert "does not hold the config's model (the built-in model)" in err
    assert "t_cat_3.weight: [1000, 8] saved, [999, 8] in the config's model" in err and not other.exists()


def test_a_directory_without_a_checkpoint_is_an_error(tmp_path, capsys):
    from recpipe.export import export_checkpoint

    with pytest.raises(CheckpointError, match="no complete checkpoint in it"):
        (tmp_path / "empty").mkdir()
        export_checkpoint(_config(tmp_path, 1), tmp_path / "empty", tmp_path / "x.pt")
    assert main(["export", "--config", str(CONFIG), "--checkpoint", str(tmp_path / "nowhere"),
                 "--out", str(tmp_path / "x.pt")]) == EXIT_CHECKPOINT
    assert "--checkpoint" in capsys.readouterr().err and not (tmp_path / "x.pt").exists()


def _can_mount_tmpfs() -> bool:
    from test_faults import _can_mount_tmpfs as can

    return can()


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs `unshare -rm` (user and mount namespaces) to mount a tmpfs")
def test_export_onto_a_read_only_filesystem_is_one_line_naming_out(tmp_path):
    from recpipe.models import build_model
    from test_checkpoint import dcp_checkpoint

    sets = [pair for pair in TINY if not pair.startswith("sharding.")]
    model = build_model(load_config(CONFIG, sets).model, device=torch.device("cpu"))
    ckpt = dcp_checkpoint(tmp_path / "ckpt", 3, {"model": model.state_dict()})
    read_only = tmp_path / "ro"
    read_only.mkdir()
    out = read_only / "model.pt"
    mount_read_only = 'mount -t tmpfs -o ro tmpfs "$1" || exit 90; shift; exec "$@"'
    cmd = ["unshare", "-rm", "sh", "-c", mount_read_only, "sh", str(read_only), sys.executable, "-m", "recpipe",
           "export", "--config", str(CONFIG), *[arg for pair in sets for arg in ("--set", pair)], "--checkpoint",
           str(ckpt), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == EXIT_CHECKPOINT, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        f"recpipe export: cannot write --out {out}: Read-only file system [exit {EXIT_CHECKPOINT}]"], done.stderr[-3000:]


# ------------------------------------------------------- servable program
SERVE = [*TINY, "data.batch_size=256", "data.synthetic.num_eval_batches=4", "train.steps=20", "train.log_every=10",
         "optimizer.embedding.lr=0.1", "optimizer.dense.lr=0.1"]
# What a program with fp16 or quantized tables may differ by from the trained model on this
# test's 2048 eval samples: (max |p - p_trained|, |AUC - AUC_trained|). Measured (torch 2.13,
# fbgemm-gpu 1.8, torchrec 1.8, CPU): fp16 8.1e-5, 2.2e-6; int8 1.2e-3, 8.0e-5; int4 1.6e-2, 5.4e-4.
TOLERANCE = {"fp16": (1e-3, 1e-4), "int8": (1e-2, 1e-3), "int4": (5e-2, 1e-3)}

LOAD_AND_PREDICT = """
import sys, torch
quantized = sys.argv[3] in ("int8", "int4")
if quantized:
    import fbgemm_gpu  # registers FBGEMM's inference kernels, which the program calls
program = torch.export.load(sys.argv[1]).module()
batches = torch.load(sys.argv[2], weights_only=True)
out = [program(b["dense_features"], b["values"], b["lengths"]) for b in batches]
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("recpipe", "torchrec"))
assert not loaded, loaded
torch.save(out, sys.argv[2] + "." + sys.argv[3] + ".out")
"""


def _eval_batches_and_logits(cfg, out: Path) -> None:
    """One rank: train, then this rank's eval batches as plain tensors with the sharded model's logits."""
    import torch.distributed as dist

    from recpipe.train.trainer import Trainer, start_rank

    trainer = Trainer(cfg, start_rank(cfg))
    trainer.fit()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = trainer.sharded.model
    model.eval()
    saved = []
    with torch.no_grad(), trainer.pipeline.detached():
        for batch in make_dataloader(cfg, rank=rank, world_size=world, split="eval"):
            kjt = batch.sparse_features
            saved.append({"dense_features": batch.dense_features, "values": kjt.values(), "lengths": kjt.lengths(),
                          "labels": batch.labels, "logits": _logits(model, batch)})
    torch.save(saved, out / f"eval_rank{rank}.pt")


@pytest.mark.slow
def test_servable_program_loads_without_recpipe_and_predicts_like_the_trained_model(tmp_path, capsys):
    from torchmetrics.functional.classification import binary_auroc

    cfg = load_config(CONFIG, [*SERVE, "distributed.nproc=2", f"logging.run_dir={tmp_path / 'run'}",
                               f"checkpoint.dir={tmp_path / 'ckpt'}"])
    launch_local(_eval_batches_and_logits, 2, cfg, tmp_path)
    batches = [b for rank in range(2) for b in torch.load(tmp_path / f"eval_rank{rank}.pt", weights_only=True)]
    inputs = tmp_path / "inputs.pt"
    torch.save([{k: b[k] for k in ("dense_features", "values", "lengths")} for b in batches], inputs)
    trained = torch.cat([torch.sigmoid(b["logits"]) for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    auc = binary_auroc(trained, labels.long()).item()
    overrides = [arg for pair in [*SERVE, "distributed.nproc=2"] for arg in ("--set", pair)]
    predicted = {}
    for tables in ("fp32", "fp16", "int8", "int4"):
        out = tmp_path / f"model_{tables}.pt"
        assert main(["export", "--config", str(CONFIG), *overrides, "--checkpoint", str(tmp_path / "ckpt"), "--out",
                     str(out), "--format", "program", "--tables", tables]) == EXIT_OK
        assert f"{out.with_suffix('.pt2')}: torch.export program, {tables} tables" in capsys.readouterr().out
        assert out.exists()  # the state dict beside it
        # a fresh process that imports neither recpipe nor torchrec
        done = subprocess.run([sys.executable, "-c", LOAD_AND_PREDICT, str(out.with_suffix(".pt2")), str(inputs), tables],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        assert done.returncode == 0, done.stderr[-3000:]
        predicted[tables] = torch.cat(torch.load(f"{inputs}.{tables}.out", weights_only=True))
    assert torch.equal(predicted["fp32"], trained), "the fp32 program does not predict bit for bit what the trained model does"
    measured = {}
    for tables, (max_diff, max_auc_diff) in TOLERANCE.items():
        diff = (predicted[tables] - trained).abs().max().item()
        auc_diff = abs(binary_auroc(predicted[tables], labels.long()).item() - auc)
        measured[tables] = (diff, auc_diff)
        assert 0 < diff <= max_diff and auc_diff <= max_auc_diff, (tables, diff, auc_diff)
    print(f"eval AUC {auc:.4f}; program vs trained model, (max |p - p_trained|, |AUC - AUC_trained|): {measured}")
    # the program's metadata, in the archive
    extra = {"recpipe.json": ""}
    torch.export.load(tmp_path / "model_int8.pt2", extra_files=extra)
    meta = json.loads(extra["recpipe.json"])
    assert meta["features"] == cfg.model.feature_names and meta["tables"] == "int8" and meta["needs"] == ["torch", "fbgemm_gpu"]
    assert meta["inputs"]["lengths"] == ["int32", ["4 * B"]]
    torch.export.load(tmp_path / "model_int4.pt2", extra_files=extra)
    assert json.loads(extra["recpipe.json"])["needs"] == ["torch", "fbgemm_gpu"]


# -------------------------------------- any batch size, a quiet load, the archive's bytes
# 132k rows of dimension 16: the tables (8.4 MB in fp32) outweigh the program's graph.
SIZES = ["model.num_embeddings_per_feature=[100000, 25000, 5000, 2000]", "model.embedding_dim=16",
         "model.dense_arch_layer_sizes=[16, 16]", "model.over_arch_layer_sizes=[16, 1]"]
FORMATS = ("fp32", "fp16", "int8", "int4")
BATCHES = (1, 2, 8192)
# Bytes per table row against fp32's (4 bytes a weight): fp16 2 bytes a weight; int8 and int4
# one byte and half a byte a weight plus the row's float16 scale and bias (4 bytes).
TABLE_SHARE = {"fp16": 2 / 4, "int8": (16 + 4) / (16 * 4), "int4": (8 + 4) / (16 * 4)}

PREDICT_AT_EACH_BATCH = """
import sys
sys.modules.update(dict.fromkeys(("recpipe", "torchrec", "serving_models"), None))  # none of them importable
import torch
import fbgemm_gpu  # registers FBGEMM's inference kernels, which the quantized programs call
out = {}
for tables in sys.argv[2:]:
    program = torch.export.load(f"{sys.argv[1]}/{tables}.pt2").module()
    for b in (1, 2, 8192):
        out[tables, b] = program(*torch.load(f"{sys.argv[1]}/inputs_{b}.pt", weights_only=True))
loaded = sorted(m for m, module in sys.modules.items() if module and m.split(".")[0] in ("recpipe", "torchrec"))
assert not loaded, loaded
torch.save(out, f"{sys.argv[1]}/predicted.pt")
"""


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """The programs of one model (random weights) in every format, the eager model's
    probabilities at each of BATCHES, and the fp32 tables' bytes."""
    from recpipe.models import build_model
    from recpipe.serving import example_inputs, serving_module

    out = tmp_path_factory.mktemp("programs")
    cfg = load_config(CONFIG, SIZES)
    torch.manual_seed(0)
    state = build_model(cfg.model, device=torch.device("cpu")).state_dict()
    eager = serving_module(cfg, state)
    expected = {}
    for b in BATCHES:
        inputs = example_inputs(cfg.model, b, seed=b)
        torch.save(inputs, out / f"inputs_{b}.pt")
        with torch.no_grad():
            expected[b] = eager(*inputs)
    _export_each_format(cfg, state, out)
    table_bytes = sum(rows * cfg.model.embedding_dim * 4 for rows in cfg.model.num_embeddings_per_feature)
    return out, expected, table_bytes


def _export_each_format(cfg, state: dict, out: Path) -> dict[str, dict]:
    """``out/<tables>.pt2`` for each of FORMATS; their metadata."""
    import warnings

    from recpipe.serving import export_program

    metas = {}
    for tables in FORMATS:
        with warnings.catch_warnings():
            # torch.export.save's word for tensors that share one storage, none of them whole
            warnings.filterwarnings("error", message="No complete tensor found in the group")
            metas[tables] = export_program(cfg, state, out / f"{tables}.pt2", tables)
    return metas


def _predict_at_each_batch_in_a_fresh_process(out: Path, expected: dict,
                                               tolerance: dict[str, float] | None = None) -> dict:
    """Each program of ``out`` at each of BATCHES, loaded in a process that cannot import recpipe
    or torchrec and prints nothing: fp32 bit for bit ``expected``, the others within ``tolerance``
    (max |p - expected| per format; TOLERANCE's by default); returns max |p - expected| per (tables, batch)."""
    tolerance = tolerance or {tables: max_diff for tables, (max_diff, _) in TOLERANCE.items()}
    done = subprocess.run([sys.executable, "-c", PREDICT_AT_EACH_BATCH, str(out), *FORMATS], capture_output=True,
                          text=True, timeout=300, cwd=out, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (done.stdout, done.stderr) == ("", ""), "loading the programs printed"
    predicted = torch.load(out / "predicted.pt", weights_only=True)
    measured = {}
    for b in BATCHES:
        assert torch.equal(predicted["fp32", b], expected[b]), f"fp32 at batch {b}"
        for tables, max_diff in tolerance.items():
            p = predicted[tables, b]
            measured[tables, b] = (p - expected[b]).abs().max().item()
            assert p.shape == (b,) and measured[tables, b] <= max_diff, (tables, b, measured[tables, b])
    return measured


def test_program_serves_any_batch_size_and_loads_without_output(programs):
    out, expected, _ = programs
    _predict_at_each_batch_in_a_fresh_process(out, expected)


def _tensor_bytes(archive: Path) -> int:
    """The bytes of the tensors a ``.pt2`` archive (a zip) stores: its ``data/`` files."""
    import zipfile

    with zipfile.ZipFile(archive) as z:
        return sum(i.file_size for i in z.infolist() if "/data/" in i.filename and not i.filename.endswith(".json"))


def _assert_tables_take_their_bits_share(out: Path, fp32_tables: int) -> dict[str, float]:
    """Each program of ``out`` stores its tables once, in TABLE_SHARE of fp32's bytes; returns
    each format's measured share."""
    stored = {tables: _tensor_bytes(out / f"{tables}.pt2") for tables in FORMATS}
    dense = stored["fp32"] - fp32_tables  # the dense weights and the model's small buffers
    assert 0 < dense < 0.05 * fp32_tables
    measured = {}
    for tables, share in TABLE_SHARE.items():
        measured[tables] = (stored[tables] - dense) / fp32_tables
        assert abs(measured[tables] - share) < 0.01, (tables, measured[tables], share, stored)
    return measured


def test_quantized_tables_take_their_bits_share_of_the_archive(programs):
    out, _, fp32_tables = programs
    _assert_tables_take_their_bits_share(out, fp32_tables)


# ------------------------------------------------------- a model.factory model
USER_MODEL = ["model.factory=serving_models:build_two_tower"]


def _export_user_model(out: Path, model, factory: str) -> tuple[Path, dict, dict]:
    """``model``'s programs in every format, its eager ``serve`` at each of BATCHES, and the
    programs' metadata."""
    model.eval()
    expected = {}
    for b in BATCHES:
        inputs = tuple(model.serving_inputs(b, seed=b).values())
        torch.save(inputs, out / f"inputs_{b}.pt")
        with torch.no_grad():
            expected[b] = model.serve(*inputs)
    return out, expected, _export_each_format(load_config(CONFIG, [f"model.factory={factory}"]), model.state_dict(), out)


@pytest.fixture(scope="module")
def user_programs(tmp_path_factory):
    """The programs of a model.factory model (random weights) in every format, the eager
    model's ``serve`` at each of BATCHES, and the programs' metadata."""
    from serving_models import TwoTowerRanker

    torch.manual_seed(0)
    return _export_user_model(tmp_path_factory.mktemp("user_programs"), TwoTowerRanker(torch.device("cpu")),
                              USER_MODEL[0].removeprefix("model.factory="))


def test_user_model_program_serves_any_batch_size_without_recpipe(user_programs):
    out, expected, metas = user_programs
    measured = _predict_at_each_batch_in_a_fresh_process(out, expected)
    assert all(diff > 0 for diff in measured.values()), measured  # the tables did change
    print(f"user model's program vs its eager serve, max |p - p_eager|: {measured}")
    assert list(metas["int8"]["inputs"]) == ["user_values", "user_lengths", "item_values", "item_lengths", "item_dense"]
    assert metas["int8"]["model"] == "serving_models.TwoTowerRanker" and metas["int8"]["needs"] == ["torch", "fbgemm_gpu"]
    assert metas["fp32"]["inputs"]["item_dense"][0] == "float32" and metas["fp32"]["inputs"]["item_dense"][1][1] == 3


# A model with an EmbeddingCollection (unpooled embeddings of a sequence) and an
# EmbeddingBagCollection (serving_models.SequenceRanker, 6.5 MB of fp32 tables). Its programs'
# max |p - p_eager| at batches of 1, 2 and 8192 samples, measured (torch 2.13, torchrec 1.8,
# fbgemm-gpu 1.8, CPU): fp16 8.3e-7, 3.6e-7, 4.2e-6; int8 1.3e-5, 7.9e-6, 3.8e-5; int4 3.3e-5,
# 3.4e-4, 6.7e-4. The bounds are about 5 times the largest.
SEQUENCE_TOLERANCE = {"fp16": 2e-5, "int8": 2e-4, "int4": 3e-3}


@pytest.fixture(scope="module")
def sequence_programs(tmp_path_factory):
    """SequenceRanker's programs (random weights) in every format, its eager ``serve`` at each of
    BATCHES, the programs' metadata and the fp32 tables' bytes."""
    from serving_models import SequenceRanker

    torch.manual_seed(0)
    model = SequenceRanker(torch.device("cpu"))
    table_bytes = sum(t.numel() * t.element_size() for t in [*model.user_ebc.state_dict().values(),
                                                              *model.seq_ec.state_dict().values()])
    return (*_export_user_model(tmp_path_factory.mktemp("sequence_programs"), model,
                                "serving_models:build_sequence_ranker"), table_bytes)


def test_embedding_collection_model_program_serves_any_batch_size_without_recpipe(sequence_programs):
    """fp16 halves the EmbeddingCollection's tables too, int8 / int4 quantize them (TorchRec's
    quantized EmbeddingCollection): each prediction differs from the eager model's, within bounds."""
    out, expected, metas, _ = sequence_programs
    measured = _predict_at_each_batch_in_a_fresh_process(out, expected, SEQUENCE_TOLERANCE)
    assert all(diff > 0 for diff in measured.values()), measured
    print(f"EmbeddingCollection model's program vs its eager serve, max |p - p_eager|: {measured}")
    assert list(metas["int4"]["inputs"]) == ["user_values", "user_lengths", "seq_values", "seq_lengths"]
    assert metas["int4"]["model"] == "serving_models.SequenceRanker" and metas["int4"]["needs"] == ["torch", "fbgemm_gpu"]


def test_embedding_collection_tables_are_stored_once_in_their_bits_share(sequence_programs):
    """Measured shares of the fp32 tables' bytes (dense weights apart): fp16 0.500, int8 0.313,
    int4 0.188: each table once, rows packed back to back, as for EmbeddingBagCollections."""
    out, _, _, fp32_tables = sequence_programs
    print(f"tables' share of fp32's bytes: {_assert_tables_take_their_bits_share(out, fp32_tables)}")


def _user_checkpoint(tmp_path: Path, build) -> Path:
    from test_checkpoint import dcp_checkpoint

    torch.manual_seed(0)
    return dcp_checkpoint(tmp_path / "ckpt", 3, {"model": build(torch.device("cpu")).state_dict()})


@pytest.mark.parametrize("model, tables, call", [
    ("TwoTowerRanker", "int4", "(user_values, user_lengths, item_values, item_lengths, item_dense) after `import fbgemm_gpu`"),
    ("SequenceRanker", "fp16", "(user_values, user_lengths, seq_values, seq_lengths) -> prediction"),
])
def test_recpipe_export_writes_a_user_models_program(tmp_path, capsys, model, tables, call):
    import serving_models

    build = getattr(serving_models, model)
    ckpt = _user_checkpoint(tmp_path, build)
    factory = {"TwoTowerRanker": USER_MODEL[0], "SequenceRanker": "model.factory=serving_models:build_sequence_ranker"}
    out = tmp_path / "model.pt"
    assert main(["export", "--config", str(CONFIG), "--set", factory[model], "--checkpoint", str(ckpt), "--out", str(out),
                 "--format", "program", "--tables", tables]) == EXIT_OK
    printed = capsys.readouterr().out
    assert (f"{out.with_suffix('.pt2')}: torch.export program, {tables} tables; torch.export.load(path).module()"
            f"{call}") in printed
    assert out.exists() and out.with_suffix(".pt2").exists()
    # the state dict holds every tensor of the checkpoint, the EmbeddingCollection's tables included
    torch.manual_seed(0)  # as _user_checkpoint built the model
    saved, exported = build(torch.device("cpu")).state_dict(), torch.load(out, weights_only=True)
    assert saved.keys() == exported.keys() and all(torch.equal(saved[k], exported[k]) for k in saved)


def test_a_user_model_torch_export_cannot_trace_is_one_line_naming_module_line_and_reason(tmp_path, capsys):
    import inspect

    from serving_models import BranchyRanker, Gate

    ckpt = _user_checkpoint(tmp_path, BranchyRanker)
    out = tmp_path / "model.pt"
    assert main(["export", "--config", str(CONFIG), "--set", "model.factory=serving_models:build_branchy", "--checkpoint",
                 str(ckpt), "--out", str(out), "--format", "program"]) == EXIT_BAD_CONFIG
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and not captured.out, captured
    source, first = inspect.getsourcelines(Gate.forward)
    branch = first + next(i for i, line in enumerate(source) if "if x.max() > 0" in line)
    assert lines[0].startswith("recpipe export: model.factory='serving_models:build_branchy' "
                               "(serving_models.BranchyRanker): torch.export cannot trace its serve at "
                               f"{inspect.getsourcefile(Gate)}:{branch} in module item_tower.1 (serving_models.Gate): "
                               "Could not guard on data-dependent expression"), lines[0]
    assert "torch.where or torch.cond" in lines[0] and lines[0].endswith(f"[exit {EXIT_BAD_CONFIG}]")
    assert not out.exists() and not out.with_suffix(".pt2").exists()


def test_a_user_model_without_serve_is_an_error_saying_what_to_add(tmp_path):
    from recpipe.errors import ConfigError
    from recpipe.serving import export_program

    cfg = load_config(CONFIG, ["model.factory=serving_models:build_without_serve"])
    with pytest.raises(ConfigError, match=r"\(serving_models.TrainOnly\) has no serve or serving_inputs: --format "
                                          r"program traces model.serve\(\*tensors\)"):
        export_program(cfg, {}, tmp_path / "x.pt2")
    assert not (tmp_path / "x.pt2").exists()
