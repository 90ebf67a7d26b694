"""What a step, a hook or a speed feature may use of the engine: :class:`StepContext`,
and the batches in flight it hands them: :class:`InFlight`.

The engine (``recpipe.runtime.engine``) makes one context per pipeline and keeps it
up to date; steps (``recpipe.runtime.steps``), the sharded modules' interceptors
(``recpipe.runtime.sharded``), pipeline classes and speed features read and write
only what is documented here, never the engine's private fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from recpipe.runtime.inputs import InputSource
from recpipe.runtime.schedule import Schedule
from recpipe.runtime.streams import Event, Stream, Streams

__all__ = ["InFlight", "StepContext"]


@dataclass(eq=False)
class InFlight:
    """One batch in the pipeline and everything made for it so far."""

    index: int  # position in the pipeline's stream of batches (0, 1, ...)
    host: Any  # the user's batch (recpipe's Batch, or any torchrec Pipelineable)
    is_padding: bool = False
    zero_loss: bool = False  # a padding batch without as_padding(): its loss is multiplied by 0
    device: Any = None
    ctxs: dict[str, Any] = field(default_factory=dict)  # module contexts (create_context)
    splits: list[tuple[list[str], Any]] = field(default_factory=list)  # fused splits all-to-alls
    dist_in: dict[str, Any] = field(default_factory=dict)  # tensors all-to-all awaitables, then KJTLists
    emb: dict[str, Any] = field(default_factory=dict)  # early lookups: output-dist awaitables
    emb_ready: dict[str, Any] = field(default_factory=dict)  # early lookups, output dist already waited
    detached: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # semi_sync
    lookup_out: dict[str, list[Any]] = field(default_factory=dict)  # semi_sync before_update: the lookups' output edges
    lookup_grads: list[tuple[Any, torch.Tensor]] = field(default_factory=list)  # ... and their gradients
    consumed: set[str] = field(default_factory=set)
    events: dict[str, Event] = field(default_factory=dict)
    loss: torch.Tensor | None = None  # until backward (it holds the autograd graph)
    loss_value: torch.Tensor | None = None  # detached, for the caller
    output: Any = None  # what the model returned besides the loss (forward_eval: all it returned)
    forwarded: bool = False  # forward_eval ran (an evaluation keeps no loss)


class StepContext:
    """What a step, a hook or a speed feature may use of the engine: one per pipeline
    (``pipeline.context``), handed to every step as ``step(ctx, batch)`` and to every speed
    feature as ``apply(ctx, options)``; a hook reads it as ``self.context``.

    Set when the pipeline is built:

    * ``pipeline``: the pipeline itself, for its hooks (``before_forward``, ...), its
      ``name`` and the methods pipeline classes override (``sharded_forward``,
      ``own_forward``);
    * ``model``, ``optimizer``, ``device``; ``offers``: the pipeline's capabilities;
    * ``max_batches_ahead``: its option the steps read;
    * ``streams``: the streams by role (``recpipe.runtime.streams``; all None on CPU);
    * ``modules``: the sharded modules the pipeline intercepts, by path in the user's model
      (empty when the model runs its own sharded forward), in the order forward calls them;
    * ``inputs``: ``pipeline.inputs``' functions, by module path.

    Kept up to date by the engine while it runs:

    * ``sources``: where each module's input comes from (``recpipe.runtime.inputs``;
      None until the first batch has taught it);
    * ``discovering``: inside the first batch's forward, where the modules run their own
      forward and the interceptors fill ``found_sources``;
    * ``current``: the batch inside ``forward`` (None elsewhere);
    * ``stream``: the stream the running step is on (a step does not switch to it);
    * ``splits_fused``: the fused splits all-to-all is installed (after the first input dist).

    Methods: ``recent(index)`` (a batch still in flight or just trained, by index),
    ``ahead(slot)`` (the batch ``slot`` places ahead of the one being trained),
    ``step_stream(batch, name)``; for speed features, ``wrap_step``, ``wrap_eval_step``, ``replace_schedule`` and
    ``on_detached`` (see ``recpipe.runtime.engine.Pipeline``).
    """

    def __init__(self, pipeline: Any, streams: Streams, modules: dict[str, Any],
                 inputs: dict[str, Callable[[Any], Any]], max_batches_ahead: int | None) -> None:
        """Made by the engine (``pipeline``: a ``recpipe.runtime.engine.Pipeline``, not imported
        here: the engine imports this module)."""
        self.pipeline = pipeline
        self.model, self.optimizer, self.device = pipeline.model, pipeline.optimizer, pipeline.device
        self.offers = pipeline.definition.offers
        self.max_batches_ahead = max_batches_ahead
        self.streams = streams
        self.modules = modules
        self.inputs = inputs
        self.sources: dict[str, InputSource] | None = None if modules else {}
        self.discovering = False
        self.found_sources: dict[str, InputSource] = {}
        self.current: InFlight | None = None
        self.stream: Stream = None
        self.splits_fused = False

    def recent(self, index: int) -> InFlight | None:
        """Batch ``index`` of the pipeline's stream of batches while it is in flight or was
        trained lately (a wait on the previous batch's event; the rate limiter)."""
        return self.pipeline.recent_batch(index)

    def ahead(self, slot: int) -> InFlight | None:
        """The batch ``slot`` places ahead of the one being trained (None: none, e.g. draining)."""
        return self.pipeline.batch_ahead(slot)

    def step_stream(self, batch: InFlight, name: str) -> Stream:
        """The stream step ``name`` runs on in the schedule that trains ``batch``."""
        return self.pipeline.step_stream(batch, name)

    def wrap_step(self, name: str, wrapper: Callable[[Callable], Callable]) -> None:
        """``Pipeline.wrap_step``."""
        self.pipeline.wrap_step(name, wrapper)

    def wrap_eval_step(self, name: str, wrapper: Callable[[Callable], Callable]) -> None:
        """``Pipeline.wrap_eval_step``."""
        self.pipeline.wrap_eval_step(name, wrapper)

    def replace_schedule(self, schedule: Schedule, functions: Mapping[str, Callable[[StepContext, InFlight], None]],
                         *, intercepts: bool) -> None:
        """``Pipeline.replace_schedule``."""
        self.pipeline.replace_schedule(schedule, functions, intercepts=intercepts)

    def on_detached(self, fn: Callable[[], None]) -> None:
        """``Pipeline.on_detached``."""
        self.pipeline.on_detached(fn)
