"""Click-prediction metrics, synced over all ranks by torchmetrics, without a host sync.

``ClickMetrics.compute()`` / ``compute_async()`` are collective: every metric state is
a fixed-size sum, so torchmetrics' sync runs one all-reduce per state (its
``dist_sync_fn``, here :func:`all_reduce_as_gather`) instead of its default
all-gather, which first compares the ranks' state shapes on the host. Every rank
must call them at the same step (the trainer does, at its log and eval points) and
every rank gets the global values. ``update`` queues device work only, so the
trainer can log without draining its pipeline: it starts ``compute_async()`` at a
log point and reads the result (``PendingMetrics.result()``) one log interval later,
when the device has long finished.

Samples with loss weight 0 (padding batches of ranks whose data ran out) do not
count.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
import torch.distributed as dist
from torchmetrics import Metric

__all__ = ["BinnedAUROC", "ClickMetrics", "HostCopy", "NormalizedEntropy", "PendingMetrics", "all_reduce_as_gather", "click_outputs"]


def all_reduce_as_gather(tensor: torch.Tensor, group: object = None) -> list[torch.Tensor]:
    """A torchmetrics ``dist_sync_fn`` for states reduced by sum: returns the sum over
    the ranks as a one-element "gather" (torchmetrics stacks the list and sums it).
    One all-reduce, queued on the device; no host sync, unlike the default gather."""
    reduced = tensor.clone()
    dist.all_reduce(reduced, group=group)
    return [reduced]


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
    beats always predicting the base rate; and the accuracy at threshold 0.5 (the
    value of torchmetrics' ``BinaryAccuracy`` on the counted samples, without its
    host-side checks of the label values). Takes logits (for a stable BCE) and
    per-sample weights (0 = not counted; BCE and NE are weighted, accuracy counts
    each counted sample once, as ``BinaryAccuracy`` with ``ignore_index`` does)."""

    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        for name in ("bce_sum", "positives", "count", "correct", "counted"):
            self.add_state(name, torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> None:
        weights, labels = weights.double(), labels.double()
        bce = F.binary_cross_entropy_with_logits(logits.double(), labels, reduction="none")
        self.bce_sum += (bce * weights).sum()
        self.positives += (labels * weights).sum()
        self.count += weights.sum()
        keep = weights > 0
        predicted = torch.sigmoid(logits.float()) > 0.5  # BinaryAccuracy's threshold on probabilities
        self.correct += ((predicted == (labels > 0.5)) & keep).sum()
        self.counted += keep.sum()

    def compute(self) -> dict[str, torch.Tensor]:
        count = self.count.clamp(min=1.0)
        bce = self.bce_sum / count
        p = (self.positives / count).clamp(1e-12, 1 - 1e-12)
        entropy = -(p * p.log() + (1 - p) * (1 - p).log())
        accuracy = (self.correct / self.counted.clamp(min=1.0)).float()
        return {"accuracy": accuracy, "bce": bce, "ne": bce / entropy}


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


class HostCopy:
    """A device tensor on its way to the host: queued as a non-blocking copy into
    pinned memory; ``wait()`` returns the host tensor (at once when the device has
    finished the work queued before the copy). On CPU the tensor itself."""

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.is_cuda:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._done: torch.cuda.Event | None = torch.cuda.Event()
            self._done.record()
        else:
            self._host, self._done = tensor, None

    def wait(self) -> torch.Tensor:
        if self._done is not None:
            self._done.synchronize()
        return self._host


class PendingMetrics:
    """Named metric values on their way to the host (``result()``: see HostCopy)."""

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        self.names = list(values)
        self._copy = HostCopy(torch.stack([v.double() for v in values.values()]))

    def result(self) -> dict[str, float]:
        return dict(zip(self.names, self._copy.wait().tolist()))


class ClickMetrics:
    """AUC, accuracy, BCE and NE of click logits, over all ranks.

    AUC is binned (``_AUC_BINS`` thresholds): its state has a fixed size, so it does
    not grow with the evaluation and every rank reduces the same shape, even a rank
    that saw only padding. The binning error is far below the run-to-run noise.
    """

    def __init__(self, device: torch.device) -> None:
        sync = all_reduce_as_gather if dist.is_available() and dist.is_initialized() else None
        options = {"dist_sync_fn": sync} if sync is not None else {}
        self.auc = BinnedAUROC(_AUC_BINS, **options).to(device)
        self.entropy = NormalizedEntropy(**options).to(device)

    def update(self, logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> None:
        """Device work only (no host sync): the trainer may call it at any step."""
        self.auc.update(torch.sigmoid(logits.float()), labels, weights > 0)
        self.entropy.update(logits, labels, weights)

    def compute_async(self) -> PendingMetrics:
        """Collective: every rank calls it at the same point. Queues the all-reduces
        and the metric math; the values reach the host without blocking it."""
        return PendingMetrics({"auc": self.auc.compute(), **self.entropy.compute()})

    def compute(self) -> dict[str, float]:
        """Collective: ``compute_async().result()`` (waits for the device)."""
        return self.compute_async().result()

    def reset(self) -> None:
        self.auc.reset()
        self.entropy.reset()


_AUC_BINS = 1000
