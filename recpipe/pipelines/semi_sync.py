"""The engine of ``semi_sync`` (what it does and why: ``recpipe.pipelines.defs.semi_sync``).

Its own steps split the backward: ``backward_dense`` stops at detached pooled
embeddings, ``backward_emb`` runs the output all-to-all backward and the fused update
(``emb_lookup=before_update``: ``backward_outdist`` down to the lookups' outputs, then
``backward_tbe``); the early ``lookup`` of batch i+1 runs between them in stream order.
With ``stash_gradients`` the dense optimizer applies the previous batch's gradient.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torchrec.distributed.types import LazyAwaitable

from recpipe.compat import torchrec as compat_torchrec
from recpipe.errors import PipelineError
from recpipe.runtime import sharded, steps
from recpipe.runtime.context import InFlight, StepContext
from recpipe.pipelines.defs import semi_sync as semi_sync_def
from recpipe.runtime.engine import Pipeline
from recpipe.runtime.schedule import Schedule

__all__ = ["SemiSyncPipeline"]


def backward_dense(ctx: StepContext, b: InFlight) -> None:
    assert b.loss is not None
    torch.sum(b.loss).backward()
    b.loss = None


def backward_emb(ctx: StepContext, b: InFlight) -> None:
    """Continue backward from the pooled embeddings into the sharded modules."""
    pairs = [(orig, leaf.grad) for orig, leaf in b.detached if leaf.grad is not None]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    b.detached.clear()
    _after_embedding_backward(ctx, b)


def _after_embedding_backward(ctx: StepContext, b: InFlight) -> None:
    """The loss went with backward_dense; an ``after_backward`` hook gets a zero. Only
    made when there is a hook (on CUDA it is an allocation and a fill kernel each step)."""
    hooks = ctx.pipeline
    if getattr(hooks.after_backward, "__func__", None) is not Pipeline.after_backward:
        hooks.after_backward(b.device, torch.zeros((), device=ctx.device))


def backward_outdist(ctx: StepContext, b: InFlight) -> None:
    """Backward from the pooled embeddings down to the lookups' own outputs (their
    autograd edges, captured when batch ``b`` was looked up): the output all-to-all
    backward, not the TBE backward. Lookups inside forward are captured too (the
    first batch's, ``own_forward``); if a sharded module still has no captured edge
    (no lookup output that needs a gradient), nothing happens here and
    ``backward_tbe`` runs the whole embedding backward, still after the lookup of i+1."""
    edges, b.lookup_out = b.lookup_out, {}
    if not b.detached or any(not edges.get(fqn) for fqn in ctx.modules):
        return
    pairs = [(orig, leaf.grad) for orig, leaf in b.detached if leaf.grad is not None]
    b.detached.clear()
    if not pairs:
        return
    flat = [edge for fqn in ctx.modules for edge in edges[fqn]]
    grads = torch.autograd.grad([o for o, _ in pairs], flat, [g for _, g in pairs], allow_unused=True)
    b.lookup_grads = [(edge, g) for edge, g in zip(flat, grads) if g is not None]


def backward_tbe(ctx: StepContext, b: InFlight) -> None:
    """The TBE backward of the lookups' outputs: the fused embedding update (the whole
    embedding backward when ``backward_outdist`` left it)."""
    if b.detached:
        backward_emb(ctx, b)
        return
    pairs, b.lookup_grads = b.lookup_grads, []
    if pairs:
        torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs])
    _after_embedding_backward(ctx, b)


class _Capture:
    """Where the lookup modules' forward hooks put the autograd edges of their outputs,
    per sharded module (``target``: the InFlight's dict while its lookup runs, else
    None). Edges, not the tensors: torchrec frees the lookup's output once its
    all-to-all is waited, and keeping it would hold batch i+1's embeddings twice. The
    hooks hold this object, not the pipeline."""

    target: dict[str, list[GradientEdge]] | None = None

    def hook_for(self, fqn: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.target is not None:
                outputs = output if isinstance(output, (list, tuple)) else [output]
                self.target.setdefault(fqn, []).extend(
                    get_gradient_edge(t) for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad)

        return hook


class SemiSyncPipeline(Pipeline):
    definition = semi_sync_def.PIPELINE

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        *,
        start_batch: int = 0,
        stash_gradients: bool = False,
        output_dist_wait: str = "in_forward",
        emb_lookup: str = "before_backward",
        **options: Any,
    ) -> None:
        """Options are checked by :class:`Options` when they come from a config; called
        directly, a value outside them is a KeyError naming it."""
        schedule = semi_sync_def.VARIANTS[(emb_lookup, output_dist_wait)]
        self.start_batch = start_batch
        self.stash_gradients = stash_gradients
        self._stash: dict[torch.nn.Parameter, torch.Tensor | None] | None = None
        stepped = sharded.dense_optimized_tables(sharded.find_sharded_modules(model), optimizer)
        if stepped:
            raise PipelineError(
                f"semi_sync needs every embedding table updated inside the TBE backward, but {stepped} are updated "
                "by the dense optimizer (data_parallel tables), whose step would race the early lookup; shard "
                "them table_wise/row_wise/column_wise or use pipeline.name=sparse_dist"
            )
        super().__init__(model, optimizer, device, schedule=schedule, **options)
        self._dense_params = steps.dense_params(optimizer)
        self._capture = _Capture()
        if emb_lookup == "before_update":
            no_lookups = [fqn for fqn, m in self.context.modules.items()
                          if compat_torchrec.lookups(m) is None]
            if no_lookups:
                raise PipelineError(
                    f"semi_sync emb_lookup=before_update stops the backward at the outputs of torchrec's lookup modules "
                    f"(the sharded module's _lookups), which {no_lookups} do not have; use emb_lookup=before_backward"
                )
            self._capture_lookups = True
            self._install_lookup_hooks()

    _capture_lookups = False  # emb_lookup="before_update": forward hooks on torchrec's lookup modules
    _lookup_hooks: list = []  # their handles while attached (set per instance)

    def _install_lookup_hooks(self) -> None:
        self._lookup_hooks = [lookup.register_forward_hook(self._capture.hook_for(fqn))
                              for fqn, module in self.context.modules.items() for lookup in compat_torchrec.lookups(module)]

    def attach(self) -> None:
        was = self.attached
        super().attach()
        if not was and self._capture_lookups:
            self._install_lookup_hooks()

    def detach(self) -> None:
        """Also removes the lookup modules' forward hooks (a model outlives its pipelines)."""
        super().detach()
        for handle in self._lookup_hooks:
            handle.remove()
        self._lookup_hooks = []

    def schedules(self) -> list[Schedule]:
        """The main schedule and its warm-up (the pair ``self.schedule`` belongs to)."""
        return next(list(pair) for pair in semi_sync_def.PHASES if self.schedule in pair)

    def schedule_for(self, batch: InFlight) -> Schedule:
        main, warmup = self.schedules()
        return main if batch.index >= self.start_batch else warmup

    def step_function(self, name: str):
        own = {"backward_dense": backward_dense, "backward_emb": backward_emb, "backward_outdist": backward_outdist,
               "backward_tbe": backward_tbe, "lookup": self._lookup, "optimizer": self._optimizer_step}
        return own.get(name) or steps.STEPS[name]

    def _lookup(self, ctx: StepContext, b: InFlight) -> None:
        """The early lookup; with emb_lookup=before_update its lookup modules' outputs
        are kept for ``backward_outdist``."""
        self._capture.target = b.lookup_out
        try:
            steps.lookup(ctx, b)
        finally:
            self._capture.target = None

    def sharded_forward(self, batch: InFlight, fqn: str, module: Any) -> Any:
        self._capture.target = batch.lookup_out  # a lookup inside forward (no early one) is captured too
        try:
            pooled = steps.sharded_forward(self.context, batch, fqn, module)
        finally:
            self._capture.target = None
        return steps.detach_pooled(batch, pooled)

    def own_forward(self, batch: InFlight, fqn: str, module: Any, features: Any) -> Any:
        """The first batch's modules run their own forward; its backward is split at their
        outputs too, so batch 1's stale lookup precedes batch 0's embedding backward in
        every variant (with emb_lookup=before_update it runs after backward_dense(0))."""
        self._capture.target = batch.lookup_out
        try:
            pooled = super().own_forward(batch, fqn, module, features)
            pooled = pooled.wait() if isinstance(pooled, LazyAwaitable) else pooled
        finally:
            self._capture.target = None
        return steps.detach_pooled(batch, pooled)

    def _optimizer_step(self, ctx: StepContext, b: InFlight) -> None:
        semi = b.index >= self.start_batch
        if not (self.stash_gradients and semi):
            steps.optimizer(ctx, b)
            return
        # Clone: DDP's gradients are views into its buckets, which the next backward overwrites.
        fresh = {p: None if p.grad is None else p.grad.clone() for p in self._dense_params}
        previous, self._stash = self._stash, fresh
        if previous is not None:  # apply batch t-1's gradient at step t
            self._set_grads(previous)
            steps.optimizer(ctx, b)
        if ctx.ahead(1) is None:  # draining: nothing follows, apply the last stash now
            self._set_grads(self._stash)
            self.optimizer.step()
            self._stash = None

    def _set_grads(self, grads: dict[torch.nn.Parameter, torch.Tensor | None]) -> None:
        for p, g in grads.items():
            p.grad = g


