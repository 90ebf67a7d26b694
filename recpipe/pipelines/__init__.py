"""recpipe's training pipelines: each a schedule table run by one engine.

``make_pipeline(cfg, model, optimizer, device)`` builds the one named by
``cfg.pipeline.name``; the classes take ``(model, optimizer, device, **options)``
and expose ``progress(dataloader_iter)`` like TorchRec's pipelines.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from recpipe.config import RecpipeConfig
from recpipe.pipelines.base import BasePipeline
from recpipe.pipelines.engine import Pipeline
from recpipe.pipelines.fused_sparse_dist import FusedSparseDistPipeline
from recpipe.pipelines.prefetch import PrefetchPipeline
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
    "make_pipeline",
]
