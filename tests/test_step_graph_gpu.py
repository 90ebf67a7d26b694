"""``pipeline.step_graph`` on CUDA, on 1, 2 and 4 GPUs: a replayed step trains
bit-identically to the same step run eagerly (fixed shapes: to the plain pipeline;
padded batches: to the same padded step without a graph), with every sharding type
(table_wise, column_wise, row_wise and table_row_wise: their ids per rank padded to a
capacity), fp32 and bf16 with ``pipeline.compile``, over 24 steps across a checkpoint
and a resume into a fresh model; and a replay makes no host sync."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from pipeline_harness import RunResult, assert_same, build, local_state, make_batches, small_config
from recpipe.checkpoint.store import TrainPosition, load_checkpoint, save_checkpoint
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from recpipe.pipelines import PIPELINES
from recpipe.speedups.compile import CompileOptions, apply_compile
from recpipe.speedups.step_graph import StepGraphOptions, apply_step_graph, capture_with_torch
from test_step_graph import ROW_TABLES, TABLES, _fixed_batches, _no_graph, row_features

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STEPS = 24


def _run(cfg, name, batches, device, *, capture=None, compile_=False, no_sync_after=None, options=None, sm=None,
         save_at=None):
    """Train ``batches``; ``capture``: with a step graph (real or stand-in); ``no_sync_after``:
    steps after which any host sync is an error; ``save_at``: save a checkpoint after that many steps."""
    sm = sm or build(cfg, device)
    if compile_:
        apply_compile(sm.model, CompileOptions(enabled=True))
    pipe = PIPELINES[name](sm.model, sm.optimizer, device)
    graph = None
    if capture is not None:
        graph = apply_step_graph(pipe.context, options or StepGraphOptions(enabled=True, capacity_batches=2, headroom=1.5),
                                 capture)
    losses = []
    it = iter([b.pin_memory() for b in batches])
    for step in itertools.count():
        if no_sync_after is not None and step >= no_sync_after:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            pipe.progress(it)
        except StopIteration:
            break
        finally:
            torch.cuda.set_sync_debug_mode("default")
        losses.append(pipe.last_loss.clone())
        if save_at is not None and step + 1 == save_at:
            torch.cuda.synchronize()
            save_checkpoint(cfg.checkpoint, sm.model, sm.optimizer, TrainPosition(step=save_at, epoch=0, batch=save_at))
    torch.cuda.synchronize()
    dist.barrier()
    return RunResult([x.cpu() for x in losses], [], {k: v.cpu() for k, v in local_state(sm.model).items()}), graph


def _padded_options(cfg) -> StepGraphOptions:
    """Every feature's capacity given (so every batch is padded from the first, in a run
    and in its resumed half alike): 3 ids a sample, a row-wise feature's in any rank's bucket."""
    rows = row_features(cfg, (3, 3, 3, 3))
    return StepGraphOptions(enabled=True, capacity={f: rows.get(f, 3 * cfg.data.batch_size)
                                                    for f in cfg.model.feature_names})


def _resumed(cfg, name, batches, device, capture, compile_):
    """The same run as one of STEPS steps, in two halves: a checkpoint after the first, the
    second in a fresh model, optimizer and pipeline loaded from it (as `recpipe train` resumes)."""
    options = _padded_options(cfg)
    half = STEPS // 2
    first, _ = _run(cfg, name, batches[:half], device, capture=capture, compile_=compile_, options=options,
                    save_at=half)
    sm = build(cfg, device)
    assert load_checkpoint(cfg.checkpoint, sm.model, sm.optimizer).step == half
    second, graph = _run(cfg, name, batches[half:], device, capture=capture, compile_=compile_, options=options,
                         sm=sm)
    return RunResult(first.losses + second.losses, [], second.state), graph


def _worker(cfg) -> None:
    device = init_process_group(cfg)
    rank = dist.get_rank()
    rows = row_features(cfg)
    fixed = _fixed_batches(cfg, 8, rank)
    for name in ("base", "sparse_dist"):
        want, _ = _run(cfg, name, fixed, device, capture=None if not rows else _no_graph,
                       options=StepGraphOptions(enabled=True, capacity_batches=2, capacity=rows))
        got, graph = _run(cfg, name, fixed, device, capture=capture_with_torch, no_sync_after=4,
                          options=StepGraphOptions(enabled=True, capacity_batches=2, capacity=rows))
        assert_same(want, got, f"{name}: step graph vs eager, fixed shapes")
        assert graph.replays == 6 and graph.eager_steps == 2 and graph.padded == bool(rows), graph
    varying = make_batches(cfg, STEPS, rank)
    options = _padded_options(cfg)
    want, _ = _run(cfg, "sparse_dist", varying, device, capture=_no_graph, options=options)
    got, graph = _run(cfg, "sparse_dist", varying, device, capture=capture_with_torch, options=options,
                      no_sync_after=4)
    assert graph.padded and graph.replays == STEPS - 2 and graph.over_capacity == 0, graph
    assert_same(want, got, f"{STEPS} steps: step graph vs the same padded step without a graph")
    resumed, graph = _resumed(cfg, "sparse_dist", varying, device, capture_with_torch, compile_=False)
    assert graph.replays == STEPS // 2 - 2, graph
    assert_same(want, resumed, "step graph across a checkpoint and a resume vs one eager run")
    bf16 = cfg.model_copy(update={"train": cfg.train.model_copy(update={"precision": "bf16"}),
                                  "checkpoint": cfg.checkpoint.model_copy(update={"dir": f"{cfg.checkpoint.dir}/bf16"})})
    want, _ = _run(bf16, "sparse_dist", varying, device, compile_=True, capture=_no_graph, options=options)
    resumed, graph = _resumed(bf16, "sparse_dist", varying, device, capture_with_torch, compile_=True)
    assert graph.replays == STEPS // 2 - 2, graph
    assert_same(want, resumed, "bf16, compiled: step graph across a resume vs the same compiled step without a graph")
    if rank == 0:
        print(f"{dist.get_world_size()} rank(s), tables {cfg.sharding.tables}: exact; {graph}")


# every_type: a table of each type (table_wise and column_wise among them); table_column_wise: the
# unpadded fixed splits of several ranks (no row-wise table).
@pytest.mark.parametrize("nproc,tables", [(1, TABLES), (2, TABLES), (2, ROW_TABLES), (4, ROW_TABLES)],
                         ids=["1-table_column_wise", "2-table_column_wise", "2-every_type", "4-every_type"])
def test_step_graph_replays_train_like_eager_steps(nproc, tables, tmp_path):
    launch_local(_worker, nproc, small_config(nproc, ["train.device=cuda", *tables, f"checkpoint.dir={tmp_path}"]))
