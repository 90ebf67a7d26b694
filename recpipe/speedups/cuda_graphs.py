"""CUDA graphs of a model's dense part: ``pipeline.cuda_graphs``, applied from outside.

``apply_cuda_graphs(model, optimizer, device, options)`` replaces the forward of each
dense module with a :class:`GraphedPart` that replays the module's forward and backward
as CUDA graphs, and the dense optimizer's step with a replay
(``recpipe.speedups.optimizer_graph``); ``remove_cuda_graphs`` undoes both. The
pipelines know nothing of it: a graphed module is called like any other.

Why: at 8192 samples per GPU a step of a Criteo-sized DLRM is bound by the host: most
of it goes to launching the dense forward and its autograd backward, kernel by kernel,
while the GPU needs a fraction of that (benchmarks/results/h100x1/criteo_fp32_graphs.md:
TorchRec's eager rows against recpipe's graphed ones). Replaying each dense module's
forward and backward as one CUDA graph (``torch.cuda.make_graphed_callables``, the
partial-network capture that NVIDIA's DLRM uses) removes that launch work; the sparse
part (input dist, TBE lookups, all-to-alls), whose shapes change every batch, stays eager.

Which modules: the config lists module paths (``pipeline.cuda_graphs.modules``), or the
model says (``model.cuda_graph_modules()`` returns name -> module; recpipe's DLRM/DCNv2
returns its dense arch and its interaction+over-arch+loss head). Each must take and
return tensors only, contain no sharded module, and do nothing that syncs the host
(``.item()``, ``.tolist()``).

Lifetime: a ``GraphedPart`` runs the module eagerly outside training (``model.eval()``
or ``torch.no_grad()``: evaluation), and captures on its first training call, with that
call's shapes (capture runs 3 warm-up passes on copies of the inputs and synchronizes
the device once). Later calls with the same shapes replay the graphs; padding batches
keep the shapes. A call with other shapes (a last, smaller batch) runs eagerly, with
one warning. Every output is cloned out of the graph's static buffers, because the
next replay overwrites them while the caller (metrics, the pipeline's next batches)
may still hold the previous step's tensors. Memory: each part keeps its own graph
pool (its activations and gradients for the captured shape) for the model's life.
What a part replays is the forward installed before it: the module's own, or a
compiled one (``recpipe.speedups.compile``, applied first).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from recpipe.compat import torch as compat_torch
from recpipe.errors import PipelineError, job_warning
from recpipe.speedups import optimizer_graph
from recpipe.speedups.defs.cuda_graphs import CudaGraphsOptions
from recpipe.speedups.modules import dense_modules

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

    graphed = compat_torch.make_graphed_callables(functional, (*sample_args, *aliases), allow_unused_input=True)
    return lambda *args: graphed(*args, *params)


def _signature(args: tuple) -> tuple:
    return tuple((a.shape, a.dtype, a.device, a.requires_grad) for a in args)


class GraphedPart:
    """Stands in for one dense module's ``forward`` (its instance attribute) while applied.

    ``inner``: the instance forward installed before this part (a compiled forward), or
    None for the module's own; eager calls run it and the capture records it."""

    def __init__(self, name: str, module: nn.Module, capture: Capture = capture_with_torch) -> None:
        if compat_torch.has_module_hooks(module):
            raise PipelineError(f"pipeline.cuda_graphs: module {name!r} has module hooks; CUDA graph capture needs none")
        stats = [n for n, m in module.named_modules() if compat_torch.is_batch_norm(m)]
        if stats:
            job_warning(
                f"pipeline.cuda_graphs: {name!r} has BatchNorm modules {stats}: capture's warm-up passes update "
                "their running statistics 4 extra times",
                stacklevel=3,
            )
        self.name, self.module, self._capture = name, module, capture
        self.inner: Callable[..., Any] | None = vars(module).get("forward")
        if isinstance(self.inner, GraphedPart):
            raise PipelineError(f"pipeline.cuda_graphs: module {name!r} is already graphed ({self.inner!r})")
        self._graphed: Callable[..., Any] | None = None
        self._captured_for: tuple | None = None
        self.replays = 0
        self.eager_calls = 0

    def __repr__(self) -> str:
        state = "not captured yet" if self._graphed is None else f"captured for {[tuple(s[0]) for s in self._captured_for]}"
        return f"GraphedPart({self.name!r}, {state}; {self.replays} replays, {self.eager_calls} eager calls)"

    @property
    def captured(self) -> bool:
        return self._graphed is not None

    def _eager(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def _capture_inner(self, sample: tuple) -> Callable[..., Any]:
        """The capture calls the module, so its forward is ``inner`` meanwhile, not this part."""
        module = self.module
        if self.inner is None:
            del module.forward
        else:
            module.forward = self.inner
        try:
            return self._capture(module, sample)
        finally:
            module.forward = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.module.training and torch.is_grad_enabled()):
            return self._eager(*args, **kwargs)
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
                self._graphed = self._capture_inner(sample)
            except Exception as err:  # any failure of capture: name the module and the usual causes
                raise PipelineError(
                    f"pipeline.cuda_graphs: cannot capture module {self.name!r} ({type(err).__name__}: {err}). A "
                    "captured module takes and returns tensors, and must not synchronize with the host (.item(), "
                    ".tolist(), data-dependent shapes); set pipeline.cuda_graphs=false or capture other modules "
                    "(pipeline.cuda_graphs.modules)"
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
            return self._eager(*args)
        self.replays += 1
        out = self._graphed(*args)
        # The graph's outputs live in its static buffers, which the next replay overwrites.
        return compat_torch.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)


