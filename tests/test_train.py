"""``recpipe train`` end to end: two Gloo processes on CPU, through the CLI."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from recpipe.cli import main
from recpipe.exit_codes import EXIT_BAD_DATA

CONFIG = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
SMALL = [
    "model.num_embeddings_per_feature=[500, 500, 200, 200, 100, 100]",
    "model.embedding_dim=8",
    "model.dense_arch_layer_sizes=[16, 8]",
    "model.over_arch_layer_sizes=[32, 1]",
    "sharding.tables={t_cat_0: {type: row_wise}}",
    "data.batch_size=256",
    "data.synthetic.num_eval_batches=4",
    "train.progress=false",
    "train.eval_every=20",
    "train.log_every=10",
    "optimizer.embedding.lr=0.1",
    "optimizer.dense.lr=0.1",
]


@pytest.mark.slow
def test_train_two_ranks_uneven_data_two_epochs(tmp_path, capfd):
    # Rank 0 has 23 batches per epoch, rank 1 has 25: rank 0 pads its last 2 steps,
    # so each epoch is 25 steps and two epochs are 50, whatever the segments are.
    overrides = SMALL + [
        "data.synthetic.num_batches_per_rank=[23, 25]",
        "train.epochs=2",
        "train.steps=1000",
        f"logging.run_dir={tmp_path}",
    ]
    args = ["train", "--config", str(CONFIG)]
    for pair in overrides:
        args += ["--set", pair]
    assert main(args) == 0

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 50 and summary["epoch"] == 2
    assert summary["samples"] == 50 * 256 * 2
    assert summary["pipeline"] == "sparse_dist" and summary["world_size"] == 2 and summary["device"] == "cpu"
    assert summary["speedups"] == {}  # none applies on CPU by default (CUDA graphs need CUDA)
    for key in ("loss", "eval_auc", "eval_ne", "wall_time_s", "versions"):
        assert summary[key] is not None, key
    assert set(summary["versions"]) >= {"torch", "torchrec", "fbgemm_gpu"}
    assert summary["eval_auc"] > 0.6, summary  # the planted model is learnable
    assert summary["eval_ne"] < 1.0, summary
    assert list(tmp_path.glob("events.out.tfevents.*")), "no TensorBoard event file"
    assert f"final eval AUC {summary['eval_auc']:.4f}" in capfd.readouterr().out
    # Log points publish one interval late (no drain), but every one arrives, once,
    # at its own step, and the last is what summary.json reports.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path)).Reload()
    for tag in ("train/loss", "train/auc", "train/accuracy", "train/ne", "throughput/samples_per_s"):
        assert [e.step for e in events.Scalars(tag)] == [10, 20, 30, 40, 50], tag
    assert events.Scalars("train/loss")[-1].value == pytest.approx(summary["loss"], rel=1e-6)
    assert [e.step for e in events.Scalars("eval/auc")] == [20, 40, 50]


def _epochs_worker(cfg, spanning: bool) -> None:
    """One rank: the trainer with one loader spanning the epochs, or (``spanning=False``) a
    loader per epoch, as for a source that cannot span them."""
    import recpipe.train.trainer as trainer

    if not spanning:
        trainer.spans_epochs = lambda data: False
    trainer.run_worker(cfg)


@pytest.mark.slow
def test_epochs_from_one_loader_train_as_a_loader_per_epoch(tmp_path):
    """Two ranks with 3 and 4 batches an epoch (rank 0 pads one step an epoch), 3 epochs,
    producer processes: every step's loss and the evaluations are the same whether one set
    of producers runs across the epochs or each epoch starts its own."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from recpipe.config import load_config
    from recpipe.launcher import launch_local

    runs = {}
    for spanning in (True, False):
        run = tmp_path / str(spanning)
        cfg = load_config(CONFIG, SMALL + ["data.synthetic.num_batches_per_rank=[3, 4]", "data.num_workers=2",
                                           "distributed.nproc=2", "train.epochs=3", "train.steps=1000",
                                           "train.log_every=1", "train.eval_every=4", f"logging.run_dir={run}"])
        launch_local(_epochs_worker, 2, cfg, spanning)
        events = EventAccumulator(str(run)).Reload()
        summary = json.loads((run / "summary.json").read_text())
        runs[spanning] = ([(e.step, e.value) for e in events.Scalars("train/loss")],
                          [(e.step, e.value) for e in events.Scalars("eval/auc")], summary["epoch"], summary["steps"])
    assert runs[True][2:] == (3, 12)
    assert [step for step, _ in runs[True][0]] == list(range(1, 13))
    assert runs[True] == runs[False]

@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_malformed_data_line_is_one_line_naming_file_and_line(tmp_path, capfd, monkeypatch):
    # A config that validates but cannot run: rank 1 reads a malformed Criteo TSV
    # line (line 2 has 3 columns) after training started. One line says where and
    # which exit code; no traceback (rank 0's collectives fail too, and stay quiet),
    # and no rank's traceback file is left in the temporary directory.
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # where torch.multiprocessing puts them
    tsv = tmp_path / "day_0.tsv"
    good = "\t".join(["1"] + ["3"] * 13 + ["a1"] * 26)
    tsv.write_text(good + "\n" + "0\t1\t2\n")
    args = ["train", "--config", str(CONFIG), "--set", "data.source=criteo_tsv",
            "--set", f"data.criteo.train_files=[{tsv}]", "--set", "data.batch_size=1",
            "--set", f"logging.run_dir={tmp_path}"]
    assert main(args) == EXIT_BAD_DATA
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if f"{tsv}:2" in line]
    assert len(lines) == 1 and "expected 40 tab-separated columns" in lines[0], err[-3000:]
    assert lines[0].startswith("recpipe train: rank 1: bad training data: ") and f"[exit {EXIT_BAD_DATA}]" in lines[0]
    assert "Traceback" not in err
    assert not list(tmp.glob("pytorch-errorfile-*")), list(tmp.iterdir())


@pytest.mark.slow
def test_torchrun_world_size_drives_the_rank_rules(tmp_path):
    # The YAML says 1 process, torchrun starts 2: a table pinned to rank 1 must be
    # valid (the config is checked against WORLD_SIZE), and both ranks train.
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "recpipe", "train", "--config", str(CONFIG), "--set", "distributed.nproc=1",
           "--set", "sharding.tables.t_cat_4={type: table_wise, rank: 1}", "--set", "train.steps=4",
           "--set", "train.eval_every=0", "--set", "data.batch_size=64", "--set", f"logging.run_dir={tmp_path}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4


def test_every_rank_runs_one_intra_op_thread():
    # The rule every rank applies after joining the process group, whoever launched it
    # (measurements in its docstring): one OpenMP thread per process on CUDA and CPU,
    # as torchrun gives several processes per node; the user's OMP_NUM_THREADS wins.
    from recpipe.train.trainer import intra_op_threads

    assert intra_op_threads({}) == 1
    assert intra_op_threads({"OMP_NUM_THREADS": "8"}) is None
