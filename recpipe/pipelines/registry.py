"""The pipelines recpipe knows, by name: one :class:`PipelineDef` each.

A pipeline's declaration module (``recpipe/pipelines/defs/base.py``, ...) defines its
schedule(s), its ``Options`` (the pipeline's keys of the ``pipeline`` config section,
with their defaults and allowed values), its config rules, its memory facts and
``PIPELINE``: the :class:`PipelineDef` that ties them together and names its engine
class. Config (the ``pipeline`` section's variants), preflight (the rules), the planner
(memory facts), the bench (TorchRec's counterpart) and the CLI (``recpipe schedule``,
help texts) read this registry and nothing else; nothing here imports torch. Adding a
pipeline is one declaration module and one line in :data:`PIPELINES` (or
:func:`register` at run time); docs/architecture.md has the recipe.
"""

from __future__ import annotations

import argparse

from recpipe.runtime.definition import PipelineDef
from recpipe.pipelines.defs import base, fused_sparse_dist, prefetch, semi_sync, sparse_dist
from recpipe.runtime.schedule import Schedule

__all__ = ["PIPELINES", "PipelineDef", "all_schedules", "main_schedule", "offering", "register", "unregister"]

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


def offering(capabilities: frozenset[str]) -> list[str]:
    """The pipelines that offer every one of ``capabilities``, by name."""
    return [name for name, d in PIPELINES.items() if capabilities <= d.offers]


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
