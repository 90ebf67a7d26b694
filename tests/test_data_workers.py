"""data.num_workers: auto (recpipe/data/workers.py, recpipe.data.loader.with_sized_workers) and the
trainer's account of the time it waits for batches (recpipe.train.clock.LoaderWait)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from recpipe.config import load_config
from recpipe.data import make_dataloader
from recpipe.data.loader import with_sized_workers
from recpipe.data.workers import TARGET_SAMPLES_PER_S, rank_cores, size_workers
from recpipe.system import local_world_size
from recpipe.train.clock import LoaderWait

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("cores,seconds,batch,on_cpu,workers", [
    (16, 0.013, 8192, False, 13),  # a synthetic Criteo batch on a GPU host: ceil(13 ms x 8M/s / 8192)
    (4, 0.013, 8192, False, 3),  # too few cores: all but the training loop's
    (16, 0.0005, 8192, False, 1),  # cheap batches (memory maps): one producer keeps up
    (16, None, 8192, False, 15),  # unmeasured: every spare core
    (2, 0.013, 8192, True, 1),  # a CPU rank's math shares its cores: half for producers
    (1, 0.013, 8192, True, 0),  # two CPU ranks on two cores: batches made in the loop
    (1, 0.013, 8192, False, 0),  # one core: the loop's
])
def test_producers_are_sized_by_cores_and_batch_cost(cores, seconds, batch, on_cpu, workers):
    sizing = size_workers(cores=cores, batch_seconds=seconds, batch_size=batch, on_cpu=on_cpu)
    assert sizing.workers == workers
    if seconds is not None:
        assert sizing.needed >= seconds * TARGET_SAMPLES_PER_S / batch
    assert f"{sizing.workers} producer processes ({cores} cores" in sizing.line("producer processes")


def test_a_rank_gets_its_share_of_the_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert local_world_size(8) == 4 and rank_cores(local_world_size(8)) == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert local_world_size(2) == 2 and rank_cores(local_world_size(2)) == 8


@pytest.mark.parametrize("env, world, local", [
    ("4", 8, 4),  # two hosts of four
    ("", 8, 8),  # unset: every rank on one host
    ("3", 8, 8),  # does not divide the world: one host
    ("16", 8, 8),  # more than the world: one host
    ("0", 8, 8),
])
def test_local_world_size_is_the_launchers_when_it_divides_the_world(monkeypatch, env, world, local):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", env)
    assert local_world_size(world) == local


def _cfg(**sets):
    return load_config(ROOT / "configs" / "quickstart.yaml", [f"{k}={v}" for k, v in
                                                             {"train.device": "cpu", **sets}.items()])


def test_auto_measures_a_batch_and_the_batches_stay_the_same(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    cfg = _cfg(**{"data.num_workers": "auto", "distributed.nproc": 1})
    assert cfg.data.num_workers == "auto"
    sized, sizing = with_sized_workers(cfg, rank=0, world_size=1)
    assert sizing is not None and sizing.batch_seconds is not None and sizing.batch_seconds > 0
    assert sizing.cores == 8 and sized.data.num_workers == sizing.workers == min(4, sizing.needed) >= 1
    made = [b.labels for _, b in zip(range(4), make_dataloader(sized, rank=0, world_size=1, split="train"))]
    auto = [b.labels for _, b in zip(range(4), make_dataloader(cfg, rank=0, world_size=1, split="train"))]
    in_loop = _cfg(**{"data.num_workers": 0, "distributed.nproc": 1})
    plain = [b.labels for _, b in zip(range(4), make_dataloader(in_loop, rank=0, world_size=1, split="train"))]
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(made, auto, plain))
    # a number is kept as it is, and measured nothing
    kept, none = with_sized_workers(in_loop, rank=0, world_size=1)
    assert kept is in_loop and none is None


def test_loader_wait_counts_the_time_blocked_on_the_next_batch():
    def late(n):
        for i in range(n):
            time.sleep(0.02)
            yield i

    waits = LoaderWait()
    waits.start()
    assert list(waits.timed(late(5))) == list(range(5))
    waits.stop()
    waited, trained = waits.take()
    assert 0.09 <= waited <= trained and waits.total == waited
    assert waits.take() == (0.0, 0.0)


@pytest.mark.slow
def test_the_trainer_says_when_the_loader_bounds_it(tmp_path, capfd):
    """Batches 50 ms late (tests/slow_data.py) against steps of a few ms: the trainer says once
    that the loader bounds it, logs the wait per step to TensorBoard and summary.json; the
    same run fed at once does not say it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from recpipe.cli import main

    quickstart = (ROOT / "configs" / "quickstart.yaml").read_text().splitlines()
    config = tmp_path / "quickstart.yaml"  # quickstart's, its data made by the factory where one is set
    config.write_text("\n".join(line for line in quickstart if "source: synthetic" not in line))

    def train(run: Path, *extra: str) -> str:
        sets = ["distributed.nproc=1", "train.device=cpu", "train.steps=16", "train.log_every=4", "train.eval_every=0",
                "train.progress=false", "data.synthetic.num_eval_batches=1", f"logging.run_dir={run}", *extra]
        assert main(["train", "--config", str(config), *[a for s in sets for a in ("--set", s)]]) == 0
        return capfd.readouterr().out

    slow = train(tmp_path / "slow", "data.factory=slow_data:slow_train")
    assert slow.count("the loader bounded steps ") == 1, slow
    summary = json.loads((tmp_path / "slow" / "summary.json").read_text())
    assert summary["loader_wait_s"] >= 15 * 0.05  # every batch after the first, 50 ms late
    events = EventAccumulator(str(tmp_path / "slow")).Reload()
    waits = [e.value for e in events.Scalars("throughput/loader_wait_ms_per_step")]
    # one batch a step once the schedule is full; its first interval also fills it, its last drains it
    assert len(waits) == 4 and all(w >= 45 for w in waits[1:-1]), waits
    fast = train(tmp_path / "fast", "data.num_workers=0")
    assert "the loader bounded steps " not in fast, fast
    assert json.loads((tmp_path / "fast" / "summary.json").read_text())["num_workers"] == 0


