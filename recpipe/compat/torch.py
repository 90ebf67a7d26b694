"""torch's private names recpipe reads (see :mod:`recpipe.compat`).

Checked against torch 2.13 (``torch/nn/modules/module.py``, ``torch/optim/optimizer.py``,
``torch/autograd/profiler.py``, ``torch/distributed/utils.py``, ``torch/distributed/checkpoint/``,
``torch/_dynamo``, ``torch/_inductor``, ``torch/fx``); torch 2.11: to be checked on the GPU
machine (tests/test_compat.py).

Imports of torch's compiler, distributed and checkpoint packages stay inside the functions
that need them: importing this module costs no more than importing ``torch``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Container, Iterator

import torch
from torch import nn
from torch.autograd import profiler as autograd_profiler


def backward_pre_hooks(module: nn.Module) -> dict[int, Any]:
    """A module's backward pre-hooks by handle id (``_backward_pre_hooks``), to be replaced
    in place: speedups/cache_bookkeeping.py swaps FBGEMM's hook for one that replays it per
    batch. ``register_full_backward_pre_hook`` only adds; no public API replaces one."""
    return module._backward_pre_hooks


def has_module_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has forward, forward pre- or backward hooks of its own (not the
    global ones): a CUDA graph of its forward (speedups/cuda_graphs.py) would skip them.
    No public API lists a module's hooks."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks)


def is_batch_norm(module: nn.Module) -> bool:
    """Whether ``module`` is one of torch's batch norms (BatchNorm1d/2d/3d, SyncBatchNorm, the
    lazy ones, or a subclass): their common base, ``_BatchNorm``, is private."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


def has_optimizer_step_hooks(opt: torch.optim.Optimizer) -> bool:
    """Whether a step of ``opt`` runs hooks (its own or the global ones registered with
    ``register_optimizer_step_pre_hook``/``_post_hook``): a CUDA graph of its step
    (speedups/optimizer_graph.py) would skip them. No public API lists them."""
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    return bool(opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks
                or _global_optimizer_pre_hooks or _global_optimizer_post_hooks)


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every i, in one fused kernel launch per device and dtype:
    torch's ``_foreach_copy_`` (the optimizers' own), which has no public name."""
    torch._foreach_copy_(dst, src)


def foreach_add_(tensors: list[torch.Tensor], other: Any, alpha: float = 1.0) -> None:
    """``t.add_(other, alpha=alpha)`` for every tensor, fused as :func:`foreach_copy_`
    (``_foreach_add_``; ``other``: a number or a one-element tensor)."""
    if isinstance(other, torch.Tensor):
        torch._foreach_add_(tensors, other, alpha=alpha)
    else:  # the scalar overload takes no alpha
        torch._foreach_add_(tensors, other * alpha)


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``fn`` applied to every leaf of nested lists, tuples, dicts and dataclasses torch
    knows: ``torch.utils._pytree.tree_map``, which torch has no public name for."""
    import torch.utils._pytree as pytree

    return pytree.tree_map(fn, tree)


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the running backward has finished (called from a gradient hook):
    the autograd engine's ``queue_callback``, which DDP uses for its final reduction. No
    public API gives the end of a backward."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def profiler_enabled() -> bool:
    """Whether a ``torch.profiler`` (or ``torch.autograd.profiler``) profile is recording:
    recpipe then names its phases with ``record_function`` and otherwise makes no range
    object at all. The flag the profiler sets (``_is_profiler_enabled``) has no public reader."""
    return autograd_profiler._is_profiler_enabled


def clear_cublas_workspaces() -> None:
    """Free the cuBLAS workspaces torch keeps in its caching allocator, one per (handle,
    stream) that ran a matmul, as torch's own CUDA leak check does before it compares
    ``memory_allocated`` (``torch/testing/_internal/common_utils.py``). A no-op where CUDA is
    not built or not initialized. The function has no public name."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_initialized():
        clear()


def is_sharded_tensor(value: Any) -> bool:
    """Whether ``value`` is a ``ShardedTensor``, torchrec's sharded tables in a state_dict
    (torch keeps the class under ``torch.distributed._shard``; torchrec imports it from there)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)


def verify_param_shapes(process_group: Any, params: list[torch.Tensor]) -> None:
    """Raise unless ``params`` have the same shapes on every rank of ``process_group``: what
    DDP checks at construction (``_verify_param_shape_across_processes``), with no public name."""
    from torch.distributed.utils import _verify_param_shape_across_processes

    _verify_param_shape_across_processes(process_group, params)


def broadcast_parameters(module: nn.Module, process_group: Any, bucket_bytes: int, src: int,
                         ignore: Container[str]) -> None:
    """``src``'s parameters of ``module`` (but ``ignore``'s names) to every rank, in buckets of
    ``bucket_bytes``; buffers stay as they are. What DDP does at construction with
    ``broadcast_buffers=False`` (``_sync_module_states``), with no public name."""
    from torch.distributed.utils import _sync_module_states

    _sync_module_states(module, process_group, bucket_bytes, src, ignore, broadcast_buffers=False)


