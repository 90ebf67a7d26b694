"""``recpipe train`` with a model and batches it has never seen (model.factory /
data.factory, configs/two_tower.yaml): it shards, pipelines, logs, evaluates,
checkpoints and resumes bit for bit like the built-in DLRM; bad factories are config
errors (exit 2) named before any process starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recpipe.cli import main
from recpipe.exit_codes import EXIT_BAD_CONFIG
from test_checkpoint import _full_state

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "two_tower.yaml"
SMALL = [
    "model.options={num_users: 200, num_items: 400, num_categories: 8, embedding_dim: 8, tower: [16, 8]}",
    "data.options={num_batches: 6, num_eval_batches: 2, max_history: 4}",
    "data.batch_size=64",
    "train.epochs=2",
    "train.eval_every=0",
    "train.log_every=4",
    "train.progress=false",
    "pipeline.name=semi_sync",
]


def _train(run: Path, steps: int, every: int, *extra: str) -> int:
    args = ["train", "--config", str(CONFIG)]
    for pair in SMALL + [f"train.steps={steps}", f"checkpoint.dir={run / 'ckpt'}", f"checkpoint.every={every}",
                         "checkpoint.keep=1", f"logging.run_dir={run}", *extra]:
        args += ["--set", pair]
    return main(args)


@pytest.mark.slow
def test_factory_model_trains_logs_and_resumes_bit_identically(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(ROOT)  # the factories are imported from the working directory
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # Same checkpoint (drain) points in both runs: semi_sync's staleness restarts at every drain.
    assert _train(straight, steps=9, every=4) == 0
    out = capfd.readouterr().out
    assert "user_ebc <- batch.features['user']" in out and "history_ec <- batch.history" in out  # found inputs
    assert "sharding: 5 tables over 2 ranks" in out and "row_wise" in out  # the model's own tables, placed
    # `recpipe plan` names each of them (the start line of `recpipe train` only counts them)
    assert main(["plan", "--config", str(CONFIG), *[a for pair in SMALL for a in ("--set", pair)]]) == 0
    assert "item_history" in capfd.readouterr().out
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["steps"] == 9 and summary["pipeline"] == "semi_sync" and summary["epoch"] == 1
    assert summary["loss"] is not None and summary["eval_auc"] is not None  # the output contract's metrics
    assert list(straight.glob("events.out.tfevents.*"))
    # Stopped after step 4 (inside epoch 0), resumed to 9 (into epoch 1): the same tensors.
    assert _train(resumed, steps=4, every=4) == 0
    assert _train(resumed, steps=9, every=4) == 0
    assert "resumed from" in capfd.readouterr().out
    a = _full_state(straight / "ckpt" / "step_00000009", tmp_path)
    b = _full_state(resumed / "ckpt" / "step_00000009", tmp_path)
    assert a.keys() == b.keys() and any("item_history" in k for k in a)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key


def test_bad_factories_are_config_errors_naming_the_key(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    cases = [
        ("model.factory=scripts.no_such_module:build", "model.factory='scripts.no_such_module:build': cannot import"),
        ("model.factory=scripts.two_tower:no_such_function", "has no attribute 'no_such_function'"),
        ("model.factory=scripts.two_tower:make_batch", "model.factory"),  # wrong signature: raises inside
        ("model.factory=scripts.two_tower:USER_FEATURES", "is a tuple, not a function"),
        ("sharding.tables={no_such_table: {type: row_wise}}", "sharding.tables.no_such_table"),
    ]
    for override, needle in cases:
        code = main(["train", "--config", str(CONFIG), "--set", override, "--set", f"logging.run_dir={tmp_path}"])
        err = capsys.readouterr().err
        assert code == EXIT_BAD_CONFIG, (override, code, err[-2000:])
        assert needle in err, (override, err[-2000:])
