"""``logging.wandb``: rank 0 logs the TensorBoard scalars to W&B (a test double of the
``wandb`` module records the calls), a resumed run continues its W&B run, and asking
for W&B without the package is an exit-2 error naming the key before any process starts."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from recpipe.cli import main
from recpipe.config import ConfigError, load_config
from recpipe.exit_codes import EXIT_BAD_CONFIG

CONFIG = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
TINY = [
    "model.num_embeddings_per_feature=[100, 300, 500, 1000]",
    "model.embedding_dim=8",
    "model.dense_arch_layer_sizes=[16, 8]",
    "model.over_arch_layer_sizes=[16, 1]",
    "data.batch_size=32",
    "data.synthetic.num_eval_batches=1",
    "train.log_every=2",
    "train.eval_every=3",
    "train.progress=false",
    "distributed.nproc=1",
]


class FakeWandb(types.ModuleType):
    """Records ``init``, and the run's ``define_metric``, ``log`` and ``finish`` calls."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.calls: list[tuple] = []
        self.runs = 0

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        self.runs += 1
        calls, run_id = self.calls, kwargs.get("id") or f"run{self.runs}"

        class Run:
            id = run_id

            def define_metric(self, name, **kw):
                calls.append(("define_metric", name, kw))

            def log(self, data):
                calls.append(("log", dict(data)))

            def finish(self, exit_code=None):
                calls.append(("finish", exit_code))

        return Run()


def _fit(cfg) -> None:
    """One rank in this process (the test double lives in this process's sys.modules)."""
    from recpipe.train.trainer import Trainer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        Trainer(cfg, torch.device("cpu")).fit()
    finally:
        dist.destroy_process_group()


def _tensorboard(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_wandb_gets_the_tensorboard_scalars_and_a_resumed_run_continues(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run_dir = tmp_path / "run"
    common = [*TINY, f"logging.run_dir={run_dir}", f"checkpoint.dir={tmp_path / 'ckpt'}",
              "logging.wandb={project: recs, entity: team, name: tiny, mode: offline}"]
    cfg = load_config(CONFIG, [*common, "train.steps=6"])
    _fit(cfg)

    init = fake.calls[0]
    assert init[0] == "init" and init[1]["project"] == "recs" and init[1]["entity"] == "team"
    assert init[1]["name"] == "tiny" and init[1]["mode"] == "offline" and init[1]["dir"] == str(run_dir)
    assert init[1]["config"] == cfg.model_dump(mode="json") and "id" not in init[1]
    assert ("define_metric", "*", {"step_metric": "step"}) in fake.calls
    assert fake.calls[-1] == ("finish", 0)
    logged: dict[str, list[tuple[int, float]]] = {}
    for call in fake.calls:
        if call[0] == "log":
            data = dict(call[1])
            step = data.pop("step")
            for tag, value in data.items():
                logged.setdefault(tag, []).append((step, value))
    board = _tensorboard(run_dir)
    assert {"train/loss", "train/auc", "eval/auc", "eval/ne", "throughput/samples_per_s", "memory/peak_rss_gib"} <= set(board)
    assert set(logged) == set(board)
    for tag, points in board.items():  # TensorBoard keeps float32
        assert [(s, np.float32(v)) for s, v in logged[tag]] == [(s, np.float32(v)) for s, v in points], tag
    assert [s for s, _ in logged["eval/auc"]] == [3, 6] and [s for s, _ in logged["train/loss"]] == [2, 4, 6]
    assert (run_dir / "wandb_run_id").read_text().strip() == "run1"

    # Resumed from the checkpoint of step 6: the same W&B run goes on.
    _fit(load_config(CONFIG, [*common, "train.steps=8"]))
    resumed = [c for c in fake.calls if c[0] == "init"][1][1]
    assert resumed["id"] == "run1" and resumed["resume"] == "allow"
    assert fake.calls[-1] == ("finish", 0)
    assert [c[1]["step"] for c in fake.calls[fake.calls.index(("init", resumed)):] if c[0] == "log"][-1] == 8


def test_wandb_asked_for_without_the_package_stops_before_any_process(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable, whatever is installed
    args = ["train", "--config", str(CONFIG), "--set", f"logging.run_dir={tmp_path / 'run'}",
            "--set", "logging.wandb={project: recs}"]
    assert main(args) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert "logging.wandb is set but the wandb package is not installed" in err
    assert not (tmp_path / "run").exists()  # no rank started
    with pytest.raises(ConfigError, match=r"logging.wandb.project"):
        load_config(CONFIG, ["logging.wandb={entity: team}"])
    with pytest.raises(ConfigError, match=r"logging.wandb.mode"):
        load_config(CONFIG, ["logging.wandb={project: p, mode: sometimes}"])
