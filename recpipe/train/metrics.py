"""Click-prediction metrics over all ranks: TorchRec's ``torchrec.metrics`` for NE, log loss,
calibration, CTR and accuracy, recpipe's binned AUC; reduced without a host sync.

``ClickMetrics`` holds TorchRec's ``NEMetric`` (with its log loss), ``CalibrationMetric``,
``CTRMetric`` and ``AccuracyMetric`` on one task (``click``), so the values are TorchRec's,
by its formulas (NE and log loss in bits, as TorchRec computes them), with its lifetime and
window values. Their states are fixed-size sums; recpipe passes
:func:`all_reduce_as_gather` as their torchmetrics ``dist_sync_fn``, so a compute is one
all-reduce per state, queued on the device, instead of torchmetrics' default all-gather,
which first compares the ranks' state shapes on the host.

AUC is binned (:class:`BinnedAUROC`, 1000 thresholds, torchmetrics' binned AUROC value):
its state is 16 KiB whatever the number of samples, reduced like a sum. TorchRec's
``AUCMetric`` is exact over a window: it keeps every prediction, label and weight of the
window and syncs them with torchmetrics' ``gather_all_tensors`` (the ranks' sizes on the
host first: a host sync). On one log interval of predictions the binned AUC agrees
closely with the exact one, keeps a fixed few KiB where the exact one keeps every
prediction (an evaluation over a Criteo day would hold gigabytes per rank), and updates
and computes faster (benchmarks/results/cpu/auc_binned_vs_exact.md, made by
benchmarks/studies/auc_binned_vs_exact.py).

``compute_values()`` / ``compute_async()`` are collective: every rank calls them at the same
step (the trainer does, at its log and eval points) and every rank gets the global values.
``update`` queues device work only, so the trainer can log without draining its pipeline: it
starts the compute at a log point and reads the result (``PendingMetrics.result()``) one log
interval later, when the device has long finished.

Samples with loss weight 0 (padding batches of ranks whose data ran out) do not count.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torchmetrics import Metric

from recpipe.compat import torchrec as compat_torchrec

__all__ = ["BinnedAUROC", "ClickMetrics", "HostCopy", "METRICS", "PendingMetrics", "all_reduce_as_gather", "click_outputs"]


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
        # index_add_, not bincount: CUDA's bincount reads the largest index on the host to size its output.
        self.hist.view(-1).index_add_(0, index, weight.double())

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


# TorchRec's metrics of a click, by the name recpipe reports them under.
METRICS = ("auc", "ne", "logloss", "calibration", "ctr", "accuracy")
TASK = "click"


class ClickMetrics:
    """AUC, NE, log loss, calibration, CTR and accuracy of click logits, over all ranks (see
    the module docstring). ``window_samples``: also window values, TorchRec's window of the
    last ``window_samples`` samples of each rank (the trainer: one log interval); the lifetime
    values then carry the suffix ``_lifetime``, and the window AUC is that of the samples since
    the previous compute. Without it, the values are the lifetime ones, under plain names."""

    def __init__(self, device: torch.device, window_samples: int | None = None) -> None:
        # torchrec.metrics loads all of torchrec and FBGEMM: imported here, so that this module
        # (METRICS, HostCopy) imports without them
        from torchrec.metrics.accuracy import AccuracyMetric
        from torchrec.metrics.calibration import CalibrationMetric
        from torchrec.metrics.ctr import CTRMetric
        from torchrec.metrics.metrics_config import RecTaskInfo
        from torchrec.metrics.ne import NEMetric

        distributed = dist.is_available() and dist.is_initialized()
        world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
        options = {"dist_sync_fn": all_reduce_as_gather} if distributed else {}
        self.windowed = window_samples is not None
        task = RecTaskInfo(name=TASK, label_name="label", prediction_name="prediction", weight_name="weight")
        common = dict(world_size=world, my_rank=rank, batch_size=1, tasks=[task], compute_on_all_ranks=True,
                      window_size=(window_samples or 1) * world, **options)  # TorchRec divides it by the ranks
        self.torchrec = [NEMetric(**common, include_logloss=True), CalibrationMetric(**common), CTRMetric(**common),
                         AccuracyMetric(**common)]
        for metric in self.torchrec:
            metric.to(device)
            for computation in compat_torchrec.metric_computations(metric):
                _compute_unsqueezed(computation)
        self.auc = BinnedAUROC(_AUC_BINS, **options).to(device)
        self.window_auc = BinnedAUROC(_AUC_BINS, **options).to(device) if self.windowed else None

    def update(self, logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> None:
        """Device work only (no host sync): the trainer may call it at any step."""
        predictions = torch.sigmoid(logits.float())
        for metric in self.torchrec:
            metric.update(predictions={TASK: predictions}, labels={TASK: labels.float()},
                          weights={TASK: weights.float()})
        for auc in (self.auc, self.window_auc):
            if auc is not None:
                auc.update(predictions, labels, weights > 0)

    def compute_values(self) -> dict[str, torch.Tensor]:
        """Collective: the metrics as device tensors (all-reduces and math queued, nothing
        read); resets the window AUC."""
        values: dict[str, torch.Tensor] = {}
        for metric in self.torchrec:
            for key, value in metric.compute().items():  # "ne-click|window_ne", "ne-click|lifetime_logloss", ...
                prefix, _, name = key.rpartition("|")[2].partition("_")
                if prefix == "lifetime":
                    values[f"{name}_lifetime" if self.windowed else name] = value.reshape(())
                elif self.windowed:
                    values[name] = value.reshape(())
        values["auc_lifetime" if self.windowed else "auc"] = self.auc.compute()
        if self.window_auc is not None:
            values["auc"] = self.window_auc.compute()
            self.window_auc.reset()
        return values

    def compute_async(self) -> PendingMetrics:
        """Collective: every rank calls it at the same point. The values reach the host without blocking it."""
        return PendingMetrics(self.compute_values())

    def compute(self) -> dict[str, float]:
        """Collective: ``compute_async().result()`` (waits for the device)."""
        return self.compute_async().result()

    def reset(self) -> None:
        for metric in self.torchrec:
            metric.reset()
        self.auc.reset()
        if self.window_auc is not None:
            self.window_auc.reset()


def _compute_unsqueezed(computation: Any) -> None:
    """``computation.compute`` (a TorchRec metric computation, a torchmetrics ``Metric``) as
    torchmetrics' own wrapper runs it, synchronized over the ranks, but without the wrapper's
    squeeze of the result: torchmetrics 1.9 squeezes every result through lightning's
    ``apply_to_collection``, which refuses the frozen ``MetricComputationReport`` that
    TorchRec's computations return (torchrec 1.6.1 to 1.8: every compute raised
    ``ValueError: A frozen dataclass was passed to apply_to_collection``); torchmetrics 1.0.3,
    torchrec's pin, does not. The reports hold tensors that need no squeeze."""
    unwrapped = type(computation).compute.__get__(computation)

    def compute() -> Any:
        with computation.sync_context(dist_sync_fn=computation.dist_sync_fn):
            return unwrapped()

    computation.compute = compute


_AUC_BINS = 1000
