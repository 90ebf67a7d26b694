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
  forward (``recpipe.runtime.inputs``); the stale lookup of batch 1 still runs before
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

from typing import Any, Literal

from pydantic import Field

from recpipe.capabilities import INTERCEPTS
from recpipe.runtime.definition import PipelineDef
from recpipe.runtime.options import PipelineKeys
from recpipe.runtime.schedule import Schedule, Step

__all__ = ["EVAL_SCHEDULE", "Options", "PHASES", "PIPELINE", "SCHEDULE", "VARIANTS", "check"]

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
# seen on two GPUs.)
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

# Each training schedule and its warm-up (batches < start_batch), and the schedule each
# (emb_lookup, output_dist_wait) runs.
PHASES = ((SCHEDULE, SCHEDULE_WARMUP), (SCHEDULE_WAIT_EARLY, SCHEDULE_WAIT_EARLY_WARMUP),
          (SCHEDULE_BEFORE_UPDATE, SCHEDULE_BEFORE_UPDATE_WARMUP),
          (SCHEDULE_BEFORE_UPDATE_WAIT_EARLY, SCHEDULE_BEFORE_UPDATE_WAIT_EARLY_WARMUP))
VARIANTS = {("before_backward", "in_forward"): SCHEDULE, ("before_backward", "early"): SCHEDULE_WAIT_EARLY,
            ("before_update", "in_forward"): SCHEDULE_BEFORE_UPDATE,
            ("before_update", "early"): SCHEDULE_BEFORE_UPDATE_WAIT_EARLY}


class Options(PipelineKeys):
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
    # before_update batch i+1's embeddings are not alive where backward(i) peaks: less step
    # memory above the model, for a longer step, most where the step is host-bound
    # (benchmarks/results/h200x2/semi_sync_lookup_65536.md, semi_sync_lookup_8192.md,
    # semi_sync_memory_65536.md).
    emb_lookup: Literal["before_backward", "before_update"] = "before_backward"


def check(cfg: Any) -> list[str]:
    """UVM-cached tables need cache-line locking, which only a prefetch step gives (``cfg``: a ``RecpipeConfig``)."""
    cached = [n for n, t in cfg.table_sharding().items() if t.kernel == "fused_uvm_caching"]
    if not cached:
        return []
    return [f"pipeline.name='semi_sync' with UVM-cached tables {cached}: it looks up batch i+1 before the backward "
            "of batch i, and the cache populate of i+1 can evict rows that backward still updates (cache-line "
            "locking only exists with the prefetch pipeline); use kernel 'fused' or 'fused_uvm' for those tables, "
            "or pipeline.name='prefetch'"]


def _torchrec_options(options: Any) -> tuple[dict[str, Any], list[str]]:
    notes = [f"pipeline.{k}={getattr(options, k)!r} has no TorchRec counterpart"
             for k in ("output_dist_wait", "emb_lookup") if k in options.model_fields_set]
    return ({"execute_all_batches": True, "start_batch": options.start_batch,
             "stash_gradients": options.stash_gradients}, notes)



PIPELINE = PipelineDef("semi_sync", Options,
                       "batch i+1's embeddings are looked up before batch i's update (one step stale)",
                       schedules=tuple(s for pair in PHASES for s in pair),
                       schedule_of=lambda options: VARIANTS[(options.emb_lookup, options.output_dist_wait)],
                       eval_schedule=EVAL_SCHEDULE, offers=frozenset({INTERCEPTS}),
                       engine="recpipe.pipelines.semi_sync:SemiSyncPipeline",
                       check=check, extra_facts=lambda options: {"stash_dense_grads": options.stash_gradients},
                       torchrec="TrainPipelineSemiSync", torchrec_options=_torchrec_options)
