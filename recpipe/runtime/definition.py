"""What one pipeline is, for the rest of recpipe: :class:`PipelineDef`.

Each pipeline's declaration module (``recpipe/pipelines/defs/``) ends with
``PIPELINE = PipelineDef(...)``; the registry (``recpipe.pipelines.registry``) lists them
by name. A definition is data, and imports nothing heavy: config, preflight, planner,
bench and CLI read it without loading torch. Its engine class is named by dotted path and
imported when a pipeline is built (:meth:`PipelineDef.engine_class`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from recpipe.capabilities import INTERCEPTS
from recpipe.errors import PipelineError
from recpipe.runtime.options import PipelineKeys
from recpipe.runtime.schedule import Schedule, memory_facts

__all__ = ["ENGINE", "PipelineDef"]

# The engine that runs any schedule of the shared steps (recpipe.runtime.steps).
ENGINE = "recpipe.runtime.engine:Pipeline"


def _no_rules(cfg: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class PipelineDef:
    """Everything the rest of recpipe needs to know about one pipeline.

    * ``options``: its pydantic options (a :class:`PipelineKeys` subclass whose ``name``
      is ``Literal[name]``; the config validates them with the speed features' sections,
      ``recpipe.pipeline_options.options_of``);
    * ``schedules``: every training schedule it may run, the default first (``recpipe
      schedule NAME`` prints them, then ``eval_schedule``, its evaluation's; None: the
      copy-only one of ``base``, ``recpipe.pipelines.evaluation``);
    * ``offers``: its capabilities (``recpipe.capabilities``), which speed features ask for;
    * ``engine``: ``"package.module:Class"``, its engine class, imported when a pipeline is
      built: the shared engine (``ENGINE``) runs any schedule of the shared steps; a
      pipeline with steps or build-time checks of its own names its own subclass;
    * ``check``: its config rules (problems, one per line; ``recpipe.preflight`` runs them
      with the ``RecpipeConfig``);
    * ``schedule_of``: the schedule a given set of options runs (its memory facts come
      from it, :func:`recpipe.runtime.schedule.memory_facts`), and ``extra_facts``
      what a schedule cannot say (e.g. semi_sync's stashed gradients);
    * ``torchrec``: TorchRec's class of the same role (``recpipe bench --with-torchrec``)
      and ``torchrec_options`` its keyword arguments for these options, with notes on
      what has no counterpart.
    """

    name: str
    options: type[PipelineKeys]
    doc: str
    schedules: tuple[Schedule, ...]
    schedule_of: Callable[[Any], Schedule]
    eval_schedule: Schedule | None = None
    offers: frozenset[str] = frozenset({INTERCEPTS})
    engine: str = ENGINE
    check: Callable[[Any], list[str]] = _no_rules
    extra_facts: Callable[[Any], dict[str, Any]] = field(default=lambda options: {})
    torchrec: str | None = None
    torchrec_options: Callable[[Any], tuple[dict[str, Any], list[str]]] = field(
        default=lambda options: ({}, []))

    @property
    def intercepts(self) -> bool:
        """Whether its engine hands the sharded modules inputs prepared ahead of forward."""
        return INTERCEPTS in self.offers

    def engine_class(self) -> type:
        """Its engine class (a ``recpipe.runtime.engine.Pipeline``), imported now: torch,
        torchrec and FBGEMM with it."""
        module, _, name = self.engine.partition(":")
        cls = getattr(importlib.import_module(module), name, None)
        if not isinstance(cls, type):
            raise PipelineError(f"pipeline {self.name!r}: its engine {self.engine!r} is not a class")
        return cls

    def __call__(self, model: Any, optimizer: Any, device: Any, **options: Any) -> Any:
        """``PIPELINES[name](model, optimizer, device, **options)``: the engine, as its class
        builds it (a study passes ``schedule=``; speed features are applied from outside,
        ``recpipe.builder``)."""
        return self.engine_class()(model, optimizer, device, definition=self, **options)

    def memory(self, options: Any) -> dict[str, Any]:
        """The planner's facts about this pipeline (``recpipe.planner.spec.PipelineSpec`` fields)."""
        return {"name": self.name, **memory_facts(self.schedule_of(options)), **self.extra_facts(options)}
