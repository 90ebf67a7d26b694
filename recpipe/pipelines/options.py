"""What every pipeline's options share: the ``pipeline`` section's common keys.

Each pipeline module defines ``Options``, a subclass of :class:`PipelineOptions` that
adds its own keys and fixes ``name``; that class is the only place its defaults and
allowed values live. The speed features a pipeline can be given from outside
(``recpipe.speedups``) have a section each here, owned by their module.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, Field

from recpipe.sections import Section, factory_spec
from recpipe.speedups.compile import CompileOptions
from recpipe.speedups.cuda_graphs import CudaGraphsOptions
from recpipe.speedups.step_graph import StepGraphOptions

__all__ = ["PipelineOptions"]


class PipelineOptions(Section):
    """The ``pipeline`` section: ``name`` picks the pipeline (``recpipe.pipelines.PIPELINES``)."""

    name: str = "base"
    # How far side streams may run ahead in batches (memory rate limiter); None = as far as
    # the schedule allows.
    max_batches_ahead: int | None = Field(None, ge=1)
    # Every rank trains every batch it has: ranks that run out early feed padding batches
    # with zero loss weight until the last rank is done ("pad"), or the run stops with an
    # error naming the ranks and their counts ("error").
    uneven_data: Literal["pad", "error"] = "pad"
    # Sharded modules whose input the model builds inside forward: module path in the model
    # (e.g. "sparse.ebc") -> "package.module:function", a function(batch) -> KeyedJaggedTensor
    # the pipeline runs ahead of forward (docs/models.md).
    inputs: dict[str, Annotated[str, AfterValidator(factory_spec)]] = Field(default_factory=dict)
    # Where the splits of each batch's input all-to-all are exchanged (several ranks):
    # "device" (as TorchRec does): copied to the GPU, one all-to-all on the model's process
    # group, read back at input_dist_wait, a host sync that waits for the dist stream to
    # reach it; "host": over a Gloo group of the same ranks, from host memory, so that wait
    # is on the other ranks' hosts only (recpipe/pipelines/sharded.py).
    splits_exchange: Literal["device", "host"] = "device"
    # Speed features, applied to the model and pipeline from outside (recpipe/speedups/):
    # the dense modules compiled by torch.compile (recpipe/speedups/compile.py);
    compile: CompileOptions = CompileOptions()
    # the dense modules' forward/backward and the dense optimizer's step as CUDA graphs
    # (recpipe/speedups/cuda_graphs.py);
    cuda_graphs: CudaGraphsOptions = CudaGraphsOptions()
    # the whole training step as one CUDA graph, for fixed-shape (or padded) batches
    # (recpipe/speedups/step_graph.py).
    step_graph: StepGraphOptions = StepGraphOptions()

    # FBGEMM's cache-line locking (its prefetch_pipeline mode) for UVM-cached tables: only
    # a pipeline that prefetches batch i+1 before backward(i) needs it.
    locks_cache_lines: ClassVar[bool] = False
