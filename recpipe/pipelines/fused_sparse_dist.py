"""``fused_sparse_dist``: the lookup of batch i+1 starts as soon as batch i's TBE
backward has updated the tables, overlapping the dense optimizer step.

The fused TBE backward applies the embedding optimizer in place, so once it is
done the lookup (TBE forward + output all-to-all) of i+1 reads exactly the weights
``sparse_dist`` would read: bit-identical numerics. The lookup stream is fenced on
an event recorded after backward(i) — TorchRec 1.8 does not fence here, so its
lookup on a side stream can race the update (see the reference notes, PR #4497).
Two schedules: the lookup before the dense optimizer (default) or after it. The
lookup runs on the compute stream by default (``emb_lookup_stream='current'``:
stream order is then the fence, and its outputs stay in the compute stream's
allocator pool), on the input-dist stream, or on a stream of its own.
Modules with feature processors are refused: their output depends on dense
parameters the optimizer has not stepped yet (TorchRec PR #2916).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from recpipe.pipelines import sharded
from recpipe.pipelines.engine import Pipeline
from recpipe.pipelines.schedule import Schedule, Step

_HEAD = (
    Step("zero_grad", "compute", 0),
    Step("input_dist", "dist", 1, waits=(("h2d", 0),)),
    Step("h2d", "memcpy", 2),
    Step("forward", "compute", 0, waits=(("h2d", 0), ("lookup", 0))),
    Step("input_dist_wait", "dist", 1),
    Step("backward", "compute", 0),
)
# Fenced on the previous batch's backward: the TBE update it applies must land first.
_LOOKUP = Step("lookup", "lookup", 1, waits=(("input_dist_wait", 0), ("backward", -1)))
_OPTIMIZER = Step("optimizer", "compute", 0)

SCHEDULE = Schedule(
    "fused_sparse_dist",
    (*_HEAD, _LOOKUP, _OPTIMIZER),
    doc="Lookup of batch i+1 right after backward(i), beside the dense optimizer step of batch i.",
).validate()

SCHEDULE_AFTER_OPTIMIZER = Schedule(
    "fused_sparse_dist_lookup_after_optimizer",
    (*_HEAD, _OPTIMIZER, _LOOKUP),
    doc="Variant: lookup of batch i+1 issued after the dense optimizer step of batch i.",
).validate()


class FusedSparseDistPipeline(Pipeline):
    name = "fused_sparse_dist"
    schedule = SCHEDULE
    every_schedule = (SCHEDULE, SCHEDULE_AFTER_OPTIMIZER)  # the default first, then the variants options pick

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        *,
        emb_lookup_stream: str = "current",
        emb_lookup: str = "before_optimizer",
        **options: Any,
    ) -> None:
        streams = {"data_dist": "dist", "new": "new", "current": "compute"}
        if emb_lookup_stream not in streams:
            raise ValueError(f"emb_lookup_stream={emb_lookup_stream!r}: choose one of {sorted(streams)}")
        schedules = {"before_optimizer": SCHEDULE, "after_optimizer": SCHEDULE_AFTER_OPTIMIZER}
        if emb_lookup not in schedules:
            raise ValueError(f"emb_lookup={emb_lookup!r}: choose one of {sorted(schedules)}")
        self.lookup_stream = streams[emb_lookup_stream]
        self.schedule = schedules[emb_lookup]
        refused = [fqn for fqn, m in sharded.find_sharded_modules(model).items() if sharded.has_feature_processor(m)]
        if refused:
            raise sharded.PipelineError(
                f"fused_sparse_dist cannot pipeline {refused}: they have feature processors, whose dense "
                "parameters would be read before the optimizer steps them. Use pipeline.name=sparse_dist."
            )
        stepped = sharded.dense_optimized_tables(sharded.find_sharded_modules(model), optimizer)
        if stepped and emb_lookup == "before_optimizer":
            raise sharded.PipelineError(
                f"fused_sparse_dist looks up batch i+1 before the dense optimizer step of batch i, but {stepped} "
                "are updated by the dense optimizer (data_parallel tables); set pipeline.emb_lookup=after_optimizer "
                "or shard those tables with a fused kernel"
            )
        super().__init__(model, optimizer, device, **options)
