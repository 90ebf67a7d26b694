"""The dense optimizer's step replayed as a CUDA graph (``pipeline.cuda_graphs`` with
``pipeline.cuda_graphs.optimizer``) gives bit for bit the parameters, losses and optimizer state
(Adagrad's sums and host-side step counts) of the eager step, on a small sharded DLRM
with the dense part graphed in both runs: over pipelines and optimizers, across an lr
change, a checkpoint loaded into a live pipeline and a resume into a fresh one.
Each run also checks that the graph was replayed (not a run that stayed eager)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from pipeline_harness import RunResult, assert_same, build, local_state, make, make_batches, small_config
from recpipe.checkpoint.store import TrainPosition, load_checkpoint, save_checkpoint
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from recpipe.speedups.optimizer_graph import WARMUP_CALLS, GraphedOptimizerStep, torch_optimizers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# No data_parallel table: fused_sparse_dist and semi_sync refuse them.
FUSED = "sharding.tables={t_cat_1: {type: row_wise}, t_cat_2: {type: column_wise}}"
STEPS = 10


def _dense_state(sm) -> dict[str, torch.Tensor]:
    (opt,) = torch_optimizers(sm.optimizer)
    names = {id(p): n for n, p in sm.model.named_parameters()}
    return {f"{names[id(p)]}/{k}": v.detach().cpu().clone() for p, s in opt.state.items() for k, v in s.items()}


def _run(cfg, name, batches, device, graph_optimizer, segments, between=None, sm=None, **options):
    """Train ``batches`` in ``segments`` (each ends in a drain) with the dense part
    graphed; ``between(k, sm)`` runs after segment k. Returns (result with the dense
    optimizer's state among the model's, the pipeline's GraphedOptimizerSteps)."""
    sm = sm or build(cfg, device)
    pipe = make(name, sm, device, cuda_graphs=True, cuda_graph_optimizer=graph_optimizer, **options)
    steps = [vars(opt)["step"] for opt in torch_optimizers(sm.optimizer)
             if isinstance(vars(opt).get("step"), GraphedOptimizerStep)]
    assert len(steps) == int(graph_optimizer), steps
    losses, weights = [], []
    it = iter([b.pin_memory() for b in batches])
    for k, size in enumerate(segments):
        for loss, _, _, w in _progress(pipe, itertools.islice(it, size)):
            losses.append(loss)
            weights.append(w)
        if between is not None:
            between(k, sm)
    torch.cuda.synchronize()
    dist.barrier()
    state = {k: v.cpu() for k, v in local_state(sm.model).items()}
    state.update(_dense_state(sm))
    return RunResult([x.cpu() for x in losses], [w.cpu() for w in weights], state), steps


def _progress(pipe, seg):
    while True:
        try:
            yield pipe.progress(seg)
        except StopIteration:
            return


def _pipelines_and_optimizers(configs) -> None:
    device = init_process_group(configs["adagrad"])
    batches = make_batches(configs["adagrad"], STEPS, dist.get_rank())
    for dense, cfg_d in configs.items():
        for name in ("base", "sparse_dist", "fused_sparse_dist", "semi_sync"):
            eager, _ = _run(cfg_d, name, batches, device, False, [STEPS])
            graphed, (g,) = _run(cfg_d, name, batches, device, True, [STEPS])
            assert_same(eager, graphed, f"{dense} {name}: graphed optimizer vs eager")
            assert (g.captures, g.replays) == (1, STEPS - WARMUP_CALLS), f"{dense} {name}: {g}"
            if dense == "adagrad":
                steps = {k: v for k, v in graphed.state.items() if k.endswith("/step")}
                assert steps and all(int(v) == STEPS for v in steps.values()), steps
        # semi_sync's stashed gradients move every step; the drain applies the last one.
        eager, _ = _run(cfg_d, "semi_sync", batches, device, False, [STEPS], stash_gradients=True)
        graphed, (g,) = _run(cfg_d, "semi_sync", batches, device, True, [STEPS], stash_gradients=True)
        assert_same(eager, graphed, f"{dense} semi_sync stash_gradients")
        assert g.replays >= STEPS - 1 - WARMUP_CALLS, g


@pytest.mark.parametrize("nproc", [1, 2])
def test_graphed_optimizer_step_is_bit_identical_to_eager(nproc):
    configs = {dense: small_config(nproc, ["train.device=cuda", FUSED, f"optimizer.dense.name={dense}",
                                           "optimizer.dense.weight_decay=0.01"]) for dense in ("adagrad", "sgd")}
    launch_local(_pipelines_and_optimizers, nproc, configs)


def _set_lr(k, sm, at=1, lr=0.03):
    if k == at:
        (opt,) = torch_optimizers(sm.optimizer)
        for group in opt.param_groups:
            group["lr"] = lr


def _lr_and_checkpoints(cfg) -> None:
    device = init_process_group(cfg)
    batches = make_batches(cfg, 12, dist.get_rank())
    # An lr set between segments: the old graph must not replay; a new one is captured.
    eager, _ = _run(cfg, "sparse_dist", batches, device, False, [4, 4, 4], between=_set_lr)
    graphed, (g,) = _run(cfg, "sparse_dist", batches, device, True, [4, 4, 4], between=_set_lr)
    assert_same(eager, graphed, "lr change: graphed optimizer vs eager")
    assert g.captures == 2 and g.replays == 12 - 2 * WARMUP_CALLS, g

    # Reference: 10 steps, graphed.
    ref, _ = _run(cfg, "sparse_dist", batches[:10], device, True, [5, 5])

    # Saved after 5 steps, 2 more steps, then loaded into the live pipeline (whose graph
    # was captured before) and the 5 steps after the checkpoint trained again.
    def save_or_load(k, sm):
        if k == 0:
            save_checkpoint(cfg.checkpoint, sm.model, sm.optimizer, TrainPosition(step=5, epoch=0, batch=5))
        elif k == 1:
            assert load_checkpoint(cfg.checkpoint, sm.model, sm.optimizer).step == 5

    again = batches[:5] + batches[5:7] + batches[5:10]
    live, (g,) = _run(cfg, "sparse_dist", again, device, True, [5, 2, 5], between=save_or_load)
    assert_same(RunResult(ref.losses, ref.weights, ref.state),
                RunResult(live.losses[:5] + live.losses[7:], live.weights[:5] + live.weights[7:], live.state),
                "checkpoint loaded into a live graphed optimizer")
    assert g.replays >= 12 - 2 * WARMUP_CALLS, g
    if dist.get_rank() == 0:
        print(f"checkpoint loaded into the live pipeline: {g}")

    # Resume into a fresh model, optimizer and pipeline (as `recpipe train` does).
    sm = build(cfg, device)
    assert load_checkpoint(cfg.checkpoint, sm.model, sm.optimizer).step == 5
    resumed, (g,) = _run(cfg, "sparse_dist", batches[5:10], device, True, [5], sm=sm)
    assert_same(RunResult(ref.losses[5:], ref.weights[5:], ref.state), resumed, "resumed with a graphed optimizer")
    assert g.replays == 5 - WARMUP_CALLS, g


@pytest.mark.parametrize("nproc", [1, 2])
def test_graphed_optimizer_across_lr_change_and_checkpoints(nproc, tmp_path):
    cfg = small_config(nproc, ["train.device=cuda", FUSED, f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.keep=1"])
    launch_local(_lr_and_checkpoints, nproc, cfg)
