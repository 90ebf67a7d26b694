"""Which modules of a model are its dense part, for the speed features that act on it
(``pipeline.compile``, ``pipeline.cuda_graphs``)."""

from __future__ import annotations

from torch import nn
from torchrec.distributed.model_parallel import get_unwrapped_module
from torchrec.distributed.types import ShardedModule

from recpipe.errors import PipelineError

__all__ = ["dense_modules"]


def dense_modules(model: nn.Module, paths: list[str], key: str) -> dict[str, nn.Module]:
    """``paths`` in the user's model (DistributedModelParallel unwrapped), or what the
    model's ``cuda_graph_modules()`` names (name -> module). ``key`` is the config key
    for messages. Each must contain no sharded module: those run all-to-alls whose
    shapes change every batch."""
    user = get_unwrapped_module(model)
    if paths:
        found = {}
        for path in paths:
            try:
                found[path] = user.get_submodule(path)
            except AttributeError:
                children = [n for n, _ in user.named_children()]
                raise PipelineError(
                    f"{key}.modules names {path!r}, which is not a module of {type(user).__name__} (its children: "
                    f"{children})"
                ) from None
    elif callable(getattr(user, "cuda_graph_modules", None)):
        found = dict(user.cuda_graph_modules())
    else:
        raise PipelineError(
            f"{key}: {type(user).__name__} does not say which of its modules are dense; set {key}.modules to "
            "the paths of its dense modules (e.g. ['dense_arch', 'over_arch']), or give the model a "
            "cuda_graph_modules() method returning {name: module}"
        )
    for name, module in found.items():
        inner = [n for n, m in module.named_modules() if isinstance(m, ShardedModule)]
        if inner:
            raise PipelineError(
                f"{key}: module {name!r} contains sharded modules {inner}, whose all-to-alls change shape every "
                "batch; name only dense modules"
            )
    return found
