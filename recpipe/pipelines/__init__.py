"""recpipe's training pipelines: each a schedule table run by one engine.

What each pipeline is (its schedules, options, rules, capabilities) is declared in
``recpipe.pipelines.defs`` and listed by the registry (``PIPELINES``), which imports
nothing heavy; its engine class (``Pipeline`` and its subclasses, ``recpipe.runtime.engine``)
loads when a pipeline is built. ``recpipe.builder.make_pipeline(cfg, model, optimizer,
device)`` builds the one ``cfg.pipeline.name`` names and applies the speed features its
config asks for (``recpipe.speedups``); the classes take ``(model, optimizer, device,
**options)`` and expose ``progress(dataloader_iter)`` like TorchRec's pipelines.

The names below are loaded on first use, so that importing one building block
(``recpipe.pipelines.registry``, ...) does not import every pipeline; the builder
(``recpipe.builder``) sits above this package and the speed features.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "BasePipeline": "recpipe.pipelines.base",
    "FusedSparseDistPipeline": "recpipe.pipelines.fused_sparse_dist",
    "PrefetchPipeline": "recpipe.pipelines.prefetch",
    "SemiSyncPipeline": "recpipe.pipelines.semi_sync",
    "SparseDistPipeline": "recpipe.pipelines.sparse_dist",
    "Pipeline": "recpipe.runtime.engine",
    "StepContext": "recpipe.runtime.context",
    "PipelineDef": "recpipe.runtime.definition",
    "PipelineError": "recpipe.errors",
    "PIPELINES": "recpipe.pipelines.registry",
    "all_schedules": "recpipe.pipelines.registry",
    "main_schedule": "recpipe.pipelines.registry",
    "register": "recpipe.pipelines.registry",
    "unregister": "recpipe.pipelines.registry",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from recpipe.errors import PipelineError
    from recpipe.pipelines.base import BasePipeline
    from recpipe.runtime.context import StepContext
    from recpipe.runtime.definition import PipelineDef
    from recpipe.runtime.engine import Pipeline
    from recpipe.pipelines.fused_sparse_dist import FusedSparseDistPipeline
    from recpipe.pipelines.prefetch import PrefetchPipeline
    from recpipe.pipelines.registry import PIPELINES, all_schedules, main_schedule, register, unregister
    from recpipe.pipelines.semi_sync import SemiSyncPipeline
    from recpipe.pipelines.sparse_dist import SparseDistPipeline


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'recpipe.pipelines' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
