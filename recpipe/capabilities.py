"""What a pipeline offers its speed features: capabilities, by name.

A pipeline declares the capabilities it offers (``PipelineDef.offers``); a speed feature
states those it needs (``SpeedupDef.needs``). The builder (``recpipe.builder``) applies a
feature only to a pipeline that offers everything it needs, and ``recpipe.preflight``
refuses a configured feature that a pipeline cannot serve, naming the pipelines that can.
Neither side names the other: a new pipeline offers capabilities, a new speed feature asks
for them. This module imports nothing.
"""

from __future__ import annotations

__all__ = ["CAPABILITIES", "INTERCEPTS", "ONE_BATCH_PER_STEP", "PREFETCH_STEP"]

# Every step of a batch's training from its lookup to both optimizer updates runs in the
# call of ``progress()`` that trains it; only its copy and its input all-to-all run ahead.
# The whole step of one batch can then be replaced by one captured step.
ONE_BATCH_PER_STEP = "one_batch_per_step"

# A ``prefetch`` step that moves the next batch's rows into FBGEMM's UVM caches, whose
# TBEs lock cache lines until the batch's backward (FBGEMM's ``prefetch_pipeline`` mode).
PREFETCH_STEP = "prefetch_step"

# The pipeline hands the sharded modules inputs (or whole lookups) it prepared ahead of
# forward (``pipeline.inputs`` applies); without it the model runs its own sharded forward.
INTERCEPTS = "intercepts_sharded_modules"

CAPABILITIES = {
    ONE_BATCH_PER_STEP: "one batch's whole step runs in one call (only its copy and input all-to-all run ahead)",
    PREFETCH_STEP: "a UVM-cache prefetch step, with FBGEMM's cache-line locking",
    INTERCEPTS: "the sharded modules take inputs the pipeline prepared ahead of forward",
}
