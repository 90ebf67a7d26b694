"""The scheduled learning rates (``optimizer.*.schedule``, :mod:`recpipe.lr_schedule`),
written into the optimizers before each step.

``LearningRates.set_step(step)`` runs on the host before the pipeline trains batch
``step``; every pipeline runs a batch's backward and dense optimizer step within the
``progress`` call that returns it, so the dense rate set before the call is the rate of
that batch's dense update, whatever the schedule of the pipeline. Nothing is written
when a rate did not change.

Where each rate goes:

* dense optimizer (torch.optim inside torchrec's wrappers): SGD and Adagrad with a
  schedule hold ``lr`` as a device tensor (``recpipe.sharding.build.dense_optimizer``),
  filled here (``fill_``: one small kernel on the current stream, no host sync). Their
  steps read it on the device, so a captured step (``pipeline.cuda_graphs``'s graphed
  optimizer, ``pipeline.step_graph``) replays with the rate of the step. Adam's ``lr``
  is a float, set on the host.
* embedding optimizer (FBGEMM's, fused into the TBE backward): FBGEMM keeps the rate
  in a host tensor (``set_learning_rate``) and reads it when a batch is looked up: the
  lookup's autograd node holds it for that batch's fused update (fbgemm-gpu 1.8:
  ``learning_rate_tensor.item()`` in the lookup function). Pipelines that look up batch
  i+1 while training batch i (``fused_sparse_dist``, ``semi_sync``) therefore need the
  rate of batch i+1 set before that lookup, not before step i+1. With an embedding
  schedule a forward pre-hook on every FBGEMM training TBE of the model (printable,
  removed by :meth:`LearningRates.remove`) sets the rate of the batch it looks up:
  lookups with autograd on come in batch order, one per batch and TBE, counted from
  the step ``set_step`` names (a lookup replayed inside a CUDA graph runs no hook, so
  each ``set_step`` moves the count up to its step). ``set_step`` also writes the rate
  into the fused optimizers' param groups, which torchrec hands FBGEMM in ``zero_grad``
  and ``step`` and ``pipeline.step_graph`` compares with its capture: FBGEMM reads the
  rate on the host (fbgemm-gpu 1.8, and FBGEMM's main branch, which requires the tensor
  on the CPU), so a CUDA graph keeps the rate it was captured with, and the step graph
  runs a step at another embedding rate eagerly (``recpipe.speedups.step_graph``).

A checkpoint needs nothing of this: the rates are a function of the step, which the
checkpoint holds, and the optimizers' param_groups are not saved.
"""

from __future__ import annotations

from typing import Any

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

from recpipe.config import OptimizerConfig
from recpipe.runtime.sharded import all_modules
from recpipe.speedups.optimizer_graph import fused_optimizers, torch_optimizers

__all__ = ["LearningRates"]


class LearningRates:
    """The dense and embedding rates of the ``optimizer`` section's schedules (``schedules``),
    for ``optimizer`` (the pipeline's CombinedOptimizer) and the TBEs of ``model``."""

    def __init__(self, schedules: OptimizerConfig, optimizer: Any, model: torch.nn.Module) -> None:
        self.dense_cfg, self.embedding_cfg = schedules.dense, schedules.embedding
        self._dense = torch_optimizers(optimizer)
        self._fused = fused_optimizers(optimizer)
        self.dense: float | None = None  # the rates last set
        self.embedding: float | None = None
        self._next_lookup: dict[int, int] = {}  # TBE id -> the step of its next lookup
        self._hooks = []
        if not self.embedding_cfg.schedule.constant:
            for module in all_modules(model):
                if isinstance(module, SplitTableBatchedEmbeddingBagsCodegen):
                    self._next_lookup[id(module)] = 1
                    self._hooks.append(module.register_forward_pre_hook(self._before_lookup))

    def __repr__(self) -> str:
        def shown(schedule):
            return ", ".join(f"{k}={v}" for k, v in schedule.model_dump(exclude_defaults=True).items()) or "constant"

        hooks = (f"; the rate set at each lookup of {len(self._hooks)} TBE{'s' if len(self._hooks) != 1 else ''}"
                 if self._hooks else "")
        return (f"learning rates: dense {self.dense_cfg.lr} ({shown(self.dense_cfg.schedule)}), embedding "
                f"{self.embedding_cfg.lr} ({shown(self.embedding_cfg.schedule)}){hooks} (recpipe.train.learning_rates)")

    @property
    def constant(self) -> bool:
        """Whether both rates are their ``lr`` at every step."""
        return self.dense_cfg.schedule.constant and self.embedding_cfg.schedule.constant

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def set_step(self, step: int) -> None:
        """Host only, before the pipeline trains batch ``step`` (1-based): its dense rate into
        the dense optimizers, its embedding rate into the fused optimizers' param groups."""
        dense = self.dense_cfg.schedule.rate(self.dense_cfg.lr, step)
        if dense != self.dense:
            self.dense = dense
            for opt in self._dense:
                for group in opt.param_groups:
                    if isinstance(group["lr"], torch.Tensor):
                        group["lr"].fill_(dense)
                    else:
                        group["lr"] = dense
        embedding = self.embedding_cfg.schedule.rate(self.embedding_cfg.lr, step)
        if embedding != self.embedding:
            self.embedding = embedding
            for opt in self._fused:
                for group in opt.param_groups:
                    group["lr"] = embedding
        for tbe, upcoming in self._next_lookup.items():  # batch `step` is looked up in this step or was before
            self._next_lookup[tbe] = max(upcoming, step)

    def _before_lookup(self, tbe: torch.nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():  # an evaluation's lookup: no update follows
            return
        step = self._next_lookup[id(tbe)]
        self._next_lookup[id(tbe)] = step + 1
        tbe.set_learning_rate(self.embedding_cfg.schedule.rate(self.embedding_cfg.lr, step))

    def scalars(self, step: int) -> dict[str, float]:
        """The rates of batch ``step``, for TensorBoard (host values: no sync)."""
        out = {}
        if self._dense:
            out["lr/dense"] = self.dense_cfg.schedule.rate(self.dense_cfg.lr, step)
        if self._fused:
            out["lr/embedding"] = self.embedding_cfg.schedule.rate(self.embedding_cfg.lr, step)
        return out
