"""Learning-rate schedules (recpipe/lr_schedule.py, recpipe/train/learning_rates.py): the
rates of MLPerf DLRM's LRPolicyScheduler, written into the dense and the fused embedding
optimizers before each step under every pipeline, resumed exactly from a checkpoint and
logged to TensorBoard."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipeline_harness import assert_differs, assert_same, build, local_state, make, make_batches, small_config, RunResult
from recpipe.cli import main
from recpipe.config import ConfigError, config_from_dict, load_config
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from recpipe.lr_schedule import LRSchedule
from recpipe.pipelines import PIPELINES
from recpipe.speedups.optimizer_graph import fused_optimizers, torch_optimizers
from recpipe.train.learning_rates import LearningRates
from test_checkpoint import _full_state

CONFIG = Path(__file__).parent.parent / "configs" / "quickstart.yaml"


def _reference_rates(lr: float, warmup: int, start: int, steps: int, n: int) -> list[float]:
    """MLPerf DLRM's LRPolicyScheduler walked step by step as torch's LRScheduler drives it
    (its _step_count is 1 at the first batch); the rate of each of n batches. Stateful as the
    reference is: between phases it repeats the last rate it computed."""
    out, last = [], None
    for count in range(1, n + 1):
        if count < warmup:
            last = lr * (1.0 - (warmup - count) / warmup)
            out.append(last)
        elif start <= count < start + steps:
            last = max(1e-7, lr * ((steps - (count - start)) / steps) ** 2)
            out.append(last)
        elif steps > 0:
            assert last is not None, "the reference has no rate here"
            out.append(last)
        else:
            out.append(lr)
    return out


@pytest.mark.parametrize("warmup,start,steps", [(0, 0, 0), (4, 0, 0), (4, 6, 5), (3, 3, 4), (5, 9, 1), (2, 2, 30)])
def test_rates_are_mlperfs_lr_policy_scheduler(warmup, start, steps):
    schedule = LRSchedule(warmup_steps=warmup, decay="polynomial" if steps else "none", decay_start_step=start,
                          decay_steps=steps)
    got = [schedule.rate(0.25, s) for s in range(1, 41)]
    assert got == _reference_rates(0.25, warmup, start, steps, 40)
    assert schedule.constant == (warmup == 0 and steps == 0)


def test_step_decay_and_its_floor():
    schedule = LRSchedule(warmup_steps=2, decay="step", decay_start_step=4, step_size=3, gamma=0.5, end_lr=0.01)
    assert [schedule.rate(0.08, s) for s in range(1, 12)] == [
        0.04, 0.08, 0.08, 0.04, 0.04, 0.04, 0.02, 0.02, 0.02, 0.01, 0.01]


@pytest.mark.parametrize("override,needle", [
    ("optimizer.dense.schedule={warmup_steps: 10, decay: polynomial, decay_start_step: 5, decay_steps: 3}",
     "optimizer.dense.schedule: decay_start_step=5 is before the warm-up ends (warmup_steps=10)"),
    ("optimizer.embedding.schedule={decay: polynomial}", "optimizer.embedding.schedule: decay='polynomial' needs decay_steps > 0"),
    ("optimizer.embedding.schedule.gamma=2", "optimizer.embedding.schedule.gamma"),
    ("optimizer.dense.schedule.warmup=3", "optimizer.dense.schedule.warmup: unknown key"),
])
def test_config_names_a_bad_schedule(override, needle):
    with pytest.raises(ConfigError, match=None) as err:
        load_config(None, [override])
    assert needle in str(err.value), err.value


# ------------------------------------------------------------- pipelines
SCHEDULES = [
    "optimizer.dense.schedule={warmup_steps: 3, decay: polynomial, decay_start_step: 4, decay_steps: 3}",
    "optimizer.embedding.schedule={warmup_steps: 2, decay: step, decay_start_step: 3, step_size: 2, gamma: 0.5}",
]


def _train(cfg, name: str, batches, rates, **options) -> RunResult:
    """Train ``batches`` with pipeline ``name``; ``rates(sharded)`` returns what sets the
    rates of a step, called before each step as the trainer does."""
    sm = build(cfg, torch.device("cpu"))
    pipe = make(name, sm, torch.device("cpu"), **options)
    set_step = rates(sm)
    losses, it = [], iter(batches)
    for size in (4, len(batches) - 4):  # a drain in the middle, as at an evaluation
        seg = itertools.islice(it, size)
        while True:
            set_step(len(losses) + 1)
            try:
                loss, *_ = pipe.progress(seg)
            except StopIteration:
                break
            losses.append(loss)
    dist.barrier()
    return RunResult(losses, [], local_state(sm.model))


def _by_hand(cfg):
    """The rates of ``cfg``'s schedules written as floats into every param group: what a
    torch LRScheduler does, independent of LearningRates and of tensor rates."""
    opt = cfg.optimizer

    def rates(sm):
        optimizer = sm.optimizer

        def set_step(step):
            for o in torch_optimizers(optimizer):
                for group in o.param_groups:
                    group["lr"] = opt.dense.schedule.rate(opt.dense.lr, step)
            for o in fused_optimizers(optimizer):
                for group in o.param_groups:
                    group["lr"] = opt.embedding.schedule.rate(opt.embedding.lr, step)
        return set_step
    return rates


def _pipelines_worker(cfg) -> None:
    init_process_group(cfg)
    batches = make_batches(cfg, 9, dist.get_rank())
    raw = cfg.editable_dump()
    raw["optimizer"]["dense"]["schedule"] = raw["optimizer"]["embedding"]["schedule"] = {}
    unscheduled = config_from_dict(raw)  # float rates, as without a schedule
    reference = _train(unscheduled, "base", batches, _by_hand(cfg))
    # the schedule changes what is trained (else nothing here would test it)
    assert_differs(reference, _train(unscheduled, "base", batches, lambda sm: lambda step: None), "constant rates")
    scheduled = lambda sm: LearningRates(cfg.optimizer, sm.optimizer, sm.model).set_step  # noqa: E731
    for name in sorted(PIPELINES):
        # semi_sync before its start_batch: synchronous numerics, lookup of batch i+1 during step i
        options = {"start_batch": len(batches) + 1} if name == "semi_sync" else {}
        assert_same(reference, _train(cfg, name, batches, scheduled, **options), f"{name} with schedules")


@pytest.mark.slow
@pytest.mark.parametrize("dense", ["adagrad", "sgd"])
def test_every_pipeline_trains_with_the_scheduled_rates(dense):
    """Every pipeline, rates from LearningRates (the dense rate a device tensor), trains
    bit-identically to the plain loop with the same rates set by hand as floats."""
    tables = "sharding.tables={t_cat_1: {type: row_wise}, t_cat_2: {type: column_wise}}"
    launch_local(_pipelines_worker, 2, small_config(2, [tables, f"optimizer.dense.name={dense}", *SCHEDULES]))


# ------------------------------------------------------- trainer, resume
TINY = [
    "model.num_embeddings_per_feature=[100, 300, 500, 1000]",
    "model.embedding_dim=8",
    "model.dense_arch_layer_sizes=[16, 8]",
    "model.over_arch_layer_sizes=[16, 1]",
    "data.batch_size=64",
    "data.synthetic.num_batches=4",
    "data.synthetic.num_eval_batches=1",
    "train.epochs=3",
    "train.eval_every=0",
    "train.log_every=2",
    "train.progress=false",
    "sharding.tables={t_cat_1: {type: row_wise}, t_cat_2: {type: column_wise}}",
    "distributed.nproc=2",
    "train.device=cpu",
    "optimizer.dense.lr=0.1",
    "optimizer.embedding.lr=0.1",
    "optimizer.dense.schedule={warmup_steps: 4, decay: polynomial, decay_start_step: 5, decay_steps: 4}",
    "optimizer.embedding.schedule={warmup_steps: 3, decay: step, decay_start_step: 6, step_size: 2, gamma: 0.5}",
]
K, M = 5, 6


def _run(run: Path, steps: int, every: int, extra: tuple[str, ...] = ()) -> int:
    sets = [*TINY, f"train.steps={steps}", f"checkpoint.dir={run / 'ckpt'}", f"checkpoint.every={every}",
            f"logging.run_dir={run}", *extra]
    return main(["train", "--config", str(CONFIG), *[a for s in sets for a in ("--set", s)]])


@pytest.mark.slow
def test_schedules_resume_exactly_and_reach_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    straight, resumed, constant = tmp_path / "straight", tmp_path / "resumed", tmp_path / "constant"
    assert _run(straight, K + M, every=0) == 0
    assert _run(resumed, K, every=K) == 0  # stopped inside the warm-up of one and the plateau of the other
    assert _run(resumed, K + M, every=K) == 0
    assert _run(constant, K + M, every=0, extra=("optimizer.dense.schedule={}", "optimizer.embedding.schedule={}")) == 0
    last = f"step_{K + M:08d}"
    a, b = _full_state(straight / "ckpt" / last, tmp_path), _full_state(resumed / "ckpt" / last, tmp_path)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert a.keys() == b.keys() and not different, f"the resumed run differs in {different}"
    c = _full_state(constant / "ckpt" / last, tmp_path)
    assert any(not torch.equal(a[k], c[k]) for k in a if k.startswith("model.")), "the schedules changed nothing"

    cfg = load_config(CONFIG, TINY)
    events = EventAccumulator(str(straight)).Reload()
    for tag, opt in (("lr/dense", cfg.optimizer.dense), ("lr/embedding", cfg.optimizer.embedding)):
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in logged] == [2, 4, 6, 8, 10, 11], tag
        for step, value in logged:  # the rate of the log point's own step
            assert value == pytest.approx(opt.schedule.rate(opt.lr, step), rel=1e-6), (tag, step)
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["steps"] == K + M