def dcp_set_element(root: dict, path: Any, value: Any) -> None:
    """Put ``value`` at ``path`` (DCP's object path) of the nested state_dict ``root``: how
    DCP's ``DefaultLoadPlanner.load_bytes`` does it (``torch.distributed.checkpoint._traverse``),
    for a planner that loads the value its own way. No public name."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)


def dcp_metadata_private_globals() -> list[Any]:
    """The private classes and functions a ``.metadata`` of DCP's FileSystemWriter pickles:
    the memory format enum of its tensor properties, FileSystemWriter's storage entries,
    and torch's lookup of a ``torch.layout`` by name (how a layout pickles)."""
    from torch.distributed.checkpoint import metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return [metadata._MEM_FORMAT_ENCODING, _StorageInfo, torch.serialization._get_layout]


@contextlib.contextmanager
def dynamo_config_kept() -> Iterator[None]:
    """``torch._dynamo.config`` as it was before, and dynamo's caches dropped, after the block
    (``save_config``/``load_config``: torch has no public way to restore the compiler's settings)."""
    import warnings

    import torch._dynamo

    saved = torch._dynamo.config.save_config()
    try:
        yield
    finally:
        with warnings.catch_warnings():  # the saved config names deprecated keys too
            warnings.simplefilter("ignore", FutureWarning)
            torch._dynamo.config.load_config(saved)
        torch.compiler.reset()


def dynamo_counters(*, if_loaded: bool = False) -> Any:
    """dynamo's counters of this process (``counters["stats"]["unique_graphs"]``,
    ``counters["inductor"]``, ...): ``torch._dynamo.utils.counters``, with no public reader.
    ``if_loaded``: None when the compiler was never imported (and without importing it)."""
    import sys

    if if_loaded and "torch._dynamo" not in sys.modules:
        return None
    from torch._dynamo.utils import counters

    return counters


def inductor_mode_options(mode: str) -> dict[str, Any]:
    """The inductor settings ``torch.compile(mode=...)`` applies, as its ``options``:
    ``torch._inductor.list_mode_options``, which torch.compile's documentation names."""
    from torch import _inductor

    return _inductor.list_mode_options(mode)


def fx_trace_logger() -> logging.Logger:
    """The logger of ``torch.fx``'s symbolic tracing, which notes ``is_fx_tracing`` checks
    (torchrec's) that a user cannot act on: named after its private module."""
    return logging.getLogger("torch.fx._symbolic_trace")


def backed_size_oblivious() -> contextlib.AbstractContextManager:
    """``torch.fx.experimental._config.backed_size_oblivious`` set within the block: sizes
    of 0 or 1 seen at export are not specialised (serving.py exports a batch dimension: without it, export's view of ``lengths`` as [F, B]
    assumes B != 1 and guards on it). A private setting of torch's for export, in torch 2.7
    and later."""
    from torch.fx.experimental import _config as fx_config

    return fx_config.patch(backed_size_oblivious=True)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's garbage collector collected first, then paused: an object it would free in
    the middle of a capture (an earlier graph, a CUDA event, a pinned buffer) makes CUDA calls
    a capture forbids on its thread, and the capture fails ("operation failed due to a previous
    error during capture"), at whichever allocation the collector happens to run."""
    import gc

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph) -> Iterator[None]:
    """``torch.cuda.graph(graph)`` in ``thread_local`` mode, the collector paused
    (:func:`_collector_paused`). ``thread_local``: the other threads of this process (the data
    loader pinning batches, NCCL's watchdog querying events) may call CUDA meanwhile; that is
    legal, only this thread's calls must not sync."""
    with _collector_paused(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
        yield


class _ThreadLocalGraph(torch.cuda.graph):
    """``torch.cuda.graph`` whose capture mode defaults to ``thread_local``."""

    def __init__(self, cuda_graph: torch.cuda.CUDAGraph, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("capture_error_mode", "thread_local")
        super().__init__(cuda_graph, *args, **kwargs)


def make_graphed_callables(fn: Callable[..., Any], sample_args: tuple, **kwargs: Any) -> Callable[..., Any]:
    """``torch.cuda.make_graphed_callables``, its captures as :func:`graph_capture`'s. It takes
    no capture mode and captures with ``torch.cuda.graph``'s default, ``global``, in which any
    thread's CUDA call that may sync (a loader thread pinning a batch) fails the capture: while
    it runs, ``torch.cuda.graph`` is the subclass above (``make_graphed_callables`` looks the
    name up at each capture; tests/test_compat.py checks it still does)."""
    from unittest import mock

    with _collector_paused(), mock.patch.object(torch.cuda, "graph", _ThreadLocalGraph):
        return torch.cuda.make_graphed_callables(fn, sample_args, **kwargs)


def on_compiles(started: Callable[[], None], ended: Callable[[], None]) -> Callable[[], None]:
    """Call ``started()`` when torch.compile starts compiling in this process (dynamo tracing a
    frame, a deferred backward's compile) and ``ended()`` when no compile is left; returns the
    function that stops it. Dynamo's compilation callbacks (``torch._dynamo.callback``) have no
    public name; they run on the compiling thread, and take an argument in some releases."""
    from torch._dynamo.callback import callback_handler

    def start(*_: Any) -> None:
        started()

    def end(*_: Any) -> None:
        ended()

    callback_handler.register_start_callback(start)
    callback_handler.register_end_callback(end)

    def stop() -> None:
        callback_handler.remove_start_callback(start)
        callback_handler.remove_end_callback(end)

    return stop
