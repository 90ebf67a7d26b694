"""The engine class of ``base``, the plain loop (its schedule: ``recpipe.pipelines.defs.base``):
the shared engine, which trainer scripts subclass as ``BasePipeline``."""

from __future__ import annotations

from recpipe.pipelines.defs import base as base_def
from recpipe.runtime.engine import Pipeline

__all__ = ["BasePipeline"]


class BasePipeline(Pipeline):
    definition = base_def.PIPELINE
