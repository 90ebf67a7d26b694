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

``emb_lookup="before_update"`` queues the lookup of t+1 later in backward(t): after
the dense backward and the output all-to-all backward (``backward_outdist``, which
stops at the lookup's own outputs, captured by forward hooks on the sharded modules'
lookup modules) and before the TBE backward that updates the tables
(``backward_tbe``). Same numbers (the lookup still precedes the update in stream
order); batch t+1's embeddings then do not live through the part of backward(t)
where the step's memory peaks, and its output all-to-all overlaps only the TBE
backward and the optimizer of t.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Literal

import torch
from pydantic import Field
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torchrec.distributed.types import LazyAwaitable

from recpipe.errors import PipelineError
from recpipe.pipelines import sharded, steps
from recpipe.pipelines.definition import PipelineDef
from recpipe.pipelines.engine import InFlight, Pipeline
from recpipe.pipelines.options import PipelineOptions
from recpipe.pipelines.schedule import Schedule, Step

if TYPE_CHECKING:
    from recpipe.config import RecpipeConfig

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


# emb_lookup="before_update": the lookup of batch i+1 between the output all-to-all
# backward of i and its TBE backward (the embedding update).
_SPLIT_HEAD = (*_HEAD, Step("input_dist_wait", "dist", 2), Step("backward_dense", "compute", 0),
               Step("backward_outdist", "compute", 0))
_SPLIT_TAIL = (Step("backward_tbe", "compute", 0), Step("optimizer", "compute", 0))

SCHEDULE_BEFORE_UPDATE = Schedule(
    "semi_sync_before_update",
    (*_SPLIT_HEAD, _LOOKUP, *_SPLIT_TAIL),
    doc="Variant: lookup of batch i+1 after the dense and output all-to-all backward of i, before its TBE update; "
    "one step stale, as the default.",
).validate()

SCHEDULE_BEFORE_UPDATE_WARMUP = Schedule(
    "semi_sync_before_update_warmup",
    (*_SPLIT_HEAD, *_SPLIT_TAIL, _LOOKUP),
    doc="Warm-up of the before_update variant.",
).validate()

SCHEDULE_BEFORE_UPDATE_WAIT_EARLY = Schedule(
    "semi_sync_before_update_wait_early",
    (*_SPLIT_HEAD, _LOOKUP, _OUTPUT_WAIT, *_SPLIT_TAIL),
    doc="Variant: before_update, its output all-to-all waited right after the lookup.",
).validate()

SCHEDULE_BEFORE_UPDATE_WAIT_EARLY_WARMUP = Schedule(
    "semi_sync_before_update_wait_early_warmup",
    (*_SPLIT_HEAD, *_SPLIT_TAIL, _LOOKUP, _OUTPUT_WAIT),
    doc="Warm-up of the before_update, wait-early variant.",
).validate()

# No update in an evaluation, so nothing is stale: the lookup of batch i+1 right after forward(i),
# on the compute stream as in training (every variant evaluates alike).
EVAL_SCHEDULE = Schedule(
    "semi_sync_eval",
    (
        Step("h2d", "memcpy", 2),
        Step("input_dist", "dist", 2, waits=(("h2d", 0),)),
        Step("forward_eval", "compute", 0, waits=(("h2d", 0), ("lookup", 0))),
        Step("lookup", "compute", 1, waits=(("input_dist_wait", 0),)),
        Step("input_dist_wait", "dist", 2),
    ),
    doc="Evaluation: the lookup of batch i+1 right after forward(i); exact (no update to miss).",
).validate()

_PAIRS = ((SCHEDULE, SCHEDULE_WARMUP), (SCHEDULE_WAIT_EARLY, SCHEDULE_WAIT_EARLY_WARMUP),
          (SCHEDULE_BEFORE_UPDATE, SCHEDULE_BEFORE_UPDATE_WARMUP),
          (SCHEDULE_BEFORE_UPDATE_WAIT_EARLY, SCHEDULE_BEFORE_UPDATE_WAIT_EARLY_WARMUP))
_VARIANTS = {("before_backward", "in_forward"): SCHEDULE, ("before_backward", "early"): SCHEDULE_WAIT_EARLY,
             ("before_update", "in_forward"): SCHEDULE_BEFORE_UPDATE,
             ("before_update", "early"): SCHEDULE_BEFORE_UPDATE_WAIT_EARLY}


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
    _after_embedding_backward(pipe, b)


def _after_embedding_backward(pipe: Pipeline, b: InFlight) -> None:
    """The loss went with backward_dense; an ``after_backward`` hook gets a zero. Only
    made when there is a hook (on CUDA it is an allocation and a fill kernel each step)."""
    if getattr(pipe.after_backward, "__func__", None) is not Pipeline.after_backward:
        pipe.after_backward(b.device, torch.zeros((), device=pipe.device))


def backward_outdist(pipe: Pipeline, b: InFlight) -> None:
    """Backward from the pooled embeddings down to the lookups' own outputs (their
    autograd edges, captured when batch ``b`` was looked up): the output all-to-all
    backward, not the TBE backward. Lookups inside forward are captured too (the
    first batch's, ``_own_forward``); if a sharded module still has no captured edge
    (no lookup output that needs a gradient), nothing happens here and
    ``backward_tbe`` runs the whole embedding backward, still after the lookup of i+1."""
    edges, b.lookup_out = b.lookup_out, {}
    if not b.detached or any(not edges.get(fqn) for fqn in pipe._modules):
        return
    pairs = [(orig, leaf.grad) for orig, leaf in b.detached if leaf.grad is not None]
    b.detached.clear()
    if not pairs:
        return
    flat = [edge for fqn in pipe._modules for edge in edges[fqn]]
    grads = torch.autograd.grad([o for o, _ in pairs], flat, [g for _, g in pairs], allow_unused=True)
    b.lookup_grads = [(edge, g) for edge, g in zip(flat, grads) if g is not None]


