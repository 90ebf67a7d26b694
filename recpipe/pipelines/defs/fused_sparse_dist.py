"""``fused_sparse_dist``: the lookup of batch i+1 starts as soon as batch i's TBE
backward has updated the tables, overlapping the dense optimizer step.

The fused TBE backward applies the embedding optimizer in place, so once it is
done the lookup (TBE forward + output all-to-all) of i+1 reads exactly the weights
``sparse_dist`` would read: bit-identical numerics. The lookup runs on the compute
stream, right after backward(i) in stream order — TorchRec 1.8 runs it on a side
stream without a fence, where it can race the update (see the reference notes, PR
#4497). On the compute stream its outputs also stay in the compute stream's allocator
pool, which steps faster and reserves less memory than on the input-dist stream
(TorchRec's ``data_dist``; docs/pipelines.md, "Cross-stream hand-offs"); the bench gives
TorchRec's pipeline the same stream.

The lookup comes before the dense optimizer step of batch i, unless the dense
optimizer updates embedding tables (``data_parallel`` tables): then the lookup waits
for that step (``SCHEDULE_AFTER_OPTIMIZER``). Modules with feature processors are
refused: their output depends on dense parameters the optimizer has not stepped yet
(TorchRec PR #2916).
"""

from __future__ import annotations

from typing import Any, Literal

from recpipe.capabilities import INTERCEPTS
from recpipe.runtime.definition import PipelineDef
from recpipe.runtime.options import PipelineKeys
from recpipe.runtime.schedule import Schedule, Step

__all__ = ["EVAL_SCHEDULE", "LOOKUP", "OPTIMIZER", "Options", "PIPELINE", "SCHEDULE", "SCHEDULE_AFTER_OPTIMIZER"]

_HEAD = (
    Step("zero_grad", "compute", 0),
    Step("input_dist", "dist", 1, waits=(("h2d", 0),)),
    Step("h2d", "memcpy", 2),
    Step("forward", "compute", 0, waits=(("h2d", 0), ("lookup", 0))),
    Step("input_dist_wait", "dist", 1),
    Step("backward", "compute", 0),
)
# Fenced on the previous batch's backward: the TBE update it applies must land first (on the
# compute stream, stream order is that fence; a schedule with the lookup on another stream needs it).
LOOKUP = Step("lookup", "compute", 1, waits=(("input_dist_wait", 0), ("backward", -1)))
OPTIMIZER = Step("optimizer", "compute", 0)

SCHEDULE = Schedule(
    "fused_sparse_dist",
    (*_HEAD, LOOKUP, OPTIMIZER),
    doc="Lookup of batch i+1 right after backward(i), beside the dense optimizer step of batch i.",
).validate()

SCHEDULE_AFTER_OPTIMIZER = Schedule(
    "fused_sparse_dist_lookup_after_optimizer",
    (*_HEAD, OPTIMIZER, LOOKUP),
    doc="With data_parallel tables (the dense optimizer updates them): lookup of batch i+1 after optimizer(i).",
).validate()

# No update to wait for in an evaluation: the lookup of batch i+1 right after forward(i), on the
# compute stream as in training.
EVAL_SCHEDULE = Schedule(
    "fused_sparse_dist_eval",
    (
        Step("input_dist", "dist", 1, waits=(("h2d", 0),)),
        Step("h2d", "memcpy", 2),
        Step("forward_eval", "compute", 0, waits=(("h2d", 0), ("lookup", 0))),
        Step("input_dist_wait", "dist", 1),
        Step("lookup", "compute", 1, waits=(("input_dist_wait", 0),)),
    ),
    doc="Evaluation: the lookup of batch i+1 right after forward(i).",
).validate()


class Options(PipelineKeys):
    name: Literal["fused_sparse_dist"]


def _torchrec_options(options: Any) -> tuple[dict[str, Any], list[str]]:
    return {"execute_all_batches": True, "emb_lookup_stream": "current"}, []


PIPELINE = PipelineDef("fused_sparse_dist", Options,
                       "the lookup of batch i+1 right after backward(i), beside the dense optimizer",
                       schedules=(SCHEDULE, SCHEDULE_AFTER_OPTIMIZER), schedule_of=lambda options: SCHEDULE,
                       eval_schedule=EVAL_SCHEDULE, offers=frozenset({INTERCEPTS}),
                       engine="recpipe.pipelines.fused_sparse_dist:FusedSparseDistPipeline",
                       torchrec="TrainPipelineFusedSparseDist", torchrec_options=_torchrec_options)
