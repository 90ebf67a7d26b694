"""``recpipe train``'s start-up: the time from the command to the first timed step, phase by
phase, in summary.json (``startup``) and in the log; the training batches' producers start
before the model is built; the start-up ends once every speed feature is ready."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipeline_harness import small_config
from recpipe.cli import main
from recpipe.train import trainer as trainer_module
from recpipe.train.startup import StartupClock, process_start_time

CONFIG = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
TINY = [
    "model.num_embeddings_per_feature=[100, 300, 500, 1000]",
    "model.embedding_dim=8",
    "model.dense_arch_layer_sizes=[16, 8]",
    "model.over_arch_layer_sizes=[16, 1]",
    "sharding.tables={}",
    "data.batch_size=32",
    "data.synthetic.num_eval_batches=1",
    "train.steps=6",
    "train.log_every=2",
    "train.eval_every=0",
    "train.progress=false",
]
COMMAND_PHASES = ["imports", "config", "preflight", "launch", "process_group", "checkpoint_choice", "data_start",
                  "model", "pipeline", "run_setup", "first_step", "first_batch"]


def test_process_start_time_is_before_now_and_after_boot():
    started = process_start_time()
    assert time.time() - 3600 * 24 * 365 < started <= time.time()


def test_clock_laps_phases_in_order_and_moves_a_wait():
    clock = StartupClock(started_at=time.time() - 1.0)
    clock.lap("imports")
    time.sleep(0.05)
    clock.lap("first_step")
    clock.move(0.02, "first_step", "first_batch")
    clock.done(first_timed_step=2)
    assert list(clock.phases) == ["imports", "first_step", "first_batch"]
    assert clock.phases["imports"] >= 1.0
    assert clock.phases["first_step"] == pytest.approx(clock.phases["first_batch"] + 0.03, abs=0.03)
    assert clock.to_first_timed_step_s == pytest.approx(sum(clock.phases.values()), abs=1e-6)
    summary = clock.summary()
    assert summary["first_timed_step"] == 2 and set(summary["phases_s"]) == set(clock.phases)
    assert re.match(r"start-up: [0-9.]+ s to the first timed step \(step 2\): imports 1\.\d, ", clock.line())


@pytest.mark.slow
def test_train_reports_its_start_up_in_summary_and_log(tmp_path, capfd):
    args = ["train", "--config", str(CONFIG), "--set", "distributed.nproc=1", "--set", f"logging.run_dir={tmp_path}"]
    for pair in TINY:
        args += ["--set", pair]
    started = time.time()
    assert main(args) == 0
    startup = json.loads((tmp_path / "summary.json").read_text())["startup"]
    assert list(startup["phases_s"]) == COMMAND_PHASES  # every phase, in the order it ran
    assert all(seconds >= 0 for seconds in startup["phases_s"].values()), startup
    assert startup["first_timed_step"] == 2  # nothing to capture or compile: the step after the first
    # The clock starts with this process (the test's), before main() was called.
    assert startup["to_first_timed_step_s"] > time.time() - started - 60
    assert startup["to_first_timed_step_s"] == pytest.approx(sum(startup["phases_s"].values()), abs=0.01)
    assert startup["compile_cache"] == {} or all(v >= 0 for v in startup["compile_cache"].values())
    out = capfd.readouterr().out
    assert re.search(r"start-up: [0-9.]+ s to the first timed step \(step 2\): imports [0-9.]+, config", out), out


class _ReadyAfter:
    """A speed feature stand-in that is ready after its ``calls``-th question."""

    def __init__(self, calls: int) -> None:
        self.calls = calls

    @property
    def ready(self) -> bool:
        self.calls -= 1
        return self.calls <= 0

    def summary(self) -> dict:
        return {}


def _in_process(cfg, prepare=None) -> trainer_module.Trainer:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer = trainer_module.Trainer(cfg, torch.device("cpu"))
        if prepare is not None:
            prepare(trainer)
        trainer.fit()
        return trainer
    finally:
        dist.destroy_process_group()


def test_start_up_ends_when_every_speed_feature_is_ready(tmp_path):
    cfg = small_config(1, [f"logging.run_dir={tmp_path}", "train.steps=8", "train.eval_every=0", "train.progress=false",
                           "data.synthetic.num_eval_batches=1"])
    trainer = _in_process(cfg, lambda t: t.pipeline.applied.append(_ReadyAfter(3)))  # asked after steps 1, 2, 3
    startup = trainer.startup.summary()
    assert startup["first_timed_step"] == 4
    assert list(startup["phases_s"])[-3:] == ["first_step", "first_batch", "warm_up"]


def test_producers_start_before_the_model_is_built(tmp_path, monkeypatch):
    from recpipe.data import stream

    running_at_build = []
    shard_model = trainer_module.shard_model

    def observed(*args, **kwargs):
        running_at_build.append([p for p in stream._Running.producers if p.running()])
        return shard_model(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "shard_model", observed)
    cfg = small_config(1, [f"logging.run_dir={tmp_path}", "train.steps=4", "train.eval_every=0", "train.progress=false",
                           "data.num_workers=1", "data.workers_kind=process", "data.synthetic.num_eval_batches=1"])
    trainer = _in_process(cfg)
    assert trainer.position.step == 4
    assert len(running_at_build) == 1 and running_at_build[0], "no producer ran while the model was built"
    phases = list(trainer.startup.phases)
    assert phases.index("data_start") < phases.index("model")


def test_a_resume_starts_its_producers_at_the_checkpoint_and_makes_the_padding_template_in_place(tmp_path, monkeypatch):
    """Resumed mid-epoch: the producers start at the checkpoint's batch before the model is built,
    the checkpoint is loaded after it, and the padding template (the epoch's first batch) is made
    without producers of its own."""
    common = [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every=4", "train.eval_every=0", "train.progress=false",
              "data.num_workers=1", "data.workers_kind=process", "data.synthetic.num_eval_batches=1"]
    _in_process(small_config(1, [*common, f"logging.run_dir={tmp_path / 'a'}", "train.steps=4"]))
    calls = []
    make_dataloader = trainer_module.make_dataloader

    def recorded(cfg, **kwargs):
        calls.append((cfg.data.num_workers, kwargs.get("start_batch", 0)))
        return make_dataloader(cfg, **kwargs)

    monkeypatch.setattr(trainer_module, "make_dataloader", recorded)
    trainer = _in_process(small_config(1, [*common, f"logging.run_dir={tmp_path / 'b'}", "train.steps=8"]))
    assert trainer.start_step == 4 and trainer.position.step == 8
    assert calls[:2] == [(1, 4), (0, 0)], calls  # the training batches from batch 4; the template: batch 0, in place
    phases = list(trainer.startup.phases)
    assert phases.index("checkpoint_choice") < phases.index("data_start") < phases.index("model") \
        < phases.index("checkpoint_load"), phases
    expected = next(iter(make_dataloader(trainer.cfg, rank=0, world_size=1, split="train", epoch=0)))
    assert torch.equal(trainer.pipeline.padding_template.dense_features, expected.dense_features)


def test_an_evaluation_before_the_speed_features_are_ready_is_its_own_phase(tmp_path):
    cfg = small_config(1, [f"logging.run_dir={tmp_path}", "train.steps=8", "train.eval_every=2", "train.progress=false",
                           "data.synthetic.num_eval_batches=1"])
    trainer = _in_process(cfg, lambda t: t.pipeline.applied.append(_ReadyAfter(3)))
    startup = trainer.startup.summary()
    assert startup["first_timed_step"] == 4  # still the step after the third: the segment end at 2 did not end it
    assert list(startup["phases_s"])[-4:] == ["first_step", "first_batch", "warm_up", "segment_ends"]


def test_a_run_whose_speed_features_never_get_ready_has_no_first_timed_step(tmp_path):
    cfg = small_config(1, [f"logging.run_dir={tmp_path}", "train.steps=4", "train.eval_every=0", "train.progress=false",
                           "data.synthetic.num_eval_batches=1"])
    trainer = _in_process(cfg, lambda t: t.pipeline.applied.append(_ReadyAfter(100)))
    startup = trainer.startup.summary()
    assert startup["first_timed_step"] is None and startup["to_first_timed_step_s"] is None
    assert json.loads((tmp_path / "summary.json").read_text())["startup"]["first_timed_step"] is None
