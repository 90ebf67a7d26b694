"""The engine class of ``sparse_dist`` (its schedule: ``recpipe.pipelines.defs.sparse_dist``):
the shared engine, which trainer scripts subclass as ``SparseDistPipeline``."""

from __future__ import annotations

from recpipe.pipelines.defs import sparse_dist as sparse_dist_def
from recpipe.runtime.engine import Pipeline

__all__ = ["SparseDistPipeline"]


class SparseDistPipeline(Pipeline):
    definition = sparse_dist_def.PIPELINE
