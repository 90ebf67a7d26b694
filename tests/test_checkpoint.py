"""Checkpoints are exact: stopping after k steps and resuming trains bit for bit
like a run that never stopped (model, fused embedding optimizer and dense optimizer
states), and incomplete checkpoints are ignored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from recpipe.cli import main
from recpipe.exit_codes import EXIT_BAD_CONFIG
from recpipe.train.checkpoint import METADATA_FILE, latest_checkpoint

K, M = 6, 5  # resume after K steps, then train M more
TINY = [
    "model.num_embeddings_per_feature=[100, 300, 500, 1000]",
    "model.embedding_dim=8",
    "model.dense_arch_layer_sizes=[16, 8]",
    "model.over_arch_layer_sizes=[16, 1]",
    "data.batch_size=64",
    # 4 batches per epoch: step K lies inside epoch 1, so the data position matters.
    "data.synthetic.num_batches=4",
    "data.synthetic.num_eval_batches=1",
    "train.epochs=3",
    "train.eval_every=0",
    "train.progress=false",
    "sharding.tables={t_cat_1: {type: row_wise}, t_cat_2: {type: column_wise}}",
    # Adam's state is created lazily at the first step: a fresh optimizer has none.
    "optimizer.dense.name=adam",
    "distributed.nproc=2",
    "distributed.backend=gloo",
    "train.device=cpu",
]


def _train(config: Path, run: Path, steps: int, every: int) -> int:
    overrides = TINY + [
        f"train.steps={steps}",
        f"checkpoint.dir={run / 'ckpt'}",
        f"checkpoint.every={every}",
        "checkpoint.keep=1",
        f"logging.run_dir={run}",
    ]
    args = ["train", "--config", str(config)]
    for pair in overrides:
        args += ["--set", pair]
    return main(args)


def _flat(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _full_state(checkpoint: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, shards reassembled (no process group needed)."""
    target = tmp_path / f"{checkpoint.parent.parent.name}.pt"
    dcp_to_torch_save(checkpoint, target)
    return _flat(torch.load(target, weights_only=False))


@pytest.mark.slow
def test_resume_trains_bit_identically(tmp_path, capfd):
    config = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert _train(config, straight, steps=K + M, every=0) == 0
    assert _train(config, resumed, steps=K, every=K) == 0  # "interrupted" after step K
    meta = json.loads((resumed / "ckpt" / f"step_{K:08d}" / METADATA_FILE).read_text())
    assert (meta["step"], meta["epoch"], meta["batch"]) == (K, 1, 2)
    assert _train(config, resumed, steps=K + M, every=K) == 0
    assert f"resumed from {resumed / 'ckpt' / f'step_{K:08d}'}: step {K}, epoch 1, batch 2" in capfd.readouterr().out
    assert [p.name for p in (resumed / "ckpt").iterdir()] == [f"step_{K + M:08d}"]  # checkpoint.keep=1

    a = _full_state(straight / "ckpt" / f"step_{K + M:08d}", tmp_path)
    b = _full_state(resumed / "ckpt" / f"step_{K + M:08d}", tmp_path)
    assert a.keys() == b.keys()
    # The comparison covers the sharded tables, the fused row-wise Adagrad momentum
    # and Adam's moments of the dense weights.
    assert sum(k.startswith("model.") and "embedding_bags" in k for k in a) == 4
    assert sum(k.endswith("momentum1") for k in a) == 4
    assert any(k.endswith("exp_avg_sq") for k in a)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"resumed run differs from the uninterrupted one in {different}"


def test_incomplete_checkpoint_is_ignored_with_a_warning(tmp_path):
    complete, partial = tmp_path / "step_00000003", tmp_path / "step_00000005"
    complete.mkdir()
    (complete / METADATA_FILE).write_text("{}")
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half-written")
    with pytest.warns(UserWarning, match="ignoring incomplete checkpoint .*step_00000005"):
        assert latest_checkpoint(tmp_path) == complete
    (complete / METADATA_FILE).unlink()
    with pytest.warns(UserWarning):
        assert latest_checkpoint(tmp_path) is None


def test_fresh_run_refuses_a_directory_with_checkpoints(tmp_path, capsys):
    old = tmp_path / "ckpt" / "step_00000010"
    old.mkdir(parents=True)
    (old / METADATA_FILE).write_text("{}")
    config = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
    code = main(["train", "--config", str(config), "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--set", "checkpoint.resume=false"])
    assert code == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert "checkpoint.resume=false" in err and "step_00000010" in err
