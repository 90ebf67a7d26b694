"""Learning-rate schedules under real CUDA graphs: the graphed dense optimizer
(``pipeline.cuda_graphs``) and the whole-step graph (``pipeline.step_graph``) read the dense
rate from a device tensor, so one capture follows a rate that changes every step, bit for
bit as the eager step; the step graph trains a step at a new embedding rate eagerly (FBGEMM
reads that rate on the host) and captures again once it holds; no replay makes a host sync."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from pipeline_harness import RunResult, assert_same, build, local_state, make, make_batches, small_config
from recpipe.config import config_from_dict
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from recpipe.pipelines import PIPELINES
from recpipe.speedups.optimizer_graph import WARMUP_CALLS, GraphedOptimizerStep, fused_optimizers, torch_optimizers
from recpipe.speedups.step_graph import StepGraphOptions, apply_step_graph, capture_with_torch
from recpipe.train.learning_rates import LearningRates
from test_step_graph import TABLES, _fixed_batches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FUSED = "sharding.tables={t_cat_1: {type: row_wise}, t_cat_2: {type: column_wise}}"
SCHEDULES = ["optimizer.dense.schedule={warmup_steps: 6, decay: polynomial, decay_start_step: 6, decay_steps: 5}",
             "optimizer.embedding.schedule={warmup_steps: 3, decay: step, decay_start_step: 7, gamma: 0.5}"]
STEPS = 12


def _train(cfg, name, batches, device, *, by_hand=False, graph_optimizer=None, step_graph=False, no_sync_after=None,
           **options):
    """Train ``batches`` with the rates of ``cfg``'s schedules set before each step
    (``by_hand``: as floats, a torch LRScheduler's way, into an unscheduled optimizer)."""
    if by_hand:
        raw = cfg.editable_dump()
        raw["optimizer"]["dense"]["schedule"] = raw["optimizer"]["embedding"]["schedule"] = {}
        sm = build(config_from_dict(raw), device)
    else:
        sm = build(cfg, device)
    if step_graph:
        pipe = PIPELINES[name](sm.model, sm.optimizer, device)
        graph = apply_step_graph(pipe.context, StepGraphOptions(enabled=True, capacity_batches=2), capture_with_torch)
    else:
        pipe = make(name, sm, device, cuda_graphs=graph_optimizer is not None, cuda_graph_optimizer=bool(graph_optimizer),
                    **options)
        graph = [vars(o)["step"] for o in torch_optimizers(sm.optimizer)
                 if isinstance(vars(o).get("step"), GraphedOptimizerStep)]
    opt = cfg.optimizer
    rates = LearningRates(cfg.optimizer, sm.optimizer, sm.model)

    def set_step(step):
        if not by_hand:
            return rates.set_step(step)
        for o in torch_optimizers(sm.optimizer):
            for group in o.param_groups:
                group["lr"] = opt.dense.schedule.rate(opt.dense.lr, step)
        for o in fused_optimizers(sm.optimizer):
            for group in o.param_groups:
                group["lr"] = opt.embedding.schedule.rate(opt.embedding.lr, step)

    losses, it = [], iter([b.pin_memory() for b in batches])
    for step in itertools.count(1):
        if no_sync_after is not None and step > no_sync_after:  # the rates' fill_ included
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            set_step(step)
            pipe.progress(it)
        except StopIteration:
            break
        finally:
            torch.cuda.set_sync_debug_mode("default")
        losses.append(pipe.last_loss.clone())
    torch.cuda.synchronize()
    dist.barrier()
    return RunResult([x.cpu() for x in losses], [], {k: v.cpu() for k, v in local_state(sm.model).items()}), graph


def _graphed_optimizer_worker(configs) -> None:
    device = init_process_group(configs["adagrad"])
    batches = make_batches(configs["adagrad"], STEPS, dist.get_rank())
    for dense, cfg in configs.items():
        for name in ("base", "sparse_dist", "fused_sparse_dist", "semi_sync"):
            options = {"start_batch": STEPS + 1} if name == "semi_sync" else {}
            eager, _ = _train(cfg, name, batches, device, graph_optimizer=False, **options)
            graphed, (g,) = _train(cfg, name, batches, device, graph_optimizer=True, **options)
            assert_same(eager, graphed, f"{dense} {name}: graphed optimizer with a dense rate that changes every step")
            assert (g.captures, g.changes, g.replays) == (1, 0, STEPS - WARMUP_CALLS), f"{dense} {name}: {g}"
        if dense == "adagrad":  # foreach Adagrad multiplies by the rate, a float or a device tensor alike
            by_hand, _ = _train(cfg, "base", batches, device, by_hand=True, graph_optimizer=False)
            assert_same(by_hand, _train(cfg, "base", batches, device, graph_optimizer=False)[0],
                        "adagrad: device-tensor rates vs float rates")


@pytest.mark.parametrize("nproc", [1, 2])
def test_graphed_optimizer_follows_the_dense_schedule(nproc):
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    configs = {dense: small_config(nproc, [FUSED, f"optimizer.dense.name={dense}", *SCHEDULES])
               for dense in ("adagrad", "sgd")}
    launch_local(_graphed_optimizer_worker, nproc, configs)


def _step_graph_worker(cfg) -> None:
    device = init_process_group(cfg)
    batches = _fixed_batches(cfg, STEPS, dist.get_rank())
    for name in ("base", "sparse_dist"):
        want, _ = _train(cfg, name, batches, device)
        got, graph = _train(cfg, name, batches, device, step_graph=True, no_sync_after=8)
        assert_same(want, got, f"{name}: step graph with schedules vs eager")
        # 1-2 eager (warm-up), 3 eager (a new embedding rate), 4 captured, 5-6 replayed, 7 eager
        # (the decay), 8 captured again, 9-12 replayed; the dense rate changes at every step
        assert (graph.replays, graph.eager_steps, graph.lr_steps) == (8, 4, 2), graph


@pytest.mark.parametrize("nproc", [1, 2])
def test_step_graph_follows_both_schedules(nproc):
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    launch_local(_step_graph_worker, nproc, small_config(nproc, TABLES + SCHEDULES))