@pytest.mark.slow
def test_the_evaluation_producers_start_with_the_segment_before_it(tmp_path):
    """Each evaluation's batches are started (its producers forked) when the training segment
    that ends in it starts, not when the evaluation begins: the eval split's iterator starts
    before that segment's first training batch is taken."""
    from recpipe.cli import main

    quickstart = (ROOT / "configs" / "quickstart.yaml").read_text().splitlines()
    config = tmp_path / "quickstart.yaml"
    config.write_text("\n".join(line for line in quickstart if "source: synthetic" not in line))
    log = tmp_path / "batches.log"
    sets = ["distributed.nproc=1", "train.device=cpu", "train.steps=8", "train.log_every=4", "train.eval_every=4",
            "train.progress=false", "data.synthetic.num_eval_batches=2", f"logging.run_dir={tmp_path / 'run'}",
            "data.factory=slow_data:recorded", f"data.options={{log: {log}}}"]
    assert main(["train", "--config", str(config), *[a for s in sets for a in ("--set", s)]]) == 0
    lines = log.read_text().splitlines()
    eval_starts = [i for i, line in enumerate(lines) if line == "eval start"]
    assert len(eval_starts) == 2, lines  # after step 4 and the final one after step 8
    first_eval_batch = lines.index("eval 0")
    train_batches = [i for i, line in enumerate(lines) if line.startswith("train ") and line != "train start"]
    # the first evaluation's iterator started before any training batch; the second's before
    # the second segment's batches (those after the first evaluation's)
    assert eval_starts[0] < train_batches[0] < first_eval_batch, lines
    second_segment = [i for i in train_batches if i > first_eval_batch]
    assert second_segment and eval_starts[1] < second_segment[-1], lines
