"""``semi_sync``: batch i+1's embeddings are looked up before batch i's update.

Exact semantics (what ``tests/test_pipelines.py`` checks against a plain-loop
reference). Number the batches of one pass over data t = 0, 1, ...; let E_t / D_t
be the embedding / dense parameters after the updates of batches < t.

* Batch t's pooled embeddings are computed from E_{t-1} (they miss batch t-1's
  update) for every t >= max(1, start_batch + 1); earlier batches, and the first
  batch after every drain (end of data, eval or checkpoint segment), use E_t.
* Its gradient is evaluated at those embeddings and applied by the fused TBE
  backward to the current table, E_{t+1} = update(E_t, g_t(E_{t-1})).
* Dense: ``stash_gradients=False`` — D_{t+1} = opt(D_t, grad of batch t).
  ``stash_gradients=True`` — the dense optimizer applies batch t-1's gradient at
  step t, so dense is one step stale too; the first semi-sync step applies nothing,
  and at every drain the last stashed gradient is applied in one extra optimizer
  step, so every batch's gradient is applied exactly once.

* Feature processors (position weights of a FeatureProcessedEmbeddingBagCollection)
  are dense parameters read inside the lookup, so batch t's lookup reads them as of
  D_{t-1}, one step stale like the embeddings.
* The first batch of the pipeline's life trains while the modules run their own
  forward (``recpipe.pipelines.inputs``); the stale lookup of batch 1 still runs before
  backward(0), so the rule above holds from batch 1 on.

How: the lookup of t+1 is queued on the compute stream after forward(t) and before
backward(t); the TBE update of t runs later on the same stream, so stream order
(not timing) decides what the lookup reads. Backward is split: dense backward stops
at detached pooled embeddings, then ``backward_emb`` runs the output all-to-all
backward and the fused update. Warm-up (batches < start_batch) uses a schedule
that looks up after the optimizer: the same order as ``sparse_dist``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from recpipe.pipelines import sharded, steps
from recpipe.pipelines.engine import InFlight, Pipeline
from recpipe.pipelines.schedule import Schedule, Step

_HEAD = (
    Step("zero_grad", "compute", 0),
    Step("h2d", "memcpy", 2),
    Step("input_dist", "dist", 2, waits=(("h2d", 0),)),
    Step("forward", "compute", 0, waits=(("h2d", 0), ("lookup", 0))),
)
_LOOKUP = Step("lookup", "compute", 1, waits=(("input_dist_wait", 0),))
# Waits for the lookup's output all-to-all right after it, on the compute stream where
# the lookup allocated the all-to-all's buffers, so the lookup's own output (the
# all-to-all's input) is freed before backward(i) instead of living beside the
# all-to-all's output until forward(i+1): one copy of batch i+1's embeddings during
# backward(i), not two. The cost: backward(i) starts after that all-to-all is done.
# (Waiting on the dist stream instead would keep compute free, but torchrec frees the
# all-to-all's output buffer, allocated on compute, while dist still reads it: a race,
# seen once on 2 x H200.)
_OUTPUT_WAIT = Step("output_dist_wait", "compute", 1, waits=(("lookup", 0),))
_TAIL = (
    Step("input_dist_wait", "dist", 2),
    Step("backward_dense", "compute", 0),
    Step("backward_emb", "compute", 0),
    Step("optimizer", "compute", 0),
)

SCHEDULE_WAIT_EARLY = Schedule(
    "semi_sync_wait_early",
    (*_HEAD, _LOOKUP, _OUTPUT_WAIT, *_TAIL),
    doc="Variant: lookup of batch i+1 before backward(i), one step stale; its output all-to-all is waited right "
    "after it, freeing the lookup's output before backward(i).",
).validate()

SCHEDULE_WAIT_EARLY_WARMUP = Schedule(
    "semi_sync_wait_early_warmup",
    (*_HEAD, *_TAIL, _LOOKUP, _OUTPUT_WAIT),
    doc="Warm-up of the wait_early variant.",
).validate()

# output_dist_wait="in_forward" (default): the all-to-all is waited in forward(i+1)
# (TorchRec's order), so it overlaps backward(i); batch i+1's lookup output stays alive
# through backward(i).
SCHEDULE = Schedule(
    "semi_sync",
    (*_HEAD, _LOOKUP, *_TAIL),
    doc="Lookup of batch i+1 before backward(i): one step stale, its output all-to-all overlaps backward(i).",
).validate()

SCHEDULE_WARMUP = Schedule(
    "semi_sync_warmup",
    (*_HEAD, *_TAIL, _LOOKUP),
    doc="Warm-up (batches < start_batch): lookup of batch i+1 after optimizer(i), synchronous numerics.",
).validate()


_PAIRS = ((SCHEDULE, SCHEDULE_WARMUP), (SCHEDULE_WAIT_EARLY, SCHEDULE_WAIT_EARLY_WARMUP))


def backward_dense(pipe: Pipeline, b: InFlight) -> None:
    assert b.loss is not None
    torch.sum(b.loss).backward()
    b.loss = None


def backward_emb(pipe: Pipeline, b: InFlight) -> None:
    """Continue backward from the pooled embeddings into the sharded modules."""
    pairs = [(orig, leaf.grad) for orig, leaf in b.detached if leaf.grad is not None]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    b.detached.clear()
    # The loss went with backward_dense; a hook gets a zero. Only made when there is a
    # hook (on CUDA it is an allocation and a fill kernel each step).
    if getattr(pipe.after_backward, "__func__", None) is not Pipeline.after_backward:
        pipe.after_backward(b.device, torch.zeros((), device=pipe.device))


class SemiSyncPipeline(Pipeline):
    name = "semi_sync"
    schedule = SCHEDULE
    every_schedule = (SCHEDULE, SCHEDULE_WARMUP, SCHEDULE_WAIT_EARLY, SCHEDULE_WAIT_EARLY_WARMUP)  # default first

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        *,
        start_batch: int = 0,
        stash_gradients: bool = False,
        output_dist_wait: str = "in_forward",
        **options: Any,
    ) -> None:
        if start_batch < 0:
            raise ValueError(f"start_batch={start_batch} must be >= 0")
        variants = {"in_forward": SCHEDULE, "early": SCHEDULE_WAIT_EARLY}
        if output_dist_wait not in variants:
            raise ValueError(f"output_dist_wait={output_dist_wait!r}: choose one of {sorted(variants)}")
        self.schedule = variants[output_dist_wait]
        self.start_batch = start_batch
        self.stash_gradients = stash_gradients
        self._stash: dict[torch.nn.Parameter, torch.Tensor | None] | None = None
        stepped = sharded.dense_optimized_tables(sharded.find_sharded_modules(model), optimizer)
        if stepped:
            raise sharded.PipelineError(
                f"semi_sync needs every embedding table updated inside the TBE backward, but {stepped} are updated "
                "by the dense optimizer (data_parallel tables), whose step would race the early lookup; shard "
                "them table_wise/row_wise/column_wise or use pipeline.name=sparse_dist"
            )
        super().__init__(model, optimizer, device, **options)
        self._dense_params = steps.dense_params(optimizer)

    def schedules(self) -> list[Schedule]:
        """The main schedule and its warm-up (the pair ``self.schedule`` belongs to)."""
        return next(list(pair) for pair in _PAIRS if self.schedule in pair)

    def schedule_for(self, batch: InFlight) -> Schedule:
        main, warmup = self.schedules()
        return main if batch.index >= self.start_batch else warmup

    def step_function(self, name: str):
        own = {"backward_dense": backward_dense, "backward_emb": backward_emb, "optimizer": self._optimizer_step}
        return own.get(name) or steps.STEPS[name]

    def _sharded_forward(self, batch: InFlight, fqn: str, module: Any) -> Any:
        return steps.detach_pooled(batch, steps.sharded_forward(self, batch, fqn, module))

    def _optimizer_step(self, pipe: Pipeline, b: InFlight) -> None:
        semi = b.index >= self.start_batch
        if not (self.stash_gradients and semi):
            steps.optimizer(pipe, b)
            return
        # Clone: DDP's gradients are views into its buckets, which the next backward overwrites.
        fresh = {p: None if p.grad is None else p.grad.clone() for p in self._dense_params}
        previous, self._stash = self._stash, fresh
        if previous is not None:  # apply batch t-1's gradient at step t
            self._set_grads(previous)
            steps.optimizer(pipe, b)
        if self._slots[1] is None:  # draining: nothing follows, apply the last stash now
            self._set_grads(self._stash)
            self.optimizer.step()
            self._stash = None

    def _set_grads(self, grads: dict[torch.nn.Parameter, torch.Tensor | None]) -> None:
        for p, g in grads.items():
            p.grad = g
