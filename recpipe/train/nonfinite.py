"""Non-finite losses (NaN / inf): found without a host sync per step; ``train.on_nonfinite`` decides.

Finding them (both modes): :meth:`NonFiniteCheck.record` keeps each step's loss
tensor (on the device; no work per step). :meth:`NonFiniteCheck.check` all-reduces
a [ranks x steps] matrix of the losses, so every rank learns the same steps: at log
points without waiting (the result is read at the next log point), and before every
evaluation and checkpoint and at the end waiting for the device, so no checkpoint or
evaluation ever sees weights that a non-finite step has touched.

* ``error``: ``check`` raises :class:`NonFiniteLossError` naming the first such
  step, the ranks, and the newest checkpoint (all saved before that step).
* ``skip_step``: :class:`SkipNonFiniteSteps` makes such a step update nothing, on
  the device: right after forward, every rank all-reduces (MIN) whether its loss is
  finite (on NCCL the compute stream waits for it; the host does not); during
  backward the gradient entering every sharded module's output (hence every fused
  TBE update) and every dense parameter's gradient (before DDP's all-reduce) is
  replaced by zero when any rank's loss was not finite. ``torch.where``, not a
  multiplication: NaN * 0 is NaN. ``check`` then reports the skipped steps, and
  raises :class:`NonFiniteLossError` like ``error`` once more than
  ``train.max_skipped_steps`` of any ``train.skipped_steps_window`` consecutive steps
  were skipped: skipping is for the rare bad batch; a model whose loss is non-finite
  step after step has diverged, and a run that skips its way to the end would report
  "completed" with a useless model.

Before every checkpoint :func:`check_finite_weights` looks at every weight (dense
parameters and each rank's shards of the tables): a diverged model whose losses
happened to stay finite (inf weights, a NaN row) is never saved. It reads each
weight once, on the device, with one host sync: a fraction of what the save itself
reads and writes.

A zero gradient is a no-op update for SGD and (row-wise) Adagrad without weight
decay: those skip exactly. Adam's moments still decay, and weight decay still
shrinks the weights, on a skipped step (``skip_step_caveats`` warns).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torchrec.distributed.types import Awaitable
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedTensor

from recpipe.compat import torch as compat_torch
from recpipe.config import OptimizerConfig
from recpipe.errors import NonFiniteLossError
from recpipe.runtime.sharded import find_sharded_modules
from recpipe.train.metrics import HostCopy

__all__ = ["NonFiniteCheck", "SkipNonFiniteSteps", "check_finite_weights", "finite_json", "skip_step_caveats"]


class NonFiniteCheck:
    """Records each step's loss; ``check`` is collective (every rank, same step)."""

    def __init__(self, mode: str, device: torch.device, describe_checkpoint: Callable[[], str], *,
                 max_skipped: int = 1, window: int = 100) -> None:
        self.mode = mode
        self.max_skipped, self.window = max_skipped, window  # skip_step's limit (train.max_skipped_steps, ...)
        self.device = device
        self.describe_checkpoint = describe_checkpoint  # "newest checkpoint: ..." for the error
        self._losses: list[torch.Tensor] = []
        self._queued: list[tuple[int, HostCopy]] = []  # (first step, [ranks x steps] losses on their way)
        self.skipped: list[int] = []  # every skipped step so far (skip_step)

    def record(self, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach())

    def check(self, step: int, wait: bool = True) -> list[int]:
        """The steps whose loss was not finite on some rank, among those checked now;
        with ``error``, raise for the first. ``wait``: every step up to ``step`` (the
        last recorded one) is checked (host sync). Without: the steps since the last
        call are queued (all-reduce and copy, no host sync) and those queued by the
        call before are checked, whose results have long arrived: a log point need not
        drain the device, and a non-finite loss is still found one log interval later,
        before any evaluation or checkpoint (which check with ``wait``)."""
        self._queue(step)
        ready = self._queued if wait else self._queued[:-1]
        self._queued = [] if wait else self._queued[-1:]
        return [bad for first, copy in ready for bad in self._inspect(first, copy.wait(), step)]

    def _queue(self, step: int) -> None:
        if not self._losses:
            return
        first = step - len(self._losses) + 1
        # One value per step (sum of a vector loss: non-finite iff an element is).
        local = torch.stack([loss.float().sum() for loss in self._losses])
        self._losses.clear()
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        values = torch.zeros(world, local.numel(), device=local.device)
        values[rank] = local
        if world > 1:
            dist.all_reduce(values)  # each rank fills its own row
        self._queued.append((first, HostCopy(values)))

    def _inspect(self, first: int, values: torch.Tensor, step: int) -> list[int]:
        bad = ~torch.isfinite(values)
        steps = [first + int(i) for i in bad.any(dim=0).nonzero().flatten()]
        if not steps:
            return []
        column = steps[0] - first
        ranks = ", ".join(f"rank {r}: {values[r, column].item()}" for r in bad[:, column].nonzero().flatten().tolist())
        if self.mode == "error":
            raise NonFiniteLossError(
                f"non-finite loss at step {steps[0]} ({ranks}); stopped at step {step}, nothing saved after step "
                f"{steps[0] - 1}. {self.describe_checkpoint()}. Lower optimizer.dense.lr / optimizer.embedding.lr, "
                "or set train.on_nonfinite=skip_step to skip such steps"
            )
        self.skipped.extend(steps)
        self._limit_skipped(steps, step)
        return steps

    def _limit_skipped(self, new: list[int], step: int) -> None:
        """skip_step: raise once some window of ``self.window`` steps has more than
        ``self.max_skipped`` skipped ones (the same on every rank: ``skipped`` is)."""
        for last in new:
            inside = [s for s in self.skipped if last - self.window < s <= last]
            if len(inside) > self.max_skipped:
                shown = ", ".join(map(str, inside[:10])) + (", ..." if len(inside) > 10 else "")
                raise NonFiniteLossError(
                    f"too many non-finite losses: {len(inside)} of the {self.window} steps up to step {last} were "
                    f"skipped (steps {shown}), more than train.max_skipped_steps={self.max_skipped} in "
                    f"train.skipped_steps_window={self.window}: the model has diverged; stopped at step {step}. "
                    f"{self.describe_checkpoint()}. Lower optimizer.dense.lr / optimizer.embedding.lr"
                )


