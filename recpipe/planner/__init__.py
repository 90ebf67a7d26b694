"""Memory planner: per-shard and per-rank HBM / host DDR of a training configuration,
as named terms, without a GPU or a process group (docs/planner.md).

Entry points::

    plan = plan_from_config(cfg)             # RecpipeConfig -> MemoryPlan (recpipe plan, recpipe train)
    inputs = planner_inputs(cfg)             # its PlannerInputs, shards placed as the run places them
    plan = estimate_memory(inputs)           # PlannerInputs -> MemoryPlan (pure)
    msg = check_fits(plan)                   # None, or why it does not fit
    code = preflight(cfg)                    # for `recpipe train`: print summary, 0 or 3
    changes = advise(cfg)                    # what makes a plan that does not fit fit (recpipe.planner.advice)
    rows = predict_scaling(cfg, (1, 2, 4, 8))  # weak-scaling all-to-all / bound model (docs/scaling.md)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recpipe.planner.advice import advice_lines, advise
from recpipe.planner.estimate import estimate_memory
from recpipe.planner.from_config import plan_from_config, planner_inputs
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
    "advise",
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


def preflight(cfg: "RecpipeConfig", *, world_size: int | None = None, log=print) -> int:
    """For ``recpipe train`` before it allocates anything: log the per-rank summary;
    return 0, or ``EXIT_DOES_NOT_FIT`` (3) after logging why the plan does not fit."""
    from recpipe.exit_codes import EXIT_DOES_NOT_FIT

    plan = plan_from_config(cfg, world_size=world_size)
    log(summary(plan))
    problem = check_fits(plan)
    if problem is None:
        return 0
    advice = advise(cfg, plan) if world_size in (None, cfg.distributed.nproc) else []
    log(f"recpipe train: refusing to start, the configuration does not fit in GPU memory:\n{problem}\n"
        f"{advice_lines(advice)}")
    return EXIT_DOES_NOT_FIT
