"""The engine class of ``fused_sparse_dist`` (its schedules and why:
``recpipe.pipelines.defs.fused_sparse_dist``): picks the schedule the model allows and
refuses the modules it cannot pipeline, when it is built."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from recpipe.errors import PipelineError
from recpipe.runtime import sharded
from recpipe.pipelines.defs import fused_sparse_dist as fused_sparse_dist_def
from recpipe.runtime.engine import Pipeline
from recpipe.runtime.schedule import Schedule

__all__ = ["FusedSparseDistPipeline"]


class FusedSparseDistPipeline(Pipeline):
    definition = fused_sparse_dist_def.PIPELINE

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, *,
                 schedule: Schedule | None = None, **options: Any) -> None:
        modules = sharded.find_sharded_modules(model)
        refused = [fqn for fqn, m in modules.items() if sharded.has_feature_processor(m)]
        if refused:
            raise PipelineError(
                f"fused_sparse_dist cannot pipeline {refused}: they have feature processors, whose dense "
                "parameters would be read before the optimizer steps them. Use pipeline.name=sparse_dist."
            )
        stepped = sharded.dense_optimized_tables(modules, optimizer)
        if schedule is None:
            schedule = fused_sparse_dist_def.SCHEDULE_AFTER_OPTIMIZER if stepped else fused_sparse_dist_def.SCHEDULE
        elif stepped and schedule.steps.index(fused_sparse_dist_def.OPTIMIZER) > schedule.steps.index(fused_sparse_dist_def.LOOKUP):
            raise PipelineError(
                f"schedule {schedule.name} looks up batch i+1 before the dense optimizer step of batch i, but "
                f"{stepped} are updated by the dense optimizer (data_parallel tables)"
            )
        super().__init__(model, optimizer, device, schedule=schedule, **options)
