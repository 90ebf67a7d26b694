"""``recpipe export``: a sharded checkpoint (row- and column-wise tables, an fp16
table, 1 and 2 Gloo ranks) -> one state_dict; the unsharded model built on CPU and
loaded from it predicts exactly what the sharded model predicts on the same batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recpipe.cli import main
from recpipe.config import load_config
from recpipe.data import make_dataloader
from recpipe.distributed import launch_local
from recpipe.errors import CheckpointError
from recpipe.exit_codes import EXIT_CHECKPOINT, EXIT_OK

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
