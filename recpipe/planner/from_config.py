"""A config's planner inputs and memory plan, with its shards where the run puts them
(re-exported by :mod:`recpipe.planner`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from recpipe.embedding_tables import model_on_meta
from recpipe.planner.estimate import estimate_memory
from recpipe.planner.inputs import inputs_from_config
from recpipe.planner.plan import MemoryPlan
from recpipe.planner.spec import PlannerInputs, shards_from_plan

if TYPE_CHECKING:
    from recpipe.config import RecpipeConfig

__all__ = ["plan_from_config", "planner_inputs"]


def planner_inputs(
    cfg: "RecpipeConfig",
    *,
    world_size: int | None = None,
    hbm_capacity_bytes: int | None = None,
    fbgemm_version: tuple[int, int] | None = None,
) -> PlannerInputs:
    """The :class:`PlannerInputs` of the run ``cfg`` describes (world size:
    ``distributed.nproc`` unless given; capacity: ``sharding.hbm_gib`` or ``hbm_gb``, else the GPU's
    own, else 80 GiB), with its shards where that run puts them: with
    ``sharding.placement: planner`` where torchrec's partitioner puts them on these
    estimates (``recpipe.sharding.build.planner_placement``), else by the config's
    rules. ``recpipe plan`` and ``recpipe train``'s pre-flight plan from these."""
    inputs = inputs_from_config(cfg, world_size=world_size, hbm_capacity_bytes=hbm_capacity_bytes, fbgemm=fbgemm_version)
    if cfg.sharding.placement == "planner":
        # torchrec's partitioner: `recpipe plan` of any other placement imports neither torch nor torchrec
        from recpipe.planner.torchrec_planner import plan_with_torchrec

        plan = plan_with_torchrec(cfg.sharding, cfg.optimizer.embedding, inputs, model_on_meta(cfg))
        inputs = dataclasses.replace(inputs, shards=shards_from_plan(plan, inputs.tables))
    return inputs


def plan_from_config(
    cfg: "RecpipeConfig",
    *,
    world_size: int | None = None,
    hbm_capacity_bytes: int | None = None,
    fbgemm_version: tuple[int, int] | None = None,
) -> MemoryPlan:
    """The memory plan of ``cfg``: :func:`estimate_memory` of :func:`planner_inputs`."""
    return estimate_memory(planner_inputs(cfg, world_size=world_size, hbm_capacity_bytes=hbm_capacity_bytes,
                                          fbgemm_version=fbgemm_version))
