"""The evaluation's forward as one CUDA graph, beside ``pipeline.step_graph``'s training step.

A step-graph pipeline evaluates with ``base``'s eval schedule (``recpipe.pipelines.evaluation``):
the next batch's copy, then the model's own sharded forward, run eagerly: torchrec's input
dist, the TBE lookups and the dense forward launch a few hundred kernels one by one, and a
batch is the host's time. :func:`apply_eval_graph` (applied by
:func:`recpipe.speedups.step_graph.apply_step_graph`) wraps the two steps of that schedule
(``Pipeline.wrap_eval_step``; the plain loop, ``train.eval_pipelined=false``, runs none):

* ``h2d``, on the host at fetch: the batch fitted to the training graph's capacity as a
  training batch is (:meth:`StepGraph.fitted`: padded into one extra bag per feature, the
  buckets of row-wise tables to theirs; the :class:`~recpipe.speedups.step_graph.DropPaddingBag`
  wrappers drop the padding bag's pooled row before the model reads it), and whether it
  replays, agreed by every rank at once (one Gloo all-reduce a batch, as in training): it
  fits on every rank and has the shapes of the first such eval batch.
* ``forward_eval``: a batch every rank admitted is copied into the graph's static input
  buffers and the captured forward (the model in eval mode, under ``torch.no_grad()``)
  replayed; what the model returned is copied out of the graph's buffers for the metrics.
  The first admitted batch runs eagerly, padded, with the fixed layout of the capture (the
  warm-up), the second is captured; the graph is kept for every later evaluation.

A batch that does not fit (over capacity, another batch size: a last, partial one, or a
padding batch of uneven data), and every batch before the training step is captured (the
capacity is not known yet), run eagerly, unpadded: counted in ``eager`` and, for those over
capacity or of other shapes, ``over_capacity`` (``speedups.step_graph.eval`` in the
trainer's summary.json).

Exactness: a pooled embedding is a sum per bag, so a padded batch's bags but the padding
one are the unpadded batch's, and the model reads the same pooled rows: a replayed eval
batch gives the outputs of the eager forward bit for bit (tests/test_eval_graph.py on CPU,
tests/test_eval_graph_gpu.py with real graphs).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.errors import PipelineError
from recpipe.speedups.step_graph import StepGraph, _agree, _clone, _kjts, _tensors, signature, with_features

if TYPE_CHECKING:
    from recpipe.pipelines.context import StepContext

__all__ = ["EvalGraph", "apply_eval_graph"]


@dataclass(eq=False)
class EvalGraph:
    """The wrapped ``h2d`` and ``forward_eval`` of a step-graph pipeline's evaluations (see the
    module docstring); its counts are for all evaluations of the pipeline."""

    graph: StepGraph  # the training step's: its capacity, padding and fixed layout
    train_ctx: Any  # the training pipeline's step context (its model)
    replays: int = 0
    eager: int = 0  # eval batches run eagerly: before the training step's capture, not fitting, the warm-up
    over_capacity: int = 0  # ... of them, those that did not fit the captured forward
    _replay: Callable[[], None] | None = None
    _warm: bool = False  # the warm-up batch ran
    _static: Any = None
    _shapes: tuple | None = None  # the signature of the first admitted eval batch: what replays hold
    _outputs: dict[str, Any] = field(default_factory=dict)
    _admitted: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # in-flight batches every rank admitted

    def __repr__(self) -> str:
        state = "captured" if self._replay is not None else "not captured yet"
        return f"EvalGraph({state}; {self.replays} replays, {self.eager} eager, {self.over_capacity} over capacity)"

    def summary(self) -> dict[str, int]:
        return {"replays": self.replays, "eager": self.eager, "over_capacity": self.over_capacity}

    # ------------------------------------------------ on the host, at fetch
    def h2d(self, fn: Callable) -> Callable:
        def h2d(ctx: Any, b: Any) -> None:
            kjts = _kjts(b.host)
            if kjts and self.graph.ready:  # the same on every rank: the training step was captured at the same step
                self._admit(b, kjts[0])
            fn(ctx, b)

        return h2d

    def _admit(self, b: Any, kjt: KeyedJaggedTensor) -> None:
        fitted = self.graph.fitted(kjt)
        ok = fitted is not None
        if ok:
            shapes = signature(with_features(b.host, kjt, fitted))
            ok = self._shapes is None or shapes == self._shapes
        if not _agree(ok):
            return
        self._shapes = self._shapes or shapes
        b.host = with_features(b.host, kjt, fitted, pin=True)
        self._admitted.add(b)

    # ------------------------------------------------ on the compute stream
    def forward_eval(self, fn: Callable) -> Callable:
        def forward_eval(ctx: Any, b: Any) -> None:
            if b not in self._admitted:
                self.eager += 1
                self.over_capacity += self.graph.ready
                fn(ctx, b)
                return
            self._admitted.discard(b)
            if not self._warm:  # what the capture runs, eagerly: lazy first calls happen outside it
                self._warm = True
                self.eager += 1
                with self.graph.fixed_layout(self.train_ctx):
                    fn(ctx, b)
                return
            if self._replay is None:
                self._capture(b)
            else:
                for dst, src in zip(_tensors(self._static), _tensors(b.device)):
                    dst.copy_(src, non_blocking=True)
            self._replay()
            self.replays += 1
            b.output = torch.utils._pytree.tree_map(
                lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self._outputs["output"])
            b.forwarded = True

        return forward_eval

    def _capture(self, b: Any) -> None:
        model, outputs = self.train_ctx.model, self._outputs
        self._static = _clone(b.device)

        def forward() -> None:
            with torch.no_grad():
                outputs["output"] = model(self._static)

        try:
            with self.graph.fixed_layout(self.train_ctx):
                replay = self.graph.capture(forward)  # the training step's: a CUDA graph, or a stand-in
        except Exception as err:
            raise PipelineError(
                f"pipeline.step_graph: cannot capture the evaluation's forward ({type(err).__name__}: {err}). A "
                "captured forward must not synchronize with the host (.item(), .tolist(), data-dependent shapes) "
                "in eval mode; set pipeline.step_graph=false"
            ) from err
        self._replay = self.graph.replay_of(replay, self.train_ctx)


def apply_eval_graph(ctx: "StepContext", graph: StepGraph) -> EvalGraph:
    """Run the evaluations of the pipeline of ``ctx`` (whose training steps ``graph`` replays)
    as replays of one captured forward (see the module docstring)."""
    evaluation = EvalGraph(graph, ctx)
    ctx.wrap_eval_step("h2d", evaluation.h2d)
    ctx.wrap_eval_step("forward_eval", evaluation.forward_eval)
    return evaluation