def graph_parts(model: nn.Module, paths: list[str], capture: Capture = capture_with_torch) -> list[GraphedPart]:
    """The modules to capture: ``paths`` in the user's model, or what the model's
    ``cuda_graph_modules()`` names."""
    return [GraphedPart(name, module, capture)
            for name, module in dense_modules(model, paths, "pipeline.cuda_graphs").items()]


def install(parts: list[GraphedPart]) -> None:
    for part in parts:
        own = vars(part.module).get("forward")
        if own is not part.inner:
            raise PipelineError(
                f"pipeline.cuda_graphs: the forward of module {part.name!r} was replaced ({own!r}) after its graphs "
                "were set up; apply CUDA graphs last"
            )
        part.module.forward = part


def remove(parts: list[GraphedPart]) -> None:
    for part in parts:
        if vars(part.module).get("forward") is part:
            if part.inner is None:
                del part.module.forward
            else:
                part.module.forward = part.inner


@dataclass
class CudaGraphs:
    """What :func:`apply_cuda_graphs` installed (printable, removable)."""

    parts: list[GraphedPart] = field(default_factory=list)
    optimizer_steps: list[optimizer_graph.GraphedOptimizerStep] = field(default_factory=list)

    def __repr__(self) -> str:
        return "\n".join([*(f"cuda graphs: {p!r}" for p in self.parts),
                          *(f"cuda graphs: {s!r}" for s in self.optimizer_steps)]) or "cuda graphs: none"

    @property
    def ready(self) -> bool:
        """Whether every part and optimizer step is captured (the trainer's start-up ends)."""
        return all(p.captured for p in self.parts) and all(s.captured for s in self.optimizer_steps)

    def remove(self) -> None:
        remove(self.parts)
        optimizer_graph.remove(self.optimizer_steps)


def apply_cuda_graphs(model: nn.Module, optimizer: Any, device: torch.device, options: CudaGraphsOptions,
                      capture: Capture = capture_with_torch) -> CudaGraphs:
    """Replay ``model``'s dense modules (``options.modules``, or the model's
    ``cuda_graph_modules()``) and, with ``options.optimizer``, the dense optimizer's step
    as CUDA graphs. Apply after :func:`recpipe.speedups.compile.apply_compile`: the graphs
    record the compiled forward."""
    if device.type != "cuda":
        raise PipelineError(f"pipeline.cuda_graphs=true needs a CUDA device (this model runs on {device})")
    applied = CudaGraphs(graph_parts(model, list(options.modules), capture))
    if options.optimizer:
        applied.optimizer_steps = optimizer_graph.graph_steps(optimizer, device)
    install(applied.parts)
    optimizer_graph.install(applied.optimizer_steps)
    return applied


def apply(ctx: Any, options: CudaGraphsOptions) -> CudaGraphs:
    """The speed feature's entry point (``recpipe.speedups.defs.cuda_graphs``)."""
    return apply_cuda_graphs(ctx.model, ctx.optimizer, ctx.device, options)
