"""Memory planner: per-shard and per-rank HBM / host DDR of a training configuration,
as named terms, without a GPU or a process group (docs/planner.md).

Entry points::

    plan = plan_from_config(cfg)             # RecpipeConfig -> MemoryPlan (recpipe plan, recpipe train)
    inputs = planner_inputs(cfg)             # its PlannerInputs, shards placed as the run places them
    plan = estimate_memory(inputs)           # PlannerInputs -> MemoryPlan (pure)
    msg = check_fits(plan)                   # None, or why it does not fit
    code = preflight(cfg)                    # for `recpipe train`: print summary, 0 or 3
    rows = predict_scaling(cfg, (1, 2, 4, 8))  # weak-scaling all-to-all / bound model (docs/scaling.md)
"""

from __future__ import annotations

import dataclasses

from typing import TYPE_CHECKING

from recpipe.planner.estimate import estimate_memory
from recpipe.planner.plan import MemoryPlan, RankMemory, ShardMemory, Term, check_fits, render_table, summary
from recpipe.planner.scaling import predict_scaling
from recpipe.planner.inputs import inputs_from_config
from recpipe.planner.spec import PlannerInputs

if TYPE_CHECKING:
    from recpipe.config import RecpipeConfig

__all__ = [
    "MemoryPlan",
    "PlannerInputs",
    "RankMemory",
    "ShardMemory",
    "Term",
    "check_fits",
    "estimate_memory",
    "inputs_from_config",
    "plan_from_config",
    "planner_inputs",
    "predict_scaling",
    "preflight",
    "render_table",
    "summary",
]


def planner_inputs(
    cfg: "RecpipeConfig",
    *,
    world_size: int | None = None,
    hbm_capacity_bytes: int | None = None,
    fbgemm_version: tuple[int, int] | None = None,
) -> PlannerInputs:
    """The :class:`PlannerInputs` of the run ``cfg`` describes (world size:
    ``distributed.nproc`` unless given; capacity: ``sharding.hbm_gb``, else the GPU's
    own, else 80 GiB), with its shards where that run puts them: with
    ``sharding.placement: planner`` where torchrec's partitioner puts them on these
    estimates (``recpipe.sharding.build.planner_placement``), else by the config's
    rules. ``recpipe plan`` and ``recpipe train``'s pre-flight plan from these."""
    inputs = inputs_from_config(cfg, world_size=world_size, hbm_capacity_bytes=hbm_capacity_bytes, fbgemm=fbgemm_version)
    if cfg.sharding.placement == "planner":
        from recpipe.planner.estimator import plan_with_torchrec
        from recpipe.planner.spec import shards_from_plan

        inputs = dataclasses.replace(inputs, shards=shards_from_plan(plan_with_torchrec(cfg, inputs), inputs.tables))
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


def preflight(cfg: "RecpipeConfig", *, world_size: int | None = None, log=print) -> int:
    """For ``recpipe train`` before it allocates anything: log the per-rank summary;
    return 0, or ``EXIT_DOES_NOT_FIT`` (3) after logging why the plan does not fit."""
    from recpipe.exit_codes import EXIT_DOES_NOT_FIT

    plan = plan_from_config(cfg, world_size=world_size)
    log(summary(plan))
    problem = check_fits(plan)
    if problem is None:
        return 0
    log(f"recpipe train: refusing to start, the configuration does not fit in GPU memory:\n{problem}")
    return EXIT_DOES_NOT_FIT