def _local_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every floating-point weight this rank holds: the model's
    state_dict, with the local shards of sharded tables (ShardedTensor)."""
    for name, value in model.state_dict().items():
        if compat_torch.is_sharded_tensor(value):
            for shard in value.local_shards():
                yield name, shard.tensor
        elif isinstance(value, DTensor):
            yield name, value.to_local()
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            yield name, value


def check_finite_weights(model: nn.Module, step: int, newest_checkpoint: str) -> None:
    """Collective: raise :class:`NonFiniteLossError` on every rank when any rank holds
    a weight with a NaN or inf (the names come from the ranks that found them)."""
    named = [(name, t) for name, t in _local_weights(model) if t.numel()]
    bad_here: list[str] = []
    if named:
        finite = torch.stack([torch.isfinite(t).all() for _, t in named]).cpu()  # host sync, once
        bad_here = sorted({name for (name, _), ok in zip(named, finite.tolist()) if not ok})
    found: list[list[str] | None] = [bad_here]
    if dist.is_initialized() and dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, bad_here)
    bad = sorted({name for part in found for name in part or ()})
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise NonFiniteLossError(
            f"non-finite weights after step {step} ({shown}): the model has diverged; nothing saved after step "
            f"{step - 1}. {newest_checkpoint}. Lower optimizer.dense.lr / optimizer.embedding.lr"
        )


class _MaskGrad(torch.autograd.Function):
    """Identity forward; backward passes the gradient where ``ok`` > 0, else zeros.
    ``ok`` is read when backward runs (it is set after this forward, from the loss),
    so it is kept on ctx, not saved for backward (which would check its version)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        ctx.ok = ok
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.where(ctx.ok > 0, grad, 0.0), None


class SkipNonFiniteSteps:
    """``train.on_nonfinite=skip_step`` on a sharded model (see the module docstring).

    Installed as hooks, visibly and removably: a forward hook on ``model`` (sets the
    flag from the loss), a forward hook on every sharded module (masks the gradient
    into its output), a gradient hook on every parameter that is not updated inside
    the TBE backward (the dense optimizer's: dense layers, data_parallel tables).
    ``remove()`` takes them all away."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.ok = torch.ones((), dtype=torch.int32, device=device)  # 1: every rank's loss was finite
        self._distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.modules = find_sharded_modules(model)
        self.dense = [p for _, p in in_backward_optimizer_filter(model.named_parameters()) if p.requires_grad]
        self._handles = [model.register_forward_hook(self._after_forward)]
        self._handles += [m.register_forward_hook(self._mask_embeddings) for m in self.modules.values()]
        self._handles += [p.register_hook(self._mask_dense) for p in self.dense]

    def __repr__(self) -> str:
        return (f"SkipNonFiniteSteps(hooks on the model, on sharded modules {sorted(self.modules)} and on "
                f"{len(self.dense)} dense parameters; .remove() takes them away)")

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not (torch.is_grad_enabled() and module.training):
            return  # evaluation
        loss = output[0]
        self.ok.copy_(torch.isfinite(loss.detach()).all())
        if self._distributed:
            # NCCL: the compute stream waits for it, the host does not. Every rank
            # runs it at the same point of every training forward.
            dist.all_reduce(self.ok, op=dist.ReduceOp.MIN)

    def _mask_dense(self, grad: torch.Tensor) -> torch.Tensor:
        return torch.where(self.ok > 0, grad, 0.0)

    def _mask_pooled(self, pooled: KeyedTensor) -> KeyedTensor:
        values = _MaskGrad.apply(pooled.values(), self.ok)
        return KeyedTensor(
            keys=pooled.keys(), length_per_key=pooled.length_per_key(), values=values, key_dim=pooled.key_dim()
        )

    def _mask_embeddings(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return None
        if isinstance(output, KeyedTensor):  # pipelines that intercept the module
            return self._mask_pooled(output)
        if isinstance(output, Awaitable):  # the module's own forward (base): masked when waited
            output.callbacks.append(self._mask_pooled)
            return None
        raise TypeError(
            f"train.on_nonfinite=skip_step masks the gradient into sharded modules that return pooled embeddings "
            f"(KeyedTensor, e.g. EmbeddingBagCollection); {type(module).__name__} returned {type(output).__name__}. "
            "Use train.on_nonfinite=error"
        )


def skip_step_caveats(optimizer: OptimizerConfig) -> list[str]:
    """Where ``skip_step`` cannot skip exactly (a zero gradient still moves the weights)."""
    out = []
    for key, opt in (("optimizer.dense", optimizer.dense), ("optimizer.embedding", optimizer.embedding)):
        if opt.name == "adam":
            out.append(f"{key}.name='adam': on a skipped step Adam's moments still decay and move the weights")
        if opt.weight_decay > 0:
            out.append(f"{key}.weight_decay={opt.weight_decay}: on a skipped step weight decay still shrinks the weights")
    return out


def finite_json(value: Any) -> Any:
    """``value`` with every NaN / inf float replaced by None: JSON has no such numbers
    (``json.dumps`` would write ``NaN``, which JSON parsers reject)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value
