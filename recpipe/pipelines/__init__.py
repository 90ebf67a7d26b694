"""recpipe's training pipelines: each a schedule table run by one engine.

``make_pipeline(cfg, model, optimizer, device)`` builds the one named by
``cfg.pipeline.name``; the classes take ``(model, optimizer, device, **options)``
and expose ``progress(dataloader_iter)`` like TorchRec's pipelines.
"""

from __future__ import annotations

import argparse
import warnings

import torch
from torch import nn

from recpipe.config import RecpipeConfig
from recpipe.pipelines.base import BasePipeline
from recpipe.pipelines.engine import Pipeline
from recpipe.pipelines.fused_sparse_dist import FusedSparseDistPipeline
from recpipe.pipelines.prefetch import PrefetchPipeline
from recpipe.pipelines.schedule import Schedule
from recpipe.pipelines.semi_sync import SemiSyncPipeline
from recpipe.pipelines.sharded import PipelineError
from recpipe.pipelines.sparse_dist import SparseDistPipeline

PIPELINES: dict[str, type[Pipeline]] = {
    "base": BasePipeline,
    "sparse_dist": SparseDistPipeline,
    "fused_sparse_dist": FusedSparseDistPipeline,
    "semi_sync": SemiSyncPipeline,
    "prefetch": PrefetchPipeline,
}


def all_schedules() -> dict[str, list[Schedule]]:
    """Every pipeline name -> its schedules (the first is its default)."""
    return {name: list(cls.every_schedule) for name, cls in PIPELINES.items()}


def main_schedule(args: argparse.Namespace) -> int:
    """``recpipe schedule NAME``: print the pipeline's schedule tables."""
    schedules = all_schedules()
    if args.name not in schedules:
        print(f"recpipe schedule: unknown pipeline {args.name!r}; choose one of {', '.join(schedules)}")
        return 2
    print("\n\n".join(s.table() for s in schedules[args.name]))
    return 0


def make_pipeline(
    cfg: RecpipeConfig, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> Pipeline:
    """The pipeline ``cfg.pipeline`` names, its ``inputs`` functions imported."""
    from recpipe.models.factory import load_callable

    options = cfg.pipeline.model_dump(exclude={"name", "inputs"})
    inputs = {fqn: load_callable(spec, f"pipeline.inputs.{fqn}") for fqn, spec in cfg.pipeline.inputs.items()}
    if inputs and not PIPELINES[cfg.pipeline.name].intercepts:
        warnings.warn(f"pipeline.inputs is ignored by pipeline.name={cfg.pipeline.name!r}: the model runs its own forward")
        inputs = {}
    return PIPELINES[cfg.pipeline.name](model, optimizer, device, inputs=inputs, **options)


__all__ = [
    "BasePipeline",
    "FusedSparseDistPipeline",
    "PIPELINES",
    "Pipeline",
    "PipelineError",
    "PrefetchPipeline",
    "SemiSyncPipeline",
    "SparseDistPipeline",
    "all_schedules",
    "main_schedule",
    "make_pipeline",
]
