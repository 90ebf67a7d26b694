"""Click-prediction metrics, synced over all ranks by torchmetrics.

``ClickMetrics.compute()`` is collective: torchmetrics all-gathers every metric's
state over the default process group, so every rank must call it at the same step
(the trainer does, at its log and eval points) and every rank gets the global value.

Samples with loss weight 0 (padding batches of ranks whose data ran out) do not
count: they reach torchmetrics with the ignored target value.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC

__all__ = ["ClickMetrics", "NormalizedEntropy", "click_outputs"]


def _part(output: object, index: int, name: str) -> object:
    if isinstance(output, (tuple, list)):
        return output[index] if len(output) > index else None
    if isinstance(output, dict):
        return output.get(name)
    return getattr(output, name, None)


def click_outputs(output: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """``(logits, labels, weights or None)`` from a model's output, or None when the
    output does not follow the metrics contract (docs/models.md): a tuple
    ``(loss, logits, labels[, weights])`` as TorchRec's DLRMTrain returns, or a dict
    or object with ``logits`` and ``labels`` (and optionally per-sample ``weights``,
    0 = not counted), every one a tensor of shape [B]."""
    logits, labels = _part(output, 1, "logits"), _part(output, 2, "labels")
    weights = _part(output, 3, "weights")
    tensors = [t for t in (logits, labels, weights) if t is not None]
    if logits is None or labels is None or not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    if logits.dim() != 1 or any(t.shape != logits.shape for t in tensors):
        return None
    return logits, labels, weights


class NormalizedEntropy(Metric):
    """Mean BCE and normalized entropy NE = BCE / H(p), where p is the base rate
    (fraction of positive labels) and H the binary entropy: NE < 1 means the model
    beats always predicting the base rate. Takes logits (for a stable BCE) and
    per-sample weights (0 = not counted)."""

    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        for name in ("bce_sum", "positives", "count"):
            self.add_state(name, torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor) -> None:
        keep, labels = keep.double(), labels.double()
        bce = F.binary_cross_entropy_with_logits(logits.double(), labels, reduction="none")
        self.bce_sum += (bce * keep).sum()
        self.positives += (labels * keep).sum()
        self.count += keep.sum()

    def compute(self) -> dict[str, torch.Tensor]:
        count = self.count.clamp(min=1.0)
        bce = self.bce_sum / count
        p = (self.positives / count).clamp(1e-12, 1 - 1e-12)
        entropy = -(p * p.log() + (1 - p) * (1 - p).log())
        return {"bce": bce, "ne": bce / entropy}


class ClickMetrics:
    """AUC, accuracy, BCE and NE of click logits, over all ranks.

    AUC is binned (``_AUC_BINS`` thresholds): its state has a fixed size, so it does
    not grow with the evaluation and every rank all-gathers the same shape, even a
    rank that saw only padding. The binning error is far below the run-to-run noise.
    """

    def __init__(self, device: torch.device) -> None:
        self.ranking = MetricCollection(
            {
                "auc": BinaryAUROC(thresholds=_AUC_BINS, ignore_index=_IGNORE),
                "accuracy": BinaryAccuracy(ignore_index=_IGNORE),
            }
        ).to(device)
        self.entropy = NormalizedEntropy().to(device)

    def update(self, logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> None:
        """host sync: torchmetrics checks the label values and drops ignored samples
        by boolean indexing, so the trainer calls this once per log interval (on the
        interval's steps concatenated), not once per training step."""
        keep = weights > 0
        targets = torch.where(keep, labels.long(), _IGNORE)
        # Probabilities, not logits: BinaryAccuracy applies a sigmoid only if some
        # value lies outside [0, 1], which logits near 0 need not.
        self.ranking.update(torch.sigmoid(logits.float()), targets)
        self.entropy.update(logits, labels, keep)

    def compute(self) -> dict[str, float]:
        """Collective: every rank calls it at the same point and gets the global values."""
        values = {**self.ranking.compute(), **self.entropy.compute()}
        return {name: float(value) for name, value in values.items()}

    def reset(self) -> None:
        self.ranking.reset()
        self.entropy.reset()


_AUC_BINS = 1000
_IGNORE = -1  # target value of padding samples (loss weight 0)
