"""The evaluation's captured forward of ``pipeline.step_graph`` (recpipe.speedups.step_graph.EvalGraph)
on CPU: everything but the CUDA graph itself.

The stand-in capture of tests/test_step_graph.py (``_no_graph``) returns the forward un-run,
so each "replay" runs the captured forward in Python on the static buffers: the padding,
the fixed layout, the rank agreement, the copies in and out and the eager fallback are what
runs around a real graph. tests/test_eval_graph_gpu.py replays real graphs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipeline_harness import RunResult, assert_same, build, local_state, make_batches, small_config
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from recpipe.pipelines import PIPELINES
from recpipe.pipelines.evaluation import Evaluation
from recpipe.speedups import step_graph
from recpipe.speedups.step_graph import StepGraphOptions, apply_step_graph
from test_eval_pipeline import PARTIAL, assert_same_outputs, clicks_of, reference_eval, train_steps
from test_step_graph import ROW_TABLES, TABLES, _fixed_batches, _no_graph, row_features

# eval batches that fit the captured forward (of each rank's eval_batches): batches 0-2 and 4
FITTING = 4


def roomy(cfg) -> StepGraphOptions:
    """Every feature's capacity given: 4 ids a sample (make_batches has at most 3), a row-wise
    feature's in any rank's bucket; every batch is padded from the first."""
    rows = row_features(cfg, (4, 4, 4, 4))
    return StepGraphOptions(enabled=True, capacity={f: rows.get(f, 4 * cfg.data.batch_size)
                                                    for f in cfg.model.feature_names})


def eval_batches(cfg, rank: int) -> list:
    """Rank r: 3 batches that fit, one over capacity (5 ids a sample), 1 + r that fit and a
    partial last one. Two ranks: rank 0's 6th batch is its partial one, rank 1's fits (the
    ranks agree on eager), then rank 0 feeds a padding batch (its partial one) while rank 1
    evaluates its own partial one."""
    short = cfg.model_copy(update={"data": cfg.data.model_copy(update={"batch_size": PARTIAL})})
    return (make_batches(cfg, 3, rank, seed=7) + _fixed_batches(cfg, 1, rank, (5, 5, 5, 5))
            + make_batches(cfg, 1 + rank, rank, seed=8) + make_batches(short, 1, rank, seed=9))


def _worker(cfg, name: str, capture=_no_graph) -> None:
    """Model A trains (the step graph captured by ``capture``), evaluates through the plain loop
    written out, with the eval graph twice (its first pass: the warm-up and the capture) and
    trains on; model B trains the same batches evaluating only through the plain loop. Every
    evaluation's outputs and metrics are equal, and so are A's and B's losses and weights."""
    device = init_process_group(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    before, after = make_batches(cfg, 4, rank, seed=1), make_batches(cfg, 3, rank, seed=2)
    evals = eval_batches(cfg, rank)
    if device.type == "cuda":  # as the loader pins them: the padded features are pinned too
        before, after, evals = ([b.pin_memory() for b in bs] for bs in (before, after, evals))
    total = 6 + (world - 1)  # every rank's evaluation: the last rank's batches
    runs = {}
    for graphed in (False, True):
        sm = build(cfg, device)
        pipe = PIPELINES[name](sm.model, sm.optimizer, device)
        graph = apply_step_graph(pipe.context, roomy(cfg), capture=capture)
        losses: list = []
        train_steps(pipe, before, losses)
        assert graph.ready and graph.padded, graph
        ref = reference_eval(pipe, evals, device)
        passes = []
        for _ in range(2 if graphed else 1):
            agreements = []
            agree = step_graph._agree
            step_graph._agree = lambda ok: agreements.append(ok) or agree(ok)
            try:
                passes.append(list(Evaluation(pipe, pipelined=graphed).run(evals)))
            finally:
                step_graph._agree = agree
            assert len(agreements) == (total if graphed else 0), agreements  # one a batch, at its fetch
        train_steps(pipe, after, losses)
        runs[graphed] = (ref, passes, RunResult(losses, [], local_state(sm.model)), graph)
        pipe.detach()
    want, want_metrics = clicks_of(runs[False][0], device)
    for graphed, (ref, passes, _, _) in runs.items():
        for i, outputs in enumerate([ref, *passes]):
            got, got_metrics = clicks_of(outputs, device)
            assert_same_outputs(want, got, f"{name}: graphed={graphed}, pass {i}")
            assert got_metrics == want_metrics, f"{name}: graphed={graphed}, pass {i}: {got_metrics} != {want_metrics}"
    evaluation = runs[True][3].evaluation
    assert runs[False][3].evaluation.summary() == {"replays": 0, "eager": 0, "over_capacity": 0}  # the plain loop
    # pass 1: a warm-up batch, then replays; pass 2: replays only; the others eager in both
    assert evaluation.replays == 2 * FITTING - 1, evaluation
    assert evaluation.eager == 2 * total - evaluation.replays and evaluation.over_capacity == 2 * (total - FITTING)
    assert runs[True][3].summary()["eval"] == evaluation.summary()
    assert_same(runs[False][2], runs[True][2], f"{name}: training after evaluations through the eval graph")
    dist.barrier()
    if rank == 0:
        print(f"{world} rank(s), {name}, tables {cfg.sharding.tables}: exact; {evaluation}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["base", "sparse_dist"])
@pytest.mark.parametrize("tables", [TABLES, ROW_TABLES], ids=["table_column_wise", "every_type"])
@pytest.mark.parametrize("nproc", [1, 2])
def test_eval_graph_gives_the_eager_evaluation(nproc, tables, name):
    launch_local(_worker, nproc, small_config(nproc, tables), name)


def _unready_worker(cfg) -> None:
    """Before the training step is captured (its capacity unknown), every eval batch runs
    eagerly, without an agreement; nothing is padded."""
    device = init_process_group(cfg)
    sm = build(cfg, device)
    pipe = PIPELINES["sparse_dist"](sm.model, sm.optimizer, device)
    graph = apply_step_graph(pipe.context, StepGraphOptions(enabled=True, capacity_batches=2), capture=_no_graph)
    evals = make_batches(cfg, 3, dist.get_rank(), seed=7)
    ref = reference_eval(pipe, evals, device)
    got = list(Evaluation(pipe).run(evals))
    assert_same_outputs(clicks_of(ref, device)[0], clicks_of(got, device)[0], "eval before the capture")
    assert graph.evaluation.summary() == {"replays": 0, "eager": 3, "over_capacity": 0}, graph.evaluation


def test_eval_before_the_training_capture_runs_eagerly():
    launch_local(_unready_worker, 1, small_config(1, TABLES))
