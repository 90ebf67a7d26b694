"""The keys every pipeline's options share: the ``pipeline`` section's common keys.

Each pipeline's declaration (``recpipe/pipelines/defs/``) defines ``Options``, a subclass
of :class:`PipelineKeys` that adds its own keys and fixes ``name``; that class is the only
place its defaults and allowed values live. The speed features' sections are added above
the pipelines and the speed features (``recpipe.pipeline_options``). Nothing here imports
torch.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, ConfigDict, Field

from recpipe.sections import FactorySpec, Section, factory_spec

__all__ = ["PipelineKeys"]


class PipelineKeys(Section):
    """The ``pipeline`` section: ``name`` picks the pipeline (``recpipe.pipelines.PIPELINES``)."""

    # ``class`` in YAML: a Python keyword, so ``class_`` in code.
    model_config = ConfigDict(serialize_by_alias=True)

    name: str = "base"
    # A subclass of that pipeline's class to build in its place: "package.module:ClassName",
    # imported in every rank from the working directory or PYTHONPATH (a trainer script's
    # hooks; docs/models.md). null = the pipeline's own class.
    class_: FactorySpec = Field(None, alias="class")
    # How far side streams may run ahead in batches (memory rate limiter); None = as far as
    # the schedule allows.
    max_batches_ahead: int | None = Field(None, ge=1)
    # How many steps the host may queue ahead of the device: after each step it waits for
    # the step this many back (recpipe/runtime/streams.py, StepsAhead). A finished step
    # frees its batch's copies (the allocator reuses a block once the device has read it),
    # so more steps ahead cost no allocated memory. 2 leaves the device a step's work queued
    # while the host prepares the next one; more absorbs longer host pauses (a log point's
    # metrics).
    steps_ahead: int = Field(2, ge=1)
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
    # is on the other ranks' hosts only (recpipe/runtime/sharded.py).
    splits_exchange: Literal["device", "host"] = "device"
