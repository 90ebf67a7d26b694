"""The floor of a step: what no pipeline removes, measured on the same ranks in the same run.

``floor_ms = compute_ms + comm_ms``:

* ``compute_ms``: the step's device time outside NCCL's kernels (the union of the other
  kernels of the profiled steps, the slowest rank's): the lookups, the dense part, the
  optimizers, whatever the schedule;
* ``comm_ms``: the step's collectives at their real sizes, each timed alone on the same
  ranks after the rows (:func:`time_collectives`): the input all-to-all of the ids, the
  pooled embeddings' all-to-all forward and its gradients' backward (with the row-wise
  reduce-scatter's bytes), and the dense gradients' all-reduce. Sizes per rank are the
  planner's (:func:`recpipe.planner.scaling.a2a_bytes`: the bytes that cross the link, per
  table and sharding type); every rank sends the busiest rank's bytes, split evenly over
  its peers, in as many calls as the step makes of that collective.

``x floor = P50 / floor``: 1.0 is a step whose collectives neither overlap the compute
nor wait for each other; a pipeline that overlaps them can go below it. On one rank
there is nothing to exchange: the floor is the compute. The floor needs the profile
(``--trace-steps``) and CUDA.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from recpipe.bench.measure import percentile
from recpipe.config import RecpipeConfig
from recpipe.planner.inputs import inputs_from_config
from recpipe.planner.scaling import a2a_bytes, collective_calls

__all__ = ["COLLECTIVES", "fill_floor", "floor_md", "time_collectives"]

# the planner's collectives, as the bench reports them
COLLECTIVES = {"input_a2a": "input all-to-all", "output_a2a": "pooled all-to-all forward",
               "backward_a2a": "pooled all-to-all backward", "allreduce": "dense all-reduce"}


def _sizes(cfg: RecpipeConfig, world: int) -> dict[str, tuple[int, int]]:
    """Each collective's (bytes per rank, calls per step): the busiest rank's bytes."""
    inputs = inputs_from_config(cfg, world_size=world)
    calls = collective_calls(inputs)
    return {kind: (int(max(max(sent, received) for sent, received in per_rank)), calls[kind])
            for kind, per_rank in a2a_bytes(inputs).items()}


def _one(kind: str, nbytes: int, calls: int, world: int, device: torch.device, reps: int) -> float:
    """Median ms of ``calls`` collectives moving ``nbytes`` in all, over ``reps`` repetitions."""
    each = max(nbytes // max(calls, 1), 4)
    if kind == "allreduce":
        buf = torch.zeros(each // 4, dtype=torch.float32, device=device)

        def op() -> None:
            dist.all_reduce(buf)
    else:
        per_peer = max(each // max(world - 1, 1) // 4, 1)
        splits = [0 if r == dist.get_rank() else per_peer for r in range(world)]
        send = torch.zeros(sum(splits), dtype=torch.float32, device=device)
        recv = torch.empty_like(send)

        def op() -> None:
            dist.all_to_all_single(recv, send, splits, splits)

    times = []
    for rep in range(reps + 2):  # two untimed: NCCL sets up its channels on the first calls
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(max(calls, 1)):
            op()
        end.record()
        end.synchronize()
        if rep >= 2:
            times.append(start.elapsed_time(end))
    slowest = torch.tensor([percentile(times, 50)], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


def time_collectives(cfg: RecpipeConfig, device: torch.device, reps: int = 10) -> dict[str, Any]:
    """Collective (every rank): the step's collectives timed alone, ms each and in all."""
    world = dist.get_world_size()
    if world == 1:
        return {"world": 1, "collectives_ms": {}, "comm_ms": 0.0, "reason": "one rank: nothing to exchange"}
    if device.type != "cuda":
        return {"world": world, "collectives_ms": {}, "comm_ms": None, "reason": "n/a: NCCL collectives need CUDA"}
    sizes = _sizes(cfg, world)
    timed = {kind: _one(kind, nbytes, calls, world, device, reps) for kind, (nbytes, calls) in sizes.items() if calls}
    return {"world": world, "collectives_ms": timed, "comm_ms": sum(timed.values()),
            "bytes_per_rank": {k: v[0] for k, v in sizes.items()}, "calls": {k: v[1] for k, v in sizes.items()}}


def fill_floor(row: Any, comm: dict[str, Any]) -> None:
    """``row.floor``: its compute (the profile's non-NCCL device time) plus ``comm``, and x floor."""
    compute = row.trace.get("compute_busy_ms")
    if compute is None or comm.get("comm_ms") is None:
        row.floor = {"reason": comm.get("reason") or "n/a: no profiled steps (--trace-steps)"}
        return
    floor = compute + comm["comm_ms"]
    row.floor = {"compute_ms": compute, "comm_ms": comm["comm_ms"], "floor_ms": floor,
                 "x_floor": row.step_ms["p50"] / floor if row.step_ms and floor else None}


def floor_md(comm: dict[str, Any]) -> list[str]:
    """bench.md's section on the collectives of the floor."""
    if not comm.get("collectives_ms"):
        return ["## Floor", "", f"Collectives: {comm.get('reason', 'none')}.", ""]
    rows = [f"| {COLLECTIVES.get(k, k)} | {comm['bytes_per_rank'][k] / 2**20:.2f} | {comm['calls'][k]} | {ms:.3f} |"
            for k, ms in comm["collectives_ms"].items()]
    return ["## Floor", "",
            f"The step's collectives at their sizes, each timed alone on the same {comm['world']} ranks after the rows "
            "(median of 10, the slowest rank's; bytes: the busiest rank's, split evenly over its peers). A row's floor "
            "is its device time outside NCCL's kernels plus their sum "
            f"({comm['comm_ms']:.3f} ms).", "",
            "| collective | MiB per rank | calls per step | ms |", "|---|---|---|---|", *rows, ""]
