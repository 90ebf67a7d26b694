"""Gradient accumulation (``train.accumulate_steps: N``): one optimizer step from N
micro-batches of ``data.batch_size``, as one batch of N x ``data.batch_size`` would make.

Each micro-batch is one ``progress()`` of the pipeline, whose ``zero_grad``, ``backward``
and ``optimizer`` steps are wrapped (``Pipeline.wrap_step``): the dense gradients are
zeroed before the first micro-batch only, every backward runs on ``loss / N`` (the
model's loss is a per-sample mean, so the sum of the N scaled gradients is the large
batch's mean gradient), and the dense optimizer steps after the last one only. This is
TorchRec's ``GradientAccumulationWrapper``
(``torchrec/distributed/train_pipeline/gradient_accumulation.py``: it gates
``zero_grad`` and ``step`` the same way; it leaves the loss scaling to the model),
for the pipelines whose three steps act on the same batch in the same ``progress()``
call (``base``, ``sparse_dist``, ``fused_sparse_dist``, ``prefetch``): the trainer
says which micro-batch comes next before each call.

What equals the large batch (``tests/test_accumulation.py``):

* the dense parameters and ``data_parallel`` tables (the dense optimizer updates both
  once a step): equal up to float summation order (a weight gradient is summed over N
  partial sums of B rows instead of one of N x B rows; with N a power of two ``loss / N``
  is exact);
* tables of FBGEMM's fused optimizer are updated inside each micro-batch's TBE backward
  (the update cannot be deferred; TorchRec's wrapper has the same limit: its optimizer
  wrapper skips ``step()``, which for a fused table does nothing). Each micro-batch
  applies its share of the large batch's gradient (``loss / N``), and a later micro-batch
  reads the rows an earlier one updated. Where no row is read by two micro-batches of a
  step, each row gets the large batch's one update (SGD and row-wise Adagrad: equal up to
  summation order; Adam's step count advances N times). Where rows repeat, they differ.

Every rank all-reduces the dense gradients after each micro-batch's backward (DDP and
``sharding.dense_gradients=all_reduce`` alike): the sum of the averages is the average
of the sums, at N all-reduces a step instead of one.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from recpipe.errors import PipelineError
from recpipe.runtime.steps import dense_params

__all__ = ["GradientAccumulation"]

# The steps accumulation gates; each must act on the batch the same progress() trains.
_GATED = ("zero_grad", "backward", "optimizer")


class GradientAccumulation:
    """``steps`` micro-batches per optimizer step of ``pipeline``: ``step(batches)``
    trains the next ones and returns what each ``progress()`` returned with its loss
    and padding flag."""

    def __init__(self, pipeline: Any, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"accumulate_steps must be at least 1, got {steps}")
        self.pipeline, self.steps = pipeline, steps
        self._check_schedules(pipeline)
        self._micro = 0  # the micro-batch the next progress() trains: 0 .. steps - 1
        self._held: tuple[Callable, Any, Any] | None = None  # the optimizer step not taken yet
        pipeline.wrap_step("zero_grad", self._first_only)
        pipeline.wrap_step("backward", self._scaled)
        pipeline.wrap_step("optimizer", self._last_only)

    def __repr__(self) -> str:
        return f"GradientAccumulation({self.steps} micro-batches per optimizer step)"

    @staticmethod
    def _check_schedules(pipeline: Any) -> None:
        for schedule in pipeline.schedules():
            offsets = {s.name: s.offset for s in schedule.steps}
            if any(offsets.get(name) != 0 for name in _GATED):
                raise PipelineError(
                    f"train.accumulate_steps needs zero_grad, backward and optimizer of the batch a progress() trains; "
                    f"schedule {schedule.name} of pipeline {pipeline.name!r} splits them")

    # ------------------------------------------------------------ the wrapped steps
    def _first_only(self, fn: Callable) -> Callable:
        def zero_grad(ctx: Any, b: Any) -> None:
            if self._micro == 0:
                fn(ctx, b)
        return zero_grad

    def _scaled(self, fn: Callable) -> Callable:
        def backward(ctx: Any, b: Any) -> None:
            b.loss = b.loss / self.steps  # b.loss_value, the logged loss, stays the micro-batch's own
            fn(ctx, b)
        return backward

    def _last_only(self, fn: Callable) -> Callable:
        def optimizer(ctx: Any, b: Any) -> None:
            if self._micro == self.steps - 1:
                self._held = None
                fn(ctx, b)
            else:
                self._held = (fn, ctx, b)
        return optimizer

    # ------------------------------------------------------------------ the loop
    def step(self, batches: Iterator[Any]) -> list[tuple[Any, torch.Tensor, bool]]:
        """One optimizer step: up to ``steps`` micro-batches of ``batches``, each as
        ``(output, loss, is_padding)``. Data that ends inside a step ends it with the
        micro-batches trained (:meth:`_short_step`). StopIteration when none was left."""
        trained = []
        for micro in range(self.steps):
            self._micro = micro
            try:
                output = self.pipeline.progress(batches)
            except StopIteration:
                if not trained:
                    raise
                self._short_step(len(trained))
                break
            trained.append((output, self.pipeline.last_loss, self.pipeline.last_is_padding))
        self._micro = 0
        return trained

    def _short_step(self, trained: int) -> None:
        """The data ended after ``trained`` < ``steps`` micro-batches (every rank agrees: the
        pipeline's end of data is agreed): the dense optimizer steps on their mean gradient,
        as on a last batch of ``trained`` x ``data.batch_size`` samples. (The pipeline has
        released that batch's device copy by then: ``after_optimizer_step`` gets None.)"""
        fn, ctx, b = self._held
        self._held = None
        for p in dense_params(ctx.optimizer):
            if p.grad is not None:  # once, at the end of data: a loop of in-place products
                p.grad.mul_(self.steps / trained)
        fn(ctx, b)
