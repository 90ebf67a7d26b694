"""``pipeline.step_graph`` on CUDA: a replayed step trains bit-identically to the same
step run eagerly (fixed shapes: to the plain pipeline; padded batches: to the same
padded step without a graph), with ``pipeline.compile`` too, and a replay makes no host
sync."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from pipeline_harness import RunResult, assert_same, build, local_state, make_batches, small_config
from recpipe.distributed import init_process_group, launch_local
from recpipe.pipelines import PIPELINES
from recpipe.speedups.compile import CompileOptions, apply_compile
from recpipe.speedups.step_graph import StepGraphOptions, apply_step_graph, capture_with_torch
from test_step_graph import TABLES, _fixed_batches, _no_graph

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _run(cfg, name, batches, device, *, capture=None, compile_=False, no_sync_after=None):
    """Train ``batches``; ``capture``: with a step graph (real or stand-in); ``no_sync_after``:
    steps after which any host sync is an error."""
    sm = build(cfg, device)
    if compile_:
        apply_compile(sm.model, CompileOptions(enabled=True))
    pipe = PIPELINES[name](sm.model, sm.optimizer, device)
    graph = None
    if capture is not None:
        graph = apply_step_graph(pipe, StepGraphOptions(enabled=True, capacity_batches=2, headroom=1.5), capture)
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
    torch.cuda.synchronize()
    dist.barrier()
    return RunResult([x.cpu() for x in losses], [], {k: v.cpu() for k, v in local_state(sm.model).items()}), graph


def _worker(cfg) -> None:
    device = init_process_group(cfg)
    rank = dist.get_rank()
    fixed = _fixed_batches(cfg, 8, rank)
    for name in ("base", "sparse_dist"):
        want, _ = _run(cfg, name, fixed, device)
        got, graph = _run(cfg, name, fixed, device, capture=capture_with_torch, no_sync_after=4)
        assert_same(want, got, f"{name}: step graph vs eager, fixed shapes")
        assert graph.replays == 6 and graph.eager_steps == 2 and not graph.padded, graph
    varying = make_batches(cfg, 8, rank)
    want, _ = _run(cfg, "sparse_dist", varying, device, capture=_no_graph)
    got, graph = _run(cfg, "sparse_dist", varying, device, capture=capture_with_torch)
    assert graph.padded and graph.replays > 0, graph
    assert_same(want, got, "step graph vs the same padded step without a graph")
    bf16 = cfg.model_copy(update={"train": cfg.train.model_copy(update={"precision": "bf16"})})
    want, _ = _run(bf16, "sparse_dist", fixed, device, compile_=True, capture=_no_graph)
    got, graph = _run(bf16, "sparse_dist", fixed, device, compile_=True, capture=capture_with_torch)
    assert_same(want, got, "bf16, compiled: step graph vs the same compiled step without a graph")


@pytest.mark.parametrize("nproc", [1, 2])
def test_step_graph_replays_train_like_eager_steps(nproc):
    launch_local(_worker, nproc, small_config(nproc, ["train.device=cuda", *TABLES]))
