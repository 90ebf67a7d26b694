"""``prefetch``: UVM-cache prefetch of batch i+1 between forward(i) and backward(i).

For ``fused_uvm_caching`` tables built with FBGEMM's ``prefetch_pipeline`` (LRU,
cache-line locking), FBGEMM's contract is: prefetch(i) -> fwd(i) -> prefetch(i+1)
-> bwd(i) -> prefetch(i+2), exactly one prefetch per forward, each prefetched
batch followed by its backward (which unlocks its cache lines). This schedule is
that order: forward(i) is queued, the host waits for batch i+1's splits while the
GPU runs it (as in sparse_dist), launches i+1's tensors all-to-all, and queues the
prefetch of i+1 on the prefetch stream; FBGEMM's backward hooks serialize the TBE
backward(i) against it. TorchRec's order, with the host wait before forward(i), left
the GPU idle while the host waited (docs/pipelines.md, "prefetch and FBGEMM's
cache-line locking"; tests/schedule_variants.py keeps that order as a test schedule).

Fixes of TorchRec's PrefetchTrainPipelineSparseDist by construction:
* forward(i) waits for the prefetch of batch i itself (an event on the prefetch
  stream), and the inputs the prefetch reads are recorded on the prefetch and
  compute streams: the race of TorchRec PR #4191 (its forward waits on the
  data-dist stream, and nothing orders that stream after the prefetch) cannot
  happen. So the input all-to-all of i+2 needs no fence on the prefetch of i+1:
  such a fence made the next step's host sync on the splits wait for the prefetch
  to finish on the GPU;
* ``forward_stream`` given to FBGEMM is the real compute stream;
* one fill path, so no duplicate prefetch on refill (PR #4503);
* after an evaluation outside the pipeline (``detached()``), the cache-line locks
  the eval forwards took are released (FBGEMM locks on every prefetch, and an eval
  forward has no backward to unlock).
Without cached tables (CPU CI) the prefetch step is a no-op and the schedule is
numerically ``sparse_dist``.

UVM-cached tables are built with FBGEMM's cache-line locking (``prefetch_pipeline``)
when, and only when, a pipeline with a prefetch step (``recpipe.capabilities.PREFETCH_STEP``,
offered here) runs them; the speed features that ask for that step speed it up: its
cache insert is recpipe's by default (``pipeline.cache_fill``,
``recpipe.speedups.cache_fill``), and FBGEMM's backward pre-hook work of batch i runs
on the prefetch stream after prefetch(i+1) (``recpipe.speedups.cache_bookkeeping``).
"""

from __future__ import annotations

from typing import Literal

from recpipe.capabilities import INTERCEPTS, PREFETCH_STEP
from recpipe.runtime.definition import PipelineDef
from recpipe.runtime.options import PipelineKeys
from recpipe.runtime.schedule import Schedule, Step

__all__ = ["EVAL_SCHEDULE", "Options", "PIPELINE", "SCHEDULE"]

SCHEDULE = Schedule(
    "prefetch",
    (
        Step("zero_grad", "compute", 0),
        Step("h2d", "memcpy", 2),
        Step("forward", "compute", 0, waits=(("h2d", 0), ("prefetch", 0))),
        Step("input_dist_wait", "dist", 1),
        Step("prefetch", "prefetch", 1, waits=(("input_dist_wait", 0),)),
        Step("backward", "compute", 0),
        Step("optimizer", "compute", 0),
        Step("input_dist", "dist", 2, waits=(("h2d", 0),)),
    ),
    doc="Prefetch of batch i+1 after forward(i), before backward(i); the host waits for i+1's splits "
        "while the GPU runs forward(i); forward(i+1) waits for the prefetch.",
).validate()

# One prefetch per forward, in order (FBGEMM's forward pops the prefetched cache locations):
# the training order without backward and optimizer. The eval forwards' cache-line locks are
# released when the evaluation ends (after_detached_run).
EVAL_SCHEDULE = Schedule(
    "prefetch_eval",
    (
        Step("h2d", "memcpy", 2),
        Step("forward_eval", "compute", 0, waits=(("h2d", 0), ("prefetch", 0))),
        Step("input_dist_wait", "dist", 1),
        Step("prefetch", "prefetch", 1, waits=(("input_dist_wait", 0),)),
        Step("input_dist", "dist", 2, waits=(("h2d", 0),)),
    ),
    doc="Evaluation: prefetch of batch i+1 after forward(i) is queued; forward(i+1) waits for it.",
).validate()


class Options(PipelineKeys):
    name: Literal["prefetch"]


PIPELINE = PipelineDef("prefetch", Options,
                       "FBGEMM's UVM-cache prefetch of batch i+1 between forward(i) and backward(i)",
                       schedules=(SCHEDULE,), schedule_of=lambda options: SCHEDULE, eval_schedule=EVAL_SCHEDULE,
                       offers=frozenset({INTERCEPTS, PREFETCH_STEP}), engine="recpipe.pipelines.prefetch:PrefetchPipeline",
                       torchrec="PrefetchTrainPipelineSparseDist",
                       torchrec_options=lambda options: ({"execute_all_batches": True}, []))
