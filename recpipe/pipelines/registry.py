"""The pipelines recpipe knows, by name: one :class:`PipelineDef` each.

A pipeline module (``base.py``, ``sparse_dist.py``, ...) defines its schedule(s), its
``Options`` (the pipeline's keys of the ``pipeline`` config section, with their
defaults and allowed values), ``check(cfg)`` (the config rules that concern it), its
engine class, and ``PIPELINE``: the :class:`PipelineDef` that ties them together.
Config (the ``pipeline`` section's variants), the planner (memory facts), the bench
(TorchRec's counterpart) and the CLI (``recpipe schedule``, help texts) read this
registry and nothing else. Adding a pipeline is one file and one line in
:data:`PIPELINES` (or :func:`register` at run time).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from recpipe.callables import load_callable
from recpipe.errors import PipelineError, job_warning
from recpipe.pipelines import base, fused_sparse_dist, prefetch, semi_sync, sparse_dist
from recpipe.pipelines.definition import PipelineDef
from recpipe.pipelines.engine import Pipeline
from recpipe.pipelines.schedule import Schedule
from recpipe.speedups import apply_speedups

if TYPE_CHECKING:
    from recpipe.config import RecpipeConfig

__all__ = ["PIPELINES", "PipelineDef", "all_schedules", "main_schedule", "make_pipeline", "register", "unregister"]

PIPELINES: dict[str, PipelineDef] = {
    d.name: d for d in (base.PIPELINE, sparse_dist.PIPELINE, fused_sparse_dist.PIPELINE, semi_sync.PIPELINE,
                        prefetch.PIPELINE)
}


def register(definition: PipelineDef) -> PipelineDef:
    """Add a pipeline (a trainer script's own, a test's): config, planner, bench and CLI
    know it from then on."""
    if definition.name in PIPELINES:
        raise ValueError(f"a pipeline named {definition.name!r} is already registered")
    if "name" not in definition.options.model_fields:
        raise ValueError(f"{definition.options.__name__} has no 'name' field")
    PIPELINES[definition.name] = definition
    return definition


def unregister(name: str) -> None:
    PIPELINES.pop(name, None)


def all_schedules() -> dict[str, list[Schedule]]:
    """Every pipeline name -> its schedules (the first is its default)."""
    return {name: list(d.schedules) for name, d in PIPELINES.items()}


def main_schedule(args: argparse.Namespace) -> int:
    """``recpipe schedule NAME``: print the pipeline's schedule tables, its evaluation's last
    (``all``: every pipeline's)."""
    schedules = all_schedules()
    if args.name != "all" and args.name not in schedules:
        print(f"recpipe schedule: unknown pipeline {args.name!r}; choose one of {', '.join(schedules)} (or all)")
        return 2
    names = list(schedules) if args.name == "all" else [args.name]
    tables = [s for name in names for s in [*schedules[name], PIPELINES[name].eval_schedule] if s is not None]
    print("\n\n".join(s.table() for s in tables))
    return 0


def make_pipeline(
    cfg: "RecpipeConfig", model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
    cls: type | None = None,
) -> Pipeline:
    """The pipeline ``cfg.pipeline`` names, its ``inputs`` functions imported, with the
    speed features of ``cfg.pipeline`` applied to it and to ``model``. ``cls``: a
    subclass of that pipeline's class (a trainer script's hooks), built in its place."""
    options = cfg.pipeline
    definition = PIPELINES[options.name]
    if cls is not None:
        if not (isinstance(cls, type) and issubclass(cls, definition.cls)):
            raise PipelineError(f"make_pipeline(cls={cls!r}): not a subclass of {definition.cls.__name__}, the class "
                                f"of pipeline.name={options.name!r}")
        definition = dataclasses.replace(definition, cls=cls)
    inputs = {fqn: load_callable(spec, f"pipeline.inputs.{fqn}") for fqn, spec in options.inputs.items()}
    if inputs and not definition.cls.intercepts:
        job_warning(f"pipeline.inputs is ignored by pipeline.name={options.name!r}: the model runs its own forward")
        inputs = {}
    pipeline = definition.build(model, optimizer, device, options, inputs=inputs)
    pipeline.applied = apply_speedups(pipeline, options, model, optimizer, device)
    return pipeline
