"""The process groups a running pipeline uses: the Gloo control group for host-side
agreement, and the CUDA graphs that captured collectives of this process's groups.

Joining and leaving the groups, as the config asks, is ``recpipe.distributed``'s; this
module reads nothing of the config, so the engine and the speed features use it from
below the config.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch.distributed as dist


def control_group() -> dist.ProcessGroup | None:
    """A Gloo group for host-side agreement (tiny CPU tensors, no device sync); None
    when not distributed. Collective when it creates one (NCCL jobs): every rank
    must call it at the same point."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


_GRAPHS_WITH_COLLECTIVES: "weakref.WeakSet[Any]" = weakref.WeakSet()


def graph_holds_collectives(graph: Any) -> None:
    """Record a ``torch.cuda.CUDAGraph`` that captured collectives of this process's
    groups: ``recpipe.distributed.shutdown_process_group`` resets it
    (:func:`reset_graphs_with_collectives`) before it destroys them. NCCL's
    communicator destruction waits forever while a graph that captured its work is
    alive (pytorch/pytorch#115388; seen here on 2 and 4 GPUs: every rank of a
    ``pipeline.step_graph`` run in ``destroy_process_group`` after the run had passed)."""
    _GRAPHS_WITH_COLLECTIVES.add(graph)


def reset_graphs_with_collectives() -> None:
    """Reset every graph :func:`graph_holds_collectives` recorded, whoever still holds it
    (a replay after the groups are gone could not run anyway)."""
    for graph in list(_GRAPHS_WITH_COLLECTIVES):
        graph.reset()
    _GRAPHS_WITH_COLLECTIVES.clear()
