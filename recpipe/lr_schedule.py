"""Learning-rate schedules: ``optimizer.dense.schedule`` and ``optimizer.embedding.schedule``.

A schedule is a pure function of the step: :meth:`LRSchedule.rate` gives the rate of the
update made from batch ``step`` (1 = the first batch trained), so a resumed run sets
exactly the rates an uninterrupted one would (the step is in the checkpoint), and
nothing about a schedule is saved. ``recpipe.train.learning_rates`` writes the rates
into the optimizers before each step.

The shapes are those of MLPerf DLRM's reference, ``LRPolicyScheduler``
(facebookresearch/dlrm ``dlrm_s_pytorch.py``, kept as ``torchrec_dlrm/lr_scheduler.py``
in MLPerf's DLRM-DCNv2 reference), whose ``_step_count`` is this ``step``:

* warm-up, for ``step < warmup_steps``: ``lr * (1 - (warmup_steps - step) / warmup_steps)``;
* polynomial decay, for ``decay_start_step <= step < decay_start_step + decay_steps``:
  ``max(end_lr, lr * ((decay_steps - (step - decay_start_step)) / decay_steps) ** power)``
  (the reference: power 2, end_lr 1e-7);
* elsewhere, with a polynomial decay configured, the rate holds its last warm-up or
  decay value, as the reference does: between a warm-up of W > 1 steps and the decay
  that is ``lr * (W - 1) / W``, after the decay the last decayed rate. Without a decay
  the rate after the warm-up is ``lr``.

Step decay (torch's ``StepLR`` shape, which the reference does not have): from
``decay_start_step`` on, ``max(end_lr, lr * gamma ** (1 + (step - decay_start_step) // step_size))``:
multiplied by ``gamma`` at ``decay_start_step`` and again every ``step_size`` steps; after a
warm-up and before the decay, ``lr``.

This module imports pydantic only (the config's ground floor).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from recpipe.sections import Section

__all__ = ["LRSchedule"]


class LRSchedule(Section):
    # Linear warm-up from lr / warmup_steps to lr over the first steps (0 = none).
    warmup_steps: int = Field(0, ge=0)
    # none: lr after the warm-up; polynomial: MLPerf DLRM's decay (power, end_lr);
    # step: times gamma at decay_start_step and every step_size steps after it.
    decay: Literal["none", "polynomial", "step"] = "none"
    decay_start_step: int = Field(0, ge=0, description="the first step of the decay (>= warmup_steps)")
    decay_steps: int = Field(0, ge=0, description="polynomial: the steps the decay takes")
    power: float = Field(2.0, gt=0, description="polynomial: the decay's exponent (MLPerf DLRM: 2)")
    end_lr: float = Field(1e-7, ge=0, description="the decayed rate never goes below it (MLPerf DLRM: 1e-7)")
    step_size: int = Field(1000, gt=0, description="step: steps between two multiplications by gamma")
    gamma: float = Field(0.1, gt=0, le=1, description="step: the factor of each multiplication")

    @model_validator(mode="after")
    def _phases(self) -> "LRSchedule":
        if self.decay != "none" and self.decay_start_step < self.warmup_steps:
            raise ValueError(f"decay_start_step={self.decay_start_step} is before the warm-up ends "
                             f"(warmup_steps={self.warmup_steps}); the warm-up must finish before the decay starts")
        if self.decay == "polynomial" and self.decay_steps == 0:
            raise ValueError("decay='polynomial' needs decay_steps > 0 (the steps the decay takes)")
        return self

    @property
    def constant(self) -> bool:
        """Whether the rate is the optimizer's ``lr`` at every step."""
        return self.warmup_steps == 0 and self.decay == "none"

    def rate(self, lr: float, step: int) -> float:
        """The rate of the update made from batch ``step`` (1-based), for base rate ``lr``."""
        warmup, start = self.warmup_steps, self.decay_start_step
        if step < warmup:
            return lr * (1.0 - (warmup - step) / warmup)
        if self.decay == "step":
            if step < start:
                return lr
            return max(self.end_lr, lr * self.gamma ** (1 + (step - start) // self.step_size))
        if self.decay == "polynomial":
            end = start + self.decay_steps
            if start <= step < end:
                return max(self.end_lr, lr * ((self.decay_steps - (step - start)) / self.decay_steps) ** self.power)
            if step >= end:  # holds the last decayed rate
                return self.rate(lr, end - 1)
            if warmup > 1:  # between warm-up and decay: holds the last warm-up rate (step 1 is the first)
                return self.rate(lr, warmup - 1)
        return lr
