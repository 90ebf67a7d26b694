"""``sparse_dist``: input all-to-all of batch i+1 overlaps the step of batch i.

Three batches in flight: i trains on the compute stream, i+1 is in its input
all-to-all on the dist stream, i+2 is copied on the memcpy stream. The splits
all-to-all of i+1 starts before forward(i) is queued; the host waits on the
splits (``.tolist()``) only after forward(i) is queued, so the GPU is busy while
the host blocks. Numerically identical to ``base``: only where work runs changes.
"""

from __future__ import annotations

from typing import Any, Literal

from recpipe.capabilities import INTERCEPTS, ONE_BATCH_PER_STEP
from recpipe.runtime.definition import PipelineDef
from recpipe.runtime.options import PipelineKeys
from recpipe.runtime.schedule import Schedule, Step

__all__ = ["EVAL_SCHEDULE", "Options", "PIPELINE", "SCHEDULE"]

SCHEDULE = Schedule(
    "sparse_dist",
    (
        Step("zero_grad", "compute", 0),
        Step("input_dist", "dist", 1, waits=(("h2d", 0),)),
        Step("h2d", "memcpy", 2),
        Step("forward", "compute", 0, waits=(("h2d", 0),)),
        Step("input_dist_wait", "dist", 1),
        Step("backward", "compute", 0),
        Step("optimizer", "compute", 0),
    ),
    doc="TorchRec's TrainPipelineSparseDist order, with per-batch events instead of whole-stream waits.",
).validate()

EVAL_SCHEDULE = Schedule(
    "sparse_dist_eval",
    (
        Step("input_dist", "dist", 1, waits=(("h2d", 0),)),
        Step("h2d", "memcpy", 2),
        Step("forward_eval", "compute", 0, waits=(("h2d", 0),)),
        Step("input_dist_wait", "dist", 1),
    ),
    doc="Evaluation: the training order without backward and optimizer (TorchRec's EvalPipelineSparseDist).",
).validate()


class Options(PipelineKeys):
    name: Literal["sparse_dist"]


def _torchrec_options(options: Any) -> tuple[dict[str, Any], list[str]]:
    return {"execute_all_batches": True}, []


PIPELINE = PipelineDef("sparse_dist", Options, "the input all-to-all of batch i+1 overlaps the step of batch i",
                       schedules=(SCHEDULE,), schedule_of=lambda options: SCHEDULE, eval_schedule=EVAL_SCHEDULE,
                       offers=frozenset({INTERCEPTS, ONE_BATCH_PER_STEP}),
                       engine="recpipe.pipelines.sparse_dist:SparseDistPipeline",
                       torchrec="TrainPipelineSparseDist", torchrec_options=_torchrec_options)
