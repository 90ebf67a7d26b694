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
from torchmetrics.classification import BinaryAccuracy

__all__ = ["BinnedAUROC", "ClickMetrics", "NormalizedEntropy", "click_outputs"]


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


class BinnedAUROC(Metric):
    """AUROC at ``num_thresholds`` evenly spaced thresholds in [0, 1]: the curve and
    the value of torchmetrics' ``BinaryAUROC(thresholds=num_thresholds)`` (same
    thresholds, same float32 ROC and trapezoid), from a weighted histogram of the
    predictions. An update is a few kernels whatever the threshold count; torchmetrics
    loops over the thresholds once an update has more than 50,000 samples (a
    trainer's log interval of 10 steps x 8192), about ten kernel launches per
    threshold, 10,000 per log. Takes probabilities, targets 0/1 and weights (0 =
    not counted), so padding samples need no boolean indexing (no host sync)."""

    full_state_update = False

    def __init__(self, num_thresholds: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_thresholds = num_thresholds
        # [negatives, positives] x bin k: k = how many thresholds are <= the prediction.
        self.add_state("hist", torch.zeros(2, num_thresholds + 1, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> None:
        t = self.num_thresholds
        thresholds = torch.linspace(0, 1, t, device=preds.device)  # as torchmetrics makes them
        bins = torch.bucketize(preds, thresholds, right=True)
        bins = torch.where(preds.isnan(), 0, bins)  # NaN >= threshold is false for every threshold
        index = bins + (t + 1) * target.long()
        self.hist += torch.bincount(index, weights=weight.double(), minlength=2 * (t + 1)).view(2, t + 1)

    def compute(self) -> torch.Tensor:
        t = self.num_thresholds
        neg, pos = self.hist[0], self.hist[1]
        # Samples predicted positive at threshold i are those in bins k > i.
        tps = pos.sum() - pos.cumsum(0)[:t]
        fps = neg.sum() - neg.cumsum(0)[:t]
        fns, tns = pos.sum() - tps, neg.sum() - fps
        tpr = _safe_divide(tps.float(), (tps + fns).float()).flip(0)
        fpr = _safe_divide(fps.float(), (fps + tns).float()).flip(0)
        return torch.trapz(tpr, fpr)


def _safe_divide(num: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
    return torch.where(denom != 0, num / denom, torch.zeros_like(num))


class ClickMetrics:
    """AUC, accuracy, BCE and NE of click logits, over all ranks.

    AUC is binned (``_AUC_BINS`` thresholds): its state has a fixed size, so it does
    not grow with the evaluation and every rank all-gathers the same shape, even a
    rank that saw only padding. The binning error is far below the run-to-run noise.
    """

    def __init__(self, device: torch.device) -> None:
        self.auc = BinnedAUROC(_AUC_BINS).to(device)
        self.ranking = MetricCollection({"accuracy": BinaryAccuracy(ignore_index=_IGNORE)}).to(device)
        self.entropy = NormalizedEntropy().to(device)

    def update(self, logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> None:
        """host sync: torchmetrics checks the label values and drops ignored samples
        by boolean indexing, so the trainer calls this once per log interval (on the
        interval's steps concatenated), not once per training step."""
        keep = weights > 0
        targets = torch.where(keep, labels.long(), _IGNORE)
        # Probabilities, not logits: BinaryAccuracy applies a sigmoid only if some
        # value lies outside [0, 1], which logits near 0 need not.
        probabilities = torch.sigmoid(logits.float())
        self.auc.update(probabilities, labels, keep)
        self.ranking.update(probabilities, targets)
        self.entropy.update(logits, labels, keep)

    def compute(self) -> dict[str, float]:
        """Collective: every rank calls it at the same point and gets the global values."""
        values = {"auc": self.auc.compute(), **self.ranking.compute(), **self.entropy.compute()}
        return {name: float(value) for name, value in values.items()}

    def reset(self) -> None:
        self.auc.reset()
        self.ranking.reset()
        self.entropy.reset()


_AUC_BINS = 1000
_IGNORE = -1  # target value of padding samples (loss weight 0)
