"""Data parallelism for the replicated (unsharded) part of a sharded model.

torchrec replicates every module that holds no sharded table (the dense part) and
wraps it in DDP, whose per-step host work is large next to a host-bound 8192-sample
step: forward pre- and post-hooks over the whole model, a C++ autograd hook per
parameter, bucket bookkeeping, and an all-reduce per bucket issued from inside the
backward. recpipe averages those gradients with less (``sharding.dense_gradients``):

* ``all_reduce`` (default): :class:`GradientAllReduce`. Every replicated parameter's
  gradient is a view into one flat buffer per dtype (as DDP's
  ``gradient_as_bucket_view``), and once the backward is done (an autograd final
  callback, queued by the first parameter whose gradient arrives) the buffer is
  scaled by 1 / world size and all-reduced in one call: one scale kernel and one
  collective a step, no forward hooks. It works under any training loop that calls
  ``backward()`` (TorchRec's pipelines in ``recpipe bench`` included).
* ``ddp``: torchrec's default wrapper (DDP, 25 MiB buckets, static graph), whose
  bucketed all-reduces start during the backward.

One rank needs neither: there the replicated modules are only moved to the device
(:class:`DataParallelAcrossRanks`; DDP's all-reduce over one rank returns the
gradients unchanged).

Numerics: DDP computes ``grad * (1 / W)`` into its bucket and all-reduces (sums) the
buckets; ``all_reduce`` does the same two operations on the same values, so on two
ranks (a sum of two numbers does not depend on the order) and for every power-of-two
world size's scaling the gradients are bit-identical to DDP's
(``tests/test_pipelines.py`` trains both on two ranks and compares). With more than
two ranks NCCL's summation order follows the buffer layout, which differs from DDP's
buckets: the gradients may differ from DDP's in the last bits; every pipeline still
matches ``base`` exactly, since all of them run the same model.

Like DDP without ``find_unused_parameters``, every rank must produce the same set of
parameter gradients in each backward (else the collectives do not match). A backward
that reaches only some of them (semi_sync's split backward, where feature-processor
weights get theirs in the second half) all-reduces just those.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.model_parallel import DataParallelWrapper, DefaultDataParallelWrapper

from recpipe.compat import torch as compat_torch
from recpipe.compat import torchrec as compat_torchrec

DENSE_GRADIENTS = ("all_reduce", "ddp")
BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DDP's default for its initial broadcast


class GradientAllReduce:
    """Averages the gradients of ``params`` over ``group`` after every backward.

    Made once per model (:class:`DataParallelAcrossRanks`); it lives as long as the
    parameters' hooks do. ``reductions`` counts the backwards it reduced (tests)."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], group: dist.ProcessGroup) -> None:
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.group = group
        self.scale = 1.0 / dist.get_world_size(group)
        self.views: list[torch.Tensor] = []
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        offsets = []
        for p in self.params:
            key = (p.dtype, p.device)
            offsets.append((key, sizes.get(key, 0)))
            sizes[key] = sizes.get(key, 0) + p.numel()
        self.flat: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {
            key: torch.zeros(n, dtype=key[0], device=key[1]) for key, n in sizes.items()}
        for p, (key, start) in zip(self.params, offsets):
            self.views.append(self.flat[key][start:start + p.numel()].view_as(p))
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._arrived: list[int] = []
        self.reductions = 0
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._arrive)

    def __repr__(self) -> str:
        total = sum(t.numel() for t in self.flat.values())
        return f"GradientAllReduce({len(self.params)} parameters, {total} values in {len(self.flat)} flat buffers)"

    def _arrive(self, param: torch.Tensor) -> None:
        if not self._arrived:
            compat_torch.queue_backward_callback(self._reduce)
        self._arrived.append(self._index[id(param)])

    def _reduce(self) -> None:
        arrived, self._arrived = sorted(set(self._arrived)), []
        grads, views = [], []
        for i in arrived:
            g, v = self.params[i].grad, self.views[i]
            if g is not v:  # a fresh gradient (zero_grad set it to None): into the buffer
                grads.append(g)
                views.append(v)
        if views:
            compat_torch.foreach_copy_(views, grads)
        if len(arrived) == len(self.params):
            for flat in self.flat.values():
                flat.mul_(self.scale)
                dist.all_reduce(flat, group=self.group)
        else:  # only part of the model's gradients in this backward
            for i in arrived:
                self.views[i].mul_(self.scale)
                dist.all_reduce(self.views[i], group=self.group)
        for i in arrived:
            p = self.params[i]
            if p.grad is not self.views[i]:
                p.grad = self.views[i]
        self.reductions += 1


class DataParallelAcrossRanks(DataParallelWrapper):
    """How DistributedModelParallel replicates the unsharded modules
    (``sharding.dense_gradients``, module docstring): on one rank only moved to the
    device; on several, :class:`GradientAllReduce` (``all_reduce``) or torchrec's
    DDP wrapper (``ddp``)."""

    def __init__(self, dense_gradients: str = "all_reduce") -> None:
        if dense_gradients not in DENSE_GRADIENTS:
            raise ValueError(f"sharding.dense_gradients must be one of {DENSE_GRADIENTS}, not {dense_gradients!r}")
        self.dense_gradients = dense_gradients

    def wrap(self, dmp: DistributedModelParallel, env, device: torch.device) -> None:
        module = dmp.module  # the user's model: DMP has not wrapped it yet
        if env.world_size > 1 and self.dense_gradients == "ddp":
            DefaultDataParallelWrapper().wrap(dmp, env, device)
            return
        module.to(device)  # what DefaultDataParallelWrapper does before DDP
        if env.world_size == 1:
            return
        ignore = set(compat_torchrec.sharded_parameter_names(module))
        params = [(n, p) for n, p in module.named_parameters() if n not in ignore and p.requires_grad]
        if not params:
            return
        # As DDP's construction in torchrec's wrapper (broadcast_buffers=False): the same
        # shapes on every rank, then rank 0's parameters everywhere; buffers stay as they are.
        compat_torch.verify_param_shapes(env.process_group, [p for _, p in params])
        compat_torch.broadcast_parameters(module, env.process_group, BROADCAST_BUCKET_BYTES, 0, ignore)
        dmp.gradient_all_reduce = GradientAllReduce(params, env.process_group)
