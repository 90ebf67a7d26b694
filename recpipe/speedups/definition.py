"""What one speed feature is, for the rest of recpipe: :class:`SpeedupDef`.

A speed feature speeds up a built pipeline and its model from outside the engine (a
compiled or CUDA-graphed dense part, a whole-step graph, recpipe's UVM-cache insert).
Each declares, in a module of ``recpipe/speedups/defs/`` that imports nothing heavy:

* ``options``: its section of the ``pipeline`` config (a :class:`~recpipe.sections.SwitchSection`:
  its ``enabled`` switches it, and ``true`` / ``false`` stand for ``{enabled: ...}``), a key
  of every pipeline's options; None for a feature that is always on where it can be;
* ``needs``: the capabilities (``recpipe.capabilities``) a pipeline must offer for it, and
  what happens where one does not (``missing``: ``"refuse"``, a config error naming the
  pipelines that offer them, or ``"skip"``: nothing to speed up there, and a warning if
  its section was written in the config);
* ``key``: for a feature without a section, the common key of the ``pipeline`` section
  (``recpipe.runtime.options.PipelineKeys``) whose value ``apply`` is given in its place
  (``pipeline.splits_exchange``);
* ``needs_cuda``: refused on a run without a CUDA device;
* ``check``: its config rules beyond those (one line per problem, naming the keys);
* ``plan_facts``: what the memory planner needs to know of it where it is on and the
  pipeline offers what it needs: ``plan_facts(section) -> {field: value}``, fields of
  ``recpipe.planner.spec.PipelineSpec`` (a pure function of its section: ``recpipe plan``
  imports no torch);
* ``torchrec_note``: for the bench's TorchRec rows, what TorchRec's pipeline does in its
  place where it is on (a note on each such row; None: nothing to note);
* ``torchrec_run``: one more TorchRec run the bench adds where it is on (``recpipe.bench.run``
  builds it by this name; None: none);
* ``apply``: ``"package.module:function"``, ``function(ctx, options) -> handle | None``
  with ``ctx`` the pipeline's :class:`~recpipe.runtime.engine.StepContext`; it installs
  itself through ``ctx.wrap_step``, ``ctx.replace_schedule`` or an instance attribute of
  the model or optimizer and returns a printable handle with ``remove()`` (None: nothing
  installed). It is imported when a pipeline is built, so it may import torch.

The registry (``recpipe.speedups.registry.SPEEDUPS``) lists them in the order the builder
(``recpipe.builder.make_pipeline``) applies them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from recpipe.errors import job_warning
from recpipe.sections import Section

__all__ = ["SpeedupDef"]


def _no_rules(cfg: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class SpeedupDef:
    """One speed feature (see the module docstring). ``name`` is its ``pipeline`` section's key."""

    name: str
    options: type[Section] | None
    doc: str
    apply: str
    needs: frozenset[str] = frozenset()
    missing: Literal["refuse", "skip"] = "refuse"
    needs_cuda: bool = False
    check: Callable[[Any], list[str]] = field(default=_no_rules)
    key: str | None = None
    plan_facts: Callable[[Any], dict[str, Any]] | None = None
    torchrec_note: str | None = None
    torchrec_run: str | None = None

    def __post_init__(self) -> None:
        if self.key is not None and self.options is not None:
            raise ValueError(f"speed feature {self.name!r}: a section (options) or a common key (key), not both")

    def section(self, pipeline_options: Any) -> Section | None:
        """Its options in a ``pipeline`` section: its section, the value of its ``key``, or None."""
        if self.key is not None:
            return getattr(pipeline_options, self.key)
        return None if self.options is None else getattr(pipeline_options, self.name)

    def enabled(self, pipeline_options: Any) -> bool:
        """Whether the ``pipeline`` section asks for it (a feature without a section: always;
        one given a common key decides in its ``apply``)."""
        if self.options is None:
            return True
        return bool(self.section(pipeline_options).enabled)

    def written(self, pipeline_options: Any) -> bool:
        """Whether the config sets its section (not just its default)."""
        return self.options is not None and self.name in pipeline_options.model_fields_set

    def lacking(self, offers: frozenset[str]) -> list[str]:
        """The capabilities it needs that ``offers`` does not hold, in a fixed order."""
        return sorted(self.needs - offers)

    def skipped(self, pipeline_options: Any, pipeline: str) -> None:
        """Warn that its written section is ignored: ``pipeline`` offers nothing for it to speed up."""
        if self.written(pipeline_options) and self.enabled(pipeline_options):
            job_warning(f"pipeline.{self.name} is ignored: pipeline.name={pipeline!r} offers no "
                          f"{', '.join(sorted(self.needs))}", stacklevel=3)