def backward_tbe(pipe: Pipeline, b: InFlight) -> None:
    """The TBE backward of the lookups' outputs: the fused embedding update (the whole
    embedding backward when ``backward_outdist`` left it)."""
    if b.detached:
        backward_emb(pipe, b)
        return
    pairs, b.lookup_grads = b.lookup_grads, []
    if pairs:
        torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs])
    _after_embedding_backward(pipe, b)


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


class Options(PipelineOptions):
    name: Literal["semi_sync"]
    # Synchronous (sparse_dist-equivalent) warm-up steps before going semi-sync.
    start_batch: int = Field(0, ge=0)
    # Apply the dense gradient one step late too, so dense and sparse are equally stale.
    stash_gradients: bool = False
    # Where batch i+1's output all-to-all is waited: "in_forward" (in forward(i+1), TorchRec's
    # order: it overlaps backward(i), and both the lookup's output and the all-to-all's are
    # alive during backward(i)) or "early" (right after the lookup: the lookup's output is
    # freed before backward(i), which starts once that all-to-all is done).
    output_dist_wait: Literal["early", "in_forward"] = "in_forward"
    # Where batch i+1's lookup is queued: "before_backward" (after forward(i), TorchRec's
    # order) or "before_update" (inside backward(i): after the dense and output all-to-all
    # backward, before the TBE backward that updates the tables). Same numbers; with
    # before_update batch i+1's embeddings are not alive where backward(i) peaks: on 2 x H200
    # step memory above the model 1.23 x sparse_dist's instead of 1.76 x, +0.9 % step time at
    # 65536 samples, +11 % at a host-bound 8192.
    emb_lookup: Literal["before_backward", "before_update"] = "before_backward"


def check(cfg: "RecpipeConfig") -> list[str]:
    cached = [n for n, t in cfg.table_sharding().items() if t.kernel == "fused_uvm_caching"]
    if not cached:
        return []
    return [f"pipeline.name='semi_sync' with UVM-cached tables {cached}: it looks up batch i+1 before the backward "
            "of batch i, and the cache populate of i+1 can evict rows that backward still updates (cache-line "
            "locking only exists with the prefetch pipeline); use kernel 'fused' or 'fused_uvm' for those tables, "
            "or pipeline.name='prefetch'"]


class SemiSyncPipeline(Pipeline):
    name = "semi_sync"
    schedule = SCHEDULE
    eval_schedule = EVAL_SCHEDULE

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
        schedule = _VARIANTS[(emb_lookup, output_dist_wait)]
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
            no_lookups = [fqn for fqn, m in self._modules.items()
                          if not (isinstance(getattr(m, "_lookups", None), (list, nn.ModuleList)) and m._lookups
                                  and all(isinstance(lk, nn.Module) for lk in m._lookups))]
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
                              for fqn, module in self._modules.items() for lookup in module._lookups]

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
        return next(list(pair) for pair in _PAIRS if self.schedule in pair)

    def schedule_for(self, batch: InFlight) -> Schedule:
        main, warmup = self.schedules()
        return main if batch.index >= self.start_batch else warmup

    def step_function(self, name: str):
        own = {"backward_dense": backward_dense, "backward_emb": backward_emb, "backward_outdist": backward_outdist,
               "backward_tbe": backward_tbe, "lookup": self._lookup, "optimizer": self._optimizer_step}
        return own.get(name) or steps.STEPS[name]

    def _lookup(self, pipe: Pipeline, b: InFlight) -> None:
        """The early lookup; with emb_lookup=before_update its lookup modules' outputs
        are kept for ``backward_outdist``."""
        self._capture.target = b.lookup_out
        try:
            steps.lookup(pipe, b)
        finally:
            self._capture.target = None

    def _sharded_forward(self, batch: InFlight, fqn: str, module: Any) -> Any:
        self._capture.target = batch.lookup_out  # a lookup inside forward (no early one) is captured too
        try:
            pooled = steps.sharded_forward(self, batch, fqn, module)
        finally:
            self._capture.target = None
        return steps.detach_pooled(batch, pooled)

    def _own_forward(self, batch: InFlight, fqn: str, module: Any, features: Any) -> Any:
        """The first batch's modules run their own forward; its backward is split at their
        outputs too, so batch 1's stale lookup precedes batch 0's embedding backward in
        every variant (with emb_lookup=before_update it runs after backward_dense(0))."""
        self._capture.target = batch.lookup_out
        try:
            pooled = super()._own_forward(batch, fqn, module, features)
            pooled = pooled.wait() if isinstance(pooled, LazyAwaitable) else pooled
        finally:
            self._capture.target = None
        return steps.detach_pooled(batch, pooled)

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


def _torchrec_options(options: Any) -> tuple[dict[str, Any], list[str]]:
    notes = [f"pipeline.{k}={getattr(options, k)!r} has no TorchRec counterpart"
             for k in ("output_dist_wait", "emb_lookup") if k in options.model_fields_set]
    return ({"execute_all_batches": True, "start_batch": options.start_batch,
             "stash_gradients": options.stash_gradients}, notes)


PIPELINE = PipelineDef("semi_sync", SemiSyncPipeline, Options,
                       "batch i+1's embeddings are looked up before batch i's update (one step stale)",
                       schedules=tuple(s for pair in _PAIRS for s in pair),
                       schedule_of=lambda options: _VARIANTS[(options.emb_lookup, options.output_dist_wait)],
                       check=check, extra_facts=lambda options: {"stash_dense_grads": options.stash_gradients},
                       torchrec="TrainPipelineSemiSync", torchrec_options=_torchrec_options)
