"""``base``: the plain loop, the numerical reference of every other pipeline.

Only the host-to-device copy of the next batch is overlapped: it is issued before
the forward, as TorchRec's TrainPipelineBase does, so a large batch's copy hides
behind a whole forward and backward (issued after the backward, it hid only behind
the optimizer step and the next forward could wait for it). Input dist, lookup and
output dist run inline in the model's own forward.
"""

from __future__ import annotations

from typing import Literal

from recpipe.capabilities import ONE_BATCH_PER_STEP
from recpipe.runtime.definition import PipelineDef
from recpipe.runtime.options import PipelineKeys
from recpipe.runtime.schedule import Schedule, Step

__all__ = ["EVAL_SCHEDULE", "Options", "PIPELINE", "SCHEDULE"]

SCHEDULE = Schedule(
    "base",
    (
        Step("zero_grad", "compute", 0),
        Step("h2d", "memcpy", 1),
        Step("forward", "compute", 0, waits=(("h2d", 0),)),
        Step("backward", "compute", 0),
        Step("optimizer", "compute", 0),
    ),
    doc="The plain loop: forward, backward, optimizer; the next batch's copy overlaps all three.",
).validate()

# Also the evaluation of every pipeline whose model runs its own sharded forward (a step graph's).
EVAL_SCHEDULE = Schedule(
    "base_eval",
    (
        Step("h2d", "memcpy", 1),
        Step("forward_eval", "compute", 0, waits=(("h2d", 0),)),
    ),
    doc="Evaluation: the next batch's copy overlaps the forward; the model runs its own sharded forward.",
).validate()


class Options(PipelineKeys):
    name: Literal["base"] = "base"


# The model runs its own sharded forward: nothing is intercepted.
PIPELINE = PipelineDef("base", Options, "the plain loop; only the next batch's copy overlaps",
                       schedules=(SCHEDULE,), schedule_of=lambda options: SCHEDULE, eval_schedule=EVAL_SCHEDULE,
                       offers=frozenset({ONE_BATCH_PER_STEP}), engine="recpipe.pipelines.base:BasePipeline",
                       torchrec="TrainPipelineBase")
