"""recpipe.sharding.data_parallel.GradientAllReduce on two Gloo ranks, by itself: the
averaged gradients equal the mean over ranks computed by hand, every backward reduces
once, a backward that reaches only part of the parameters reduces just those (the
others keep no gradient), and gradients set to None by zero_grad land in the flat
buffer again."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from pipeline_harness import small_config
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from recpipe.sharding.data_parallel import DataParallelAcrossRanks, GradientAllReduce


def _mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return sum(p * (1.0 / len(parts)) for p in parts)  # DDP's order: scale, then sum


def _worker(cfg) -> None:
    init_process_group(cfg)
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same weights on both ranks
    first, second = nn.Linear(4, 3), nn.Linear(3, 1)
    params = [(f"{name}.{n}", p) for name, layer in (("first", first), ("second", second))
              for n, p in layer.named_parameters()]
    sync = GradientAllReduce(params, dist.group.WORLD)
    assert len(sync.flat) == 1 and sum(t.numel() for t in sync.flat.values()) == 4 * 3 + 3 + 3 + 1
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 + rank))  # other data on each rank

    # a backward through both layers: every gradient averaged, now a view of the buffer
    second(first(x)).sum().backward()
    assert sync.reductions == 1
    local = {n: torch.autograd.grad(second(first(x)).sum(), p)[0] for n, p in params}
    for n, p in params:
        assert torch.equal(p.grad, _mean_over_ranks(local[n])), n
        assert p.grad.data_ptr() == sync.views[[m for m, _ in params].index(n)].data_ptr(), n

    # zero_grad(set_to_none=True), then a backward that stops at the first layer's output
    for _, p in params:
        p.grad = None
    first(x).sum().backward()
    assert sync.reductions == 2
    want = {n: torch.autograd.grad(first(x).sum(), p)[0] for n, p in params if n.startswith("first")}
    for n, p in params:
        if n.startswith("first"):
            assert torch.equal(p.grad, _mean_over_ranks(want[n])), n
        else:
            assert p.grad is None, n  # not reached: no gradient, nothing reduced for it
    # ranks with different data really differ before the average
    differs = torch.tensor([int(not torch.equal(want["first.weight"], _mean_over_ranks(want["first.weight"])))])
    dist.all_reduce(differs)
    assert differs.item() > 0


def _wrap_worker(cfg) -> None:
    """DataParallelAcrossRanks on two ranks: rank 0's parameters everywhere (DDP's
    construction), buffers left as each rank has them (torchrec's DDP wrapper passes
    broadcast_buffers=False), and the all-reduce installed."""
    from types import SimpleNamespace

    init_process_group(cfg)
    rank = dist.get_rank()
    inner = nn.Sequential(nn.Linear(4, 3))
    inner.register_buffer("local", torch.tensor([float(rank)]))
    with torch.no_grad():
        inner[0].weight.fill_(rank + 1.0)
    holder = SimpleNamespace(module=inner)  # what wrap reads of DistributedModelParallel
    DataParallelAcrossRanks("all_reduce").wrap(holder, SimpleNamespace(world_size=2, process_group=dist.group.WORLD),
                                               torch.device("cpu"))
    assert torch.all(inner[0].weight == 1.0) and inner.local.item() == rank
    assert holder.gradient_all_reduce.names == ["0.weight", "0.bias"]


def test_replicated_modules_start_from_rank_0():
    launch_local(_wrap_worker, 2, small_config(2))


def test_gradient_all_reduce_averages_what_each_backward_reaches():
    launch_local(_worker, 2, small_config(2))
