"""``base``: the plain loop, the numerical reference of every other pipeline.

Only the host-to-device copy of the next batch is overlapped (issued after the
backward, so it runs beside the optimizer and the next forward). Input dist,
lookup and output dist run inline in the model's own forward.
"""

from __future__ import annotations

from recpipe.pipelines.engine import Pipeline
from recpipe.pipelines.schedule import Schedule, Step

SCHEDULE = Schedule(
    "base",
    (
        Step("zero_grad", "compute", 0),
        Step("forward", "compute", 0, waits=(("h2d", 0),)),
        Step("backward", "compute", 0),
        Step("h2d", "memcpy", 1),
        Step("optimizer", "compute", 0),
    ),
    doc="The plain loop: forward, backward, optimizer; the next batch's copy overlaps the optimizer.",
).validate()


class BasePipeline(Pipeline):
    name = "base"
    schedule = SCHEDULE
    intercepts = False
