"""CUDA graphs for the dense part of a model (``pipeline.cuda_graphs``).

At 8192 samples per GPU a step of a Criteo-sized DLRM is bound by the host: most of
its ~10 ms go to launching the dense forward and its autograd backward, kernel by
kernel, while the GPU needs ~3-5 ms. Replaying each dense module's forward and
backward as one CUDA graph (``torch.cuda.make_graphed_callables``, the partial-network
capture that NVIDIA's DLRM uses) removes that launch work; the sparse part (input
dist, TBE lookups, all-to-alls), whose shapes change every batch, stays eager.

Which modules: the model says (``model.cuda_graph_modules()`` returns name -> module;
recpipe's DLRM/DCNv2 returns its dense arch and its interaction+over-arch+loss head),
or the config lists module paths (``pipeline.cuda_graph_modules``). Each must take
and return tensors only, contain no sharded module, and do nothing that syncs the
host (``.item()``, ``.tolist()``).

Lifetime: a ``GraphedPart`` is installed as the module's instance ``forward`` while the
pipeline is attached (removed by ``detach()``, so evaluation in ``detached()`` runs
eagerly). It captures on its first training call, with that call's shapes (capture
runs 3 warm-up passes on copies of the inputs and synchronizes the device once).
Later calls with the same shapes replay the graphs; padding batches keep the shapes.
A call with other shapes (a last, smaller batch) runs eagerly, with one warning.
Every output is cloned out of the graph's static buffers, because the next replay
overwrites them while the caller (metrics, the pipeline's next batches) may still
hold the previous step's tensors. Memory: each part keeps its own graph pool (its
activations and gradients for the captured shape) for the pipeline's life.

The dense optimizer's step is graphed too (``pipeline.cuda_graph_optimizer``, on by
default): ``recpipe.pipelines.optimizer_graph`` replays ``torch.optim.SGD`` and
``torch.optim.Adagrad`` (``lr_decay == 0``) steps bit-identically to the eager step,
keeps Adagrad's host-side step counts right, and steps eagerly (with one warning)
where a replay could differ: other optimizers, a changed lr or state, a closure.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import nn
from torchrec.distributed.model_parallel import get_unwrapped_module
from torchrec.distributed.types import ShardedModule

Capture = Callable[[nn.Module, tuple], Callable[..., Any]]


def capture_with_torch(module: nn.Module, sample_args: tuple) -> Callable[..., Any]:
    """``torch.cuda.make_graphed_callables`` over ``module``'s forward; returns the
    graphed callable (the module itself is left as it was).

    The module is captured as a function of its inputs *and its parameters*
    (``torch.func.functional_call``), with fresh leaf aliases of the parameters
    (``detach()``: same storage, no copy) as sample inputs. Capturing the module
    itself fails under DistributedModelParallel: DDP created the parameters'
    gradient accumulators on the default stream at construction, and the autograd
    engine's end-of-backward sync with those cached streams is illegal inside a
    capture ("operation would make the legacy stream depend on a capturing blocking
    stream"; PyTorch PRs 180090 and 189591). At replay the real parameters are passed
    in: they share the aliases' storage, so nothing is copied, and their gradients
    reach their own accumulators, where the all-reduce hooks (recpipe's
    ``GradientAllReduce`` or DDP's) fire as in eager mode."""
    named = dict(module.named_parameters())
    params = tuple(named.values())
    aliases = tuple(p.detach().requires_grad_(p.requires_grad) for p in params)
    buffers = dict(module.named_buffers())
    count = len(sample_args)

    def functional(*flat: torch.Tensor) -> Any:
        state = {**dict(zip(named, flat[count:])), **buffers}
        return torch.func.functional_call(module, state, flat[:count])

    own = vars(module).pop("forward", None)  # our wrapper; capture runs the module's own forward
    try:
        graphed = torch.cuda.make_graphed_callables(functional, (*sample_args, *aliases), allow_unused_input=True)
    finally:
        if own is not None:
            module.forward = own
    return lambda *args: graphed(*args, *params)


def _signature(args: tuple) -> tuple:
    return tuple((a.shape, a.dtype, a.device, a.requires_grad) for a in args)


class GraphedPart:
    """Stands in for one dense module's ``forward`` while the pipeline is attached."""

    def __init__(self, name: str, module: nn.Module, capture: Capture = capture_with_torch) -> None:
        from recpipe.pipelines.sharded import PipelineError

        inner = [n for n, m in module.named_modules() if isinstance(m, ShardedModule)]
        if inner:
            raise PipelineError(
                f"pipeline.cuda_graphs: module {name!r} contains sharded modules {inner}, whose all-to-alls change "
                "shape every batch and cannot be captured; graph only dense modules"
            )
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
            raise PipelineError(f"pipeline.cuda_graphs: module {name!r} has module hooks; CUDA graph capture needs none")
        stats = [n for n, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if stats:
            warnings.warn(
                f"pipeline.cuda_graphs: {name!r} has BatchNorm modules {stats}: capture's warm-up passes update "
                "their running statistics 4 extra times",
                stacklevel=3,
            )
        self.name, self.module, self._capture = name, module, capture
        self._graphed: Callable[..., Any] | None = None
        self._captured_for: tuple | None = None
        self.replays = 0
        self.eager_calls = 0

    def __repr__(self) -> str:
        state = "not captured yet" if self._graphed is None else f"captured for {[tuple(s[0]) for s in self._captured_for]}"
        return f"GraphedPart({self.name!r}, {state}; {self.replays} replays, {self.eager_calls} eager calls)"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from recpipe.pipelines.sharded import PipelineError

        eager = type(self.module).forward
        if not (self.module.training and torch.is_grad_enabled()):
            return eager(self.module, *args, **kwargs)
        if kwargs or not all(isinstance(a, torch.Tensor) for a in args):
            raise PipelineError(
                f"pipeline.cuda_graphs: module {self.name!r} was called with "
                f"{[type(a).__name__ for a in args]} and keyword arguments {sorted(kwargs)}; a captured module takes "
                "positional tensors only (pass tensors, or leave it out of the captured modules)"
            )
        signature = _signature(args)
        if self._graphed is None:
            sample = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
            try:
                self._graphed = self._capture(self.module, sample)
            except Exception as err:  # any failure of capture: name the module and the usual causes
                raise PipelineError(
                    f"pipeline.cuda_graphs: cannot capture module {self.name!r} ({type(err).__name__}: {err}). A "
                    "captured module takes and returns tensors, and must not synchronize with the host (.item(), "
                    ".tolist(), data-dependent shapes); set pipeline.cuda_graphs=false or capture other modules "
                    "(pipeline.cuda_graph_modules)"
                ) from err
            self._captured_for = signature
        elif signature != self._captured_for:
            if self.eager_calls == 0:
                warnings.warn(
                    f"pipeline.cuda_graphs: {self.name!r} was captured for inputs {[tuple(s[0]) for s in self._captured_for]} "
                    f"and is now called with {[tuple(a.shape) for a in args]}: such calls run eagerly",
                    stacklevel=2,
                )
            self.eager_calls += 1
            return eager(self.module, *args)
        self.replays += 1
        out = self._graphed(*args)
        # The graph's outputs live in its static buffers, which the next replay overwrites.
        return torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)


def graph_parts(model: nn.Module, paths: list[str], capture: Capture = capture_with_torch) -> list[GraphedPart]:
    """The modules to capture: ``paths`` in the user's model, or what the model's
    ``cuda_graph_modules()`` names."""
    from recpipe.pipelines.sharded import PipelineError

    user = get_unwrapped_module(model)
    if paths:
        found = {}
        for path in paths:
            try:
                found[path] = user.get_submodule(path)
            except AttributeError:
                children = [n for n, _ in user.named_children()]
                raise PipelineError(
                    f"pipeline.cuda_graph_modules names {path!r}, which is not a module of "
                    f"{type(user).__name__} (its children: {children})"
                ) from None
    elif callable(getattr(user, "cuda_graph_modules", None)):
        found = dict(user.cuda_graph_modules())
    else:
        raise PipelineError(
            f"pipeline.cuda_graphs: {type(user).__name__} does not say which of its modules can be captured; set "
            "pipeline.cuda_graph_modules to the paths of its dense modules (e.g. ['dense_arch', 'over_arch']), or "
            "give the model a cuda_graph_modules() method returning {name: module}"
        )
    return [GraphedPart(name, module, capture) for name, module in found.items()]


def install(parts: list[GraphedPart]) -> None:
    from recpipe.pipelines.sharded import PipelineError

    for part in parts:
        if "forward" in vars(part.module):
            raise PipelineError(
                f"pipeline.cuda_graphs: module {part.name!r} already has an instance-level forward "
                f"({vars(part.module)['forward']!r}); is another pipeline attached to this model?"
            )
        part.module.forward = part


def remove(parts: list[GraphedPart]) -> None:
    for part in parts:
        if vars(part.module).get("forward") is part:
            del part.module.forward
