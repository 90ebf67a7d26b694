"""A compiled dense step: ``pipeline.compile``, applied from outside.

``apply_compile(model, options)`` replaces the forward of each dense module (the
model's ``cuda_graph_modules()``, or ``options.modules`` by path) with a
:class:`CompiledForward`: the module's forward compiled by ``torch.compile`` (inductor,
static shapes). Its backward is compiled with it (AOTAutograd). With
``pipeline.cuda_graphs`` the graphs are captured over the compiled forward and backward
(``recpipe.speedups.cuda_graphs`` wraps the forward installed before it), so a step
replays the fused kernels.

Why: on MLPerf's DLRM-DCNv2 shapes (configs/bench/mlperf_dcnv2.yaml: 8192 samples, 3
low-rank cross layers on ``[8192, 3456]``, bf16) much of an eager step's GPU kernel
time is elementwise glue: the bias, multiply, add, activation and dtype casts of the
cross layers and MLPs, each a separate pass over memory. Inductor fuses each chain of
them into one kernel (and into the GEMM epilogue where it picks a Triton template),
which lowers the elementwise share, the GPU busy time and, with CUDA graphs, the step
(benchmarks/results/h100x1/mlperf_dcnv2.md).

Numerics: compiled kernels round differently from eager ones (fused reductions,
reassociated sums, fp32 accumulation of bf16 products): eager stays the exact
reference; ``benchmarks/studies/compile_quality.py`` measures the eval AUC of both.
A compiled step replayed as CUDA graphs equals the same compiled step run eagerly, bit
for bit (same kernels).

Same kernels from every compile (``deterministic``, on by default): inductor picks some
kernel parameters by timing candidates on the GPU when it first runs a kernel (a
reduction's block size and warp count, which set its summation order; GEMM templates and
padding under max-autotune). Near-tied timings flip from one process to the next, so two
compiles of the same model could round differently: a restarted run would not resume bit
for bit, and beside a busy second GPU a compiled run and its CUDA-graphed twin were seen
to differ in the last bits of a bias after a few steps. Inductor's deterministic mode
(``torch._inductor.config.deterministic``) makes those choices by heuristics instead;
``deterministic: false`` restores the timed choices.

Shapes: compiled for the first training call's shapes (``dynamic=False``); a call with
other shapes (a last, smaller batch) runs the module's own forward, with one warning,
instead of compiling again; evaluation (``model.eval()`` or ``torch.no_grad()``) runs
it too. So the number of compiles is fixed after the first step
(``Compiled.compiles``; tests count them). Compiled artifacts go to inductor's on-disk
cache (``options.cache_dir``, else ``TORCHINDUCTOR_CACHE_DIR`` or inductor's default), so a
restarted run loads the kernels instead of compiling them again.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from recpipe.compat import torch as compat_torch
from recpipe.errors import PipelineError
from recpipe.speedups.defs.compile import CompileOptions
from recpipe.speedups.modules import dense_modules

__all__ = ["CompileOptions", "Compiled", "CompiledForward", "apply_compile", "graph_count"]


def graph_count() -> int:
    """Graphs compiled by dynamo in this process so far (all modules)."""
    return int(compat_torch.dynamo_counters()["stats"]["unique_graphs"])


def _signature(args: tuple, kwargs: dict) -> tuple:
    flat = [*args, *kwargs.values()]
    return tuple((a.shape, a.dtype, a.device, a.requires_grad) if isinstance(a, torch.Tensor) else type(a)
                 for a in flat)


class CompiledForward:
    """Stands in for one dense module's ``forward`` (its instance attribute)."""

    def __init__(self, name: str, module: nn.Module, inductor_options: dict[str, Any]) -> None:
        if "forward" in vars(module):
            raise PipelineError(f"pipeline.compile: module {name!r} already has an instance forward "
                                f"({vars(module)['forward']!r}); apply compile before other speed features")
        self.name, self.module = name, module
        own = type(module).forward.__get__(module)
        self._compiled = torch.compile(own, dynamic=False, options=inductor_options)
        self._shapes: tuple | None = None
        self.compiled_calls = 0
        self.eager_calls = 0

    def __repr__(self) -> str:
        shapes = "not compiled yet" if self._shapes is None else "compiled"
        return (f"CompiledForward({self.name!r}, {shapes}; {self.compiled_calls} compiled calls, "
                f"{self.eager_calls} eager calls)")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if not (module.training and torch.is_grad_enabled()):
            return type(module).forward(module, *args, **kwargs)
        signature = _signature(args, kwargs)
        if self._shapes is None:
            self._shapes = signature
        elif signature != self._shapes:
            if self.eager_calls == 0:
                warnings.warn(f"pipeline.compile: {self.name!r} was compiled for other input shapes; calls with "
                              f"{[tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]} run eagerly",
                              stacklevel=2)
            self.eager_calls += 1
            return type(module).forward(module, *args, **kwargs)
        self.compiled_calls += 1
        return self._compiled(*args, **kwargs)


@dataclass
class Compiled:
    """What :func:`apply_compile` installed (printable, removable)."""

    forwards: list[CompiledForward] = field(default_factory=list)
    graphs_before: int = 0

    @property
    def compiles(self) -> int:
        """Graphs dynamo compiled since this was applied (every module of the process)."""
        return graph_count() - self.graphs_before

    @property
    def ready(self) -> bool:
        """Whether every module has been compiled (its first training call: the trainer's start-up ends)."""
        return all(f.compiled_calls > 0 for f in self.forwards)

    def __repr__(self) -> str:
        return "\n".join(f"compile: {f!r}" for f in self.forwards) or "compile: none"

    def summary(self) -> dict[str, Any]:
        """For summary.json: per module, its training calls that ran compiled and eagerly
        (other shapes than the compiled ones: a last, smaller batch)."""
        return {f.name: {"compiled_calls": f.compiled_calls, "eager_calls": f.eager_calls} for f in self.forwards}

    def remove(self) -> None:
        for f in self.forwards:
            if vars(f.module).get("forward") is f:
                del f.module.forward


def _resolve_numerics(model: nn.Module) -> None:
    """Resolve each precision context's device before compiling: the compiled code then
    only enters autocast (``recpipe.models.precision``)."""
    for module in (model, *model.modules()):
        numerics = getattr(module, "_numerics", None)
        if numerics is not None and hasattr(numerics, "resolve"):
            numerics.resolve(module)


def apply_compile(model: nn.Module, options: CompileOptions,
                  compile_module: Callable[[str, nn.Module, dict[str, Any]], Any] = CompiledForward) -> Compiled:
    """Compile ``model``'s dense modules (see the module docstring); returns what was installed."""
    if options.cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(options.cache_dir)
    _resolve_numerics(model)
    applied = Compiled(graphs_before=graph_count())
    for name, module in dense_modules(model, list(options.modules), "pipeline.compile").items():
        forward = compile_module(name, module, options.inductor_options())
        module.forward = forward
        applied.forwards.append(forward)
    return applied


def apply(ctx: Any, options: CompileOptions) -> Compiled:
    """The speed feature's entry point (``recpipe.speedups.defs.compile``)."""
    return apply_compile(ctx.model, options)
