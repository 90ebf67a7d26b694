"""``pipeline.cuda_graphs``: the dense modules' forward and backward and the dense
optimizer's step replayed as CUDA graphs; the implementation and its measurements are in
``recpipe.speedups.cuda_graphs``."""

from __future__ import annotations

from pydantic import Field

from recpipe.sections import SwitchSection
from recpipe.speedups.definition import SpeedupDef

__all__ = ["CudaGraphsOptions", "FEATURE", "plan_facts"]


class CudaGraphsOptions(SwitchSection):
    """``pipeline.cuda_graphs``: replay the dense modules' forward and backward, and the
    dense optimizer's step, as CUDA graphs (CUDA only). ``true`` / ``false`` stand for
    ``{enabled: true}`` / ``{enabled: false}``."""

    # Capture and replay (CUDA only).
    enabled: bool = False
    # Module paths in the user's model to capture (e.g. [dense_arch, over_arch]); empty =
    # what the model's cuda_graph_modules() names (recpipe's DLRM/DCNv2: dense arch and head).
    modules: list[str] = Field(default_factory=list)
    # Also replay the dense torch.optim step, bit-identical to the eager step
    # (recpipe/speedups/optimizer_graph.py): SGD, and Adagrad with lr_decay 0. Other optimizers
    # step eagerly with a warning. The eager step launches a few kernels per tensor group, host
    # time a host-bound step pays; false is for an optimizer whose capture fails.
    optimizer: bool = True


def plan_facts(options: CudaGraphsOptions) -> dict[str, int]:
    """The dense parts it captures: the configured module paths, else the two that recpipe's
    DLRM and DCNv2 name (dense arch; interaction + over arch + loss). A ``model.factory``
    model's own ``cuda_graph_modules()`` is not known to the planner: two."""
    return {"graphed_parts": len(options.modules) or 2}


FEATURE = SpeedupDef(
    "cuda_graphs", CudaGraphsOptions,
    "the dense modules' forward/backward and the dense optimizer's step as CUDA graphs "
    "(recpipe/speedups/cuda_graphs.py)",
    apply="recpipe.speedups.cuda_graphs:apply", needs_cuda=True, plan_facts=plan_facts,
    torchrec_note="TorchRec's pipeline runs the dense part eagerly",
)
