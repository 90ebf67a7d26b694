"""Memory planner: per-shard and per-rank HBM / host DDR of a training configuration,
as named terms, without a GPU or a process group (docs/planner.md).

Entry points::

    plan = plan_from_config(cfg)             # RecpipeConfig -> MemoryPlan (recpipe plan, recpipe train)
    inputs = planner_inputs(cfg)             # its PlannerInputs, shards placed as the run places them
    plan = estimate_memory(inputs)           # PlannerInputs -> MemoryPlan (pure)
    msg = check_fits(plan)                   # None, or why it does not fit
    changes = advise(cfg)                    # what makes a plan that does not fit fit (recpipe.planner.advice)
    print(advice_lines(changes))             # as `recpipe plan` and recpipe.preflight.check_memory say them
    rows = predict_scaling(cfg, (1, 2, 4, 8))  # weak-scaling all-to-all / bound model (docs/scaling.md)
"""

from __future__ import annotations

from recpipe.planner.advice import advice_lines, advise
from recpipe.planner.estimate import estimate_memory
from recpipe.planner.from_config import plan_from_config, planner_inputs
from recpipe.planner.plan import MemoryPlan, RankMemory, ShardMemory, Term, check_fits, render_table, summary
from recpipe.planner.scaling import predict_scaling
from recpipe.planner.inputs import inputs_from_config
from recpipe.planner.spec import PlannerInputs

__all__ = [
    "MemoryPlan",
    "PlannerInputs",
    "RankMemory",
    "ShardMemory",
    "Term",
    "advice_lines",
    "advise",
    "check_fits",
    "estimate_memory",
    "inputs_from_config",
    "plan_from_config",
    "planner_inputs",
    "predict_scaling",
    "render_table",
    "summary",
]
