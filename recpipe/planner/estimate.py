"""The memory plan of a training run: :func:`estimate_memory`, a pure function of
:class:`~recpipe.planner.spec.PlannerInputs`. The per-rank terms come from
:mod:`recpipe.planner.memory`; the plan adds what multi-pass prefetch saves against one
pass and what the configured precisions save against fp32
(:mod:`recpipe.planner.precision_savings`)."""

from __future__ import annotations

import dataclasses

from recpipe.planner.memory import estimate_ranks, plan_warnings
from recpipe.planner.plan import MemoryPlan, PrefetchSavings
from recpipe.planner.precision_savings import precision_savings
from recpipe.planner.spec import PlannerInputs

__all__ = ["estimate_memory"]


def estimate_memory(inputs: PlannerInputs) -> MemoryPlan:
    """Per-shard and per-rank HBM/DDR of training ``inputs`` (pure function)."""
    ranks, shards, infos = estimate_ranks(inputs)
    savings: list[PrefetchSavings] = []
    if inputs.pipeline.prefetch and any(i.passes_effective for i in infos):
        one, _, one_infos = estimate_ranks(dataclasses.replace(inputs, prefetch_passes=1))
        for rm, info, rm1, info1 in zip(ranks, infos, one, one_infos):
            if info.passes_effective:
                savings.append(PrefetchSavings(rm.rank, inputs.prefetch_passes, info.passes_effective,
                                               info.prefetch_scratch, info1.prefetch_scratch, rm.hbm_bytes, rm1.hbm_bytes))
    return MemoryPlan(
        ranks=tuple(ranks), shards=tuple(shards), pipeline=inputs.pipeline.name, world_size=inputs.world_size,
        batch_size=inputs.batch_size, fbgemm_version=tuple(inputs.fbgemm_version), prefetch=tuple(savings),
        warnings=tuple(plan_warnings(inputs, ranks, infos)), precision=precision_savings(inputs, ranks),
    )
