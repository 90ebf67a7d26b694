"""A speed feature added as docs/architecture.md says: this one declaration module (its
options section, the capability it needs, its ``apply``) and one registry line (here
``register(FEATURE)`` from the test). Its ``apply``
needs nothing heavy, so it lives here too. It counts the optimizer steps it wraps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from recpipe.capabilities import ONE_BATCH_PER_STEP
from recpipe.sections import SwitchSection
from recpipe.speedups.definition import SpeedupDef


class StepCounterOptions(SwitchSection):
    """``pipeline.step_counter``: count the optimizer steps. ``true`` / ``false`` stand for ``{enabled: ...}``."""

    # Count them.
    enabled: bool = False


@dataclass
class StepCounter:
    """What :func:`apply` installed: the count so far."""

    steps: int = 0

    def __repr__(self) -> str:
        return f"step counter: {self.steps} optimizer steps"

    def remove(self) -> None:
        """A wrapped step stays for the pipeline's life; counting is all it does."""


def apply(ctx: Any, options: StepCounterOptions) -> StepCounter:
    counter = StepCounter()

    def counting(step: Any) -> Any:
        def optimizer(ctx: Any, batch: Any) -> None:
            step(ctx, batch)
            counter.steps += 1

        return optimizer

    ctx.wrap_step("optimizer", counting)
    return counter


FEATURE = SpeedupDef("step_counter", StepCounterOptions, "count the optimizer steps (tests/toy_speedup.py)",
                     apply="toy_speedup:apply", needs=frozenset({ONE_BATCH_PER_STEP}))
