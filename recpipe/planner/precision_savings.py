"""What the configured precisions save: the plan against the same inputs with
every table, cache and comm precision fp32 (``MemoryPlan.precision``, the
"precision" section of ``recpipe plan``).

Precision enters the estimate in these terms (everything else is fp32 or integer
whatever the configuration):

* ``emb_weights``, ``emb_weights_uvm``, ``dp_emb_*``: the TBE's weights, in its
  tables' ``weights_precision`` (torchrec: the table config's ``data_type``);
* ``uvm_cache_weights``: the cache rows, in ``cache_precision`` (default: weights');
* optimizer state stays fp32 (FBGEMM takes state dtypes only for optimizers recpipe
  does not offer), the TBE outputs (``pooled_lookup``) stay fp32 (``output_dtype``);
* the output all-to-all and its gradient move ``sharding.comm_precision`` bytes per
  value (:func:`recpipe.planner.scaling.a2a_bytes`), and quantized gradients add
  the ``backward_output_dist`` phase (:func:`recpipe.planner.memory.quantized_output_grad_bytes`).
"""

from __future__ import annotations

import dataclasses

from recpipe.planner.memory import estimate_ranks
from recpipe.planner.plan import PrecisionSavings, RankMemory
from recpipe.planner.scaling import a2a_bytes
from recpipe.planner.spec import PlannerInputs


def all_fp32(inputs: PlannerInputs) -> PlannerInputs:
    """``inputs`` with every table, cache and comm precision fp32."""
    tables = tuple(dataclasses.replace(t, weights_precision="fp32", cache_precision=None, stochastic_rounding=None)
                   for t in inputs.tables)
    return dataclasses.replace(inputs, tables=tables, comm_precision=("fp32", "fp32"))


def precision_savings(inputs: PlannerInputs, ranks: list[RankMemory]) -> tuple[PrecisionSavings, ...]:
    """Per rank, the plan at the configured precisions against all fp32 (empty when
    everything is fp32 already)."""
    fp32 = all_fp32(inputs)
    if fp32 == inputs:
        return ()
    base, _, _ = estimate_ranks(fp32)
    a2a, a2a_fp32 = a2a_bytes(inputs), a2a_bytes(fp32)
    tables = ("emb_weights", "uvm_cache_weights")

    def out_bytes(per: dict, r: int) -> int:
        return int(sum(max(per[k][r]) for k in ("output_a2a", "backward_a2a")))

    return tuple(
        PrecisionSavings(
            rank=rm.rank, hbm_bytes=rm.hbm_bytes, hbm_bytes_fp32=rb.hbm_bytes, ddr_bytes=rm.ddr_bytes,
            ddr_bytes_fp32=rb.ddr_bytes, table_hbm_bytes=sum(rm.term(n) for n in tables),
            table_hbm_bytes_fp32=sum(rb.term(n) for n in tables), output_a2a_bytes=out_bytes(a2a, rm.rank),
            output_a2a_bytes_fp32=out_bytes(a2a_fp32, rm.rank),
        )
        for rm, rb in zip(ranks, base)
    )
