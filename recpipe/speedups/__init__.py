"""Speed features, applied to a model and its pipeline from outside the engine.

Each is a function that takes what it speeds up and installs itself visibly (as an
instance ``forward``, an optimizer ``step``, a wrapped pipeline step or a replacement
schedule), with its own section of the ``pipeline`` config and its own tests:

==================  ==============================  ============================================
section             function                        what it does
==================  ==============================  ============================================
``compile``         ``compile.apply_compile``       the dense modules compiled by torch.compile
``cuda_graphs``     ``cuda_graphs.apply_cuda_graphs``  the dense modules' forward/backward and the
                                                    dense optimizer's step replayed as CUDA graphs
``cache_fill``      ``cache_fill.apply_cache_fill``  recpipe's UVM-cache insert in ``prefetch``
(always)            ``cache_bookkeeping.apply_...``  ``prefetch``: FBGEMM's backward pre-hook work on
                                                    the prefetch stream
``step_graph``      ``step_graph.apply_step_graph``  the whole training step as one CUDA graph
==================  ==============================  ============================================

:func:`apply_speedups` applies those a ``pipeline`` section enables, in that order (the
graphs record the compiled code), and returns what it installed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from recpipe.speedups.cache_bookkeeping import apply_cache_bookkeeping
from recpipe.speedups.cache_fill import apply_cache_fill
from recpipe.speedups.compile import apply_compile
from recpipe.speedups.cuda_graphs import apply_cuda_graphs
from recpipe.speedups.step_graph import apply_step_graph

__all__ = ["apply_cache_bookkeeping", "apply_cache_fill", "apply_compile", "apply_cuda_graphs", "apply_speedups", "apply_step_graph"]


def apply_speedups(pipeline: Any, options: Any, model: nn.Module, optimizer: Any, device: torch.device) -> list[Any]:
    """Apply the speed features ``options`` (a ``pipeline`` section) enables to ``model``,
    ``optimizer`` and ``pipeline``; returns the handles (printable, with ``remove()``)."""
    applied: list[Any] = []
    if options.compile.enabled:
        applied.append(apply_compile(model, options.compile))
    if options.cuda_graphs.enabled:
        applied.append(apply_cuda_graphs(model, optimizer, device, options.cuda_graphs))
    fill = getattr(options, "cache_fill", None)
    if fill is not None:
        installed = apply_cache_fill(pipeline, getattr(pipeline, "tbes", []), fill)
        moved = apply_cache_bookkeeping(pipeline, getattr(pipeline, "tbes", []))
        applied += [a for a in (installed, moved) if a is not None]
    if options.step_graph.enabled:
        applied.append(apply_step_graph(pipeline, options.step_graph))
    return applied
