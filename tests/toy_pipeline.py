"""A pipeline added as docs/architecture.md says: this one module (its schedule, its
options, its definition) and one registry line (here ``register(PIPELINE)``, from the
test). It imports nothing heavy (tests/test_registry.py checks it in a fresh process);
the shared engine runs its table."""

from __future__ import annotations

from typing import Literal

from recpipe.runtime.definition import PipelineDef
from recpipe.runtime.options import PipelineKeys
from recpipe.runtime.schedule import Schedule, Step

SCHEDULE = Schedule(
    "copies_ahead",
    (
        Step("h2d", "memcpy", 2),
        Step("zero_grad", "compute", 0),
        Step("forward", "compute", 0, waits=(("h2d", 0),)),
        Step("backward", "compute", 0),
        Step("optimizer", "compute", 0),
    ),
    doc="A plain loop with its copies two batches ahead; the model runs its own sharded forward.",
).validate()


class Options(PipelineKeys):
    name: Literal["copies_ahead"]


PIPELINE = PipelineDef("copies_ahead", Options, "a plain loop, copies two ahead", schedules=(SCHEDULE,),
                       schedule_of=lambda options: SCHEDULE, offers=frozenset())
