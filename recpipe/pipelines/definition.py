"""What one pipeline is, for the rest of recpipe: :class:`PipelineDef`.

Each pipeline module ends with ``PIPELINE = PipelineDef(...)``; the registry
(``recpipe.pipelines.registry``) lists them by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from recpipe.pipelines.engine import Pipeline
from recpipe.pipelines.options import PipelineOptions
from recpipe.pipelines.schedule import Schedule, memory_facts

if TYPE_CHECKING:
    from recpipe.config import RecpipeConfig

__all__ = ["PipelineDef", "SPEEDUP_SECTIONS"]


# The ``pipeline`` section's speed features (recpipe.speedups): applied from outside, not engine arguments.
SPEEDUP_SECTIONS = ("compile", "cuda_graphs", "step_graph", "cache_fill")


def _no_rules(cfg: "RecpipeConfig") -> list[str]:
    return []


@dataclass(frozen=True)
class PipelineDef:
    """Everything the rest of recpipe needs to know about one pipeline.

    * ``cls``: its engine class, built as ``cls(model, optimizer, device, **options)``;
    * ``options``: its pydantic options (a :class:`PipelineOptions` subclass whose
      ``name`` is ``Literal[name]``);
    * ``schedules``: every training schedule it may run, the default first (``recpipe schedule
      NAME`` prints them, then ``eval_schedule``, its engine class's evaluation);
    * ``check``: the config rules that concern it (problems, one per line);
    * ``schedule_of``: the schedule a given set of options runs (its memory facts come
      from it, :func:`recpipe.pipelines.schedule.memory_facts`), and ``extra_facts``
      what a schedule cannot say (e.g. semi_sync's stashed gradients);
    * ``torchrec``: TorchRec's class of the same role (``recpipe bench --with-torchrec``)
      and ``torchrec_options`` its keyword arguments for these options, with notes on
      what has no counterpart.
    """

    name: str
    cls: type[Pipeline]
    options: type[PipelineOptions]
    doc: str
    schedules: tuple[Schedule, ...]
    schedule_of: Callable[[Any], Schedule]
    check: Callable[["RecpipeConfig"], list[str]] = _no_rules
    extra_facts: Callable[[Any], dict[str, Any]] = field(default=lambda options: {})
    torchrec: str | None = None
    torchrec_options: Callable[[Any], tuple[dict[str, Any], list[str]]] = field(
        default=lambda options: ({}, []))

    @property
    def eval_schedule(self) -> Schedule | None:
        """The schedule its evaluation runs (its engine class's; ``recpipe.pipelines.evaluation``)."""
        return self.cls.eval_schedule

    def __call__(self, model: Any, optimizer: Any, device: Any, **options: Any) -> Pipeline:
        """``PIPELINES[name](model, optimizer, device, **options)``: the engine, as its class
        builds it (a study passes ``schedule=``; speed features are applied from outside)."""
        return self.cls(model, optimizer, device, **options)

    def memory(self, options: PipelineOptions) -> dict[str, Any]:
        """The planner's facts about this pipeline (``recpipe.planner.spec.PipelineSpec`` fields)."""
        return {"name": self.name, **memory_facts(self.schedule_of(options)), **self.extra_facts(options)}

    def build(self, model: Any, optimizer: Any, device: Any, options: PipelineOptions, **extra: Any) -> Pipeline:
        """The engine for ``options``: the pipeline's own keys and the common ones (the
        speed features' sections are applied from outside, ``recpipe.speedups``)."""
        own = {k: getattr(options, k) for k in type(options).model_fields
               if k not in ("name", "inputs") and k not in SPEEDUP_SECTIONS}
        return self.cls(model, optimizer, device, **own, **extra)

