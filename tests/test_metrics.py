"""recpipe.train.metrics: the histogram AUROC is torchmetrics' binned AUROC, faster; NE, log
loss, calibration, CTR and accuracy are TorchRec's (torchrec.metrics) values, by their formulas;
everything is reduced over ranks by all-reduce (no host sync), as if one process had seen every
sample; the window values are those of the last interval."""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional as F
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC

from recpipe.train.metrics import BinnedAUROC, ClickMetrics


@pytest.mark.parametrize("samples", [1000, 20_000])
def test_binned_auroc_equals_torchmetrics(samples):
    g = torch.Generator().manual_seed(samples)
    labels = torch.randint(0, 2, (samples,), generator=g)
    preds = torch.sigmoid(torch.randn(samples, generator=g) + labels)  # informative, ties at the bin edges too
    preds[:50] = torch.linspace(0, 1, 1000)[torch.randint(0, 1000, (50,), generator=g)]
    keep = torch.rand(samples, generator=g) > 0.1  # padding samples are not counted
    reference = BinaryAUROC(thresholds=1000, ignore_index=-1)
    reference.update(preds, torch.where(keep, labels, -1))
    ours = BinnedAUROC(1000)
    half = samples // 2  # two updates accumulate like one
    ours.update(preds[:half], labels[:half].float(), keep[:half])
    ours.update(preds[half:], labels[half:].float(), keep[half:])
    assert torch.equal(ours.compute(), reference.compute())
    assert 0.6 < ours.compute().item() < 0.8


def _clicks(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (samples,), generator=g).float()
    logits = torch.randn(samples, generator=g) + 2 * labels - 1
    weights = (torch.rand(samples, generator=g) > 0.2).float()  # 0 = padding, not counted
    return logits, labels, weights


def _torchrec(samples_of, logits, labels, weights) -> dict[str, float]:
    """TorchRec's metrics of one process on (logits, labels, weights), directly."""
    from torchrec.metrics.accuracy import AccuracyMetric
    from torchrec.metrics.calibration import CalibrationMetric
    from torchrec.metrics.ctr import CTRMetric
    from torchrec.metrics.metrics_config import RecTaskInfo
    from torchrec.metrics.ne import NEMetric

    task = RecTaskInfo(name="t", label_name="l", prediction_name="p", weight_name="w")
    kw = dict(world_size=1, my_rank=0, batch_size=1, tasks=[task], window_size=samples_of)
    out = {}
    for metric in (NEMetric(**kw, include_logloss=True), CalibrationMetric(**kw), CTRMetric(**kw), AccuracyMetric(**kw)):
        metric.update(predictions={"t": torch.sigmoid(logits)}, labels={"t": labels}, weights={"t": weights})
        out.update({k.rpartition("|")[2].removeprefix("lifetime_"): v.item() for k, v in metric.compute().items()
                    if "|lifetime_" in k})
    return out


def test_click_metrics_are_torchrecs_and_torchmetrics_values():
    logits, labels, weights = _clicks(30_000, seed=3)
    keep = weights > 0
    ours = ClickMetrics(torch.device("cpu"))
    ours.update(logits[:10_000], labels[:10_000], weights[:10_000])  # two updates accumulate like one
    ours.update(logits[10_000:], labels[10_000:], weights[10_000:])
    pending = ours.compute_async()
    values = pending.result()
    targets = torch.where(keep, labels.long(), -1)
    auc = BinaryAUROC(thresholds=1000, ignore_index=-1)(torch.sigmoid(logits), targets)
    assert values["auc"] == auc.item()
    theirs = _torchrec(30_000, logits, labels, weights)
    assert set(values) == {"auc", "ne", "logloss", "calibration", "ctr", "accuracy"}
    for name in ("ne", "logloss", "calibration", "ctr", "accuracy"):  # float32 states: two updates round differently
        assert values[name] == pytest.approx(theirs[name], rel=1e-6), name
    # the formulas, on the counted samples: log loss in bits, NE = log loss / entropy of the base rate
    bce = F.binary_cross_entropy_with_logits(logits[keep].double(), labels[keep].double())
    p = labels[keep].double().mean()
    assert values["logloss"] == pytest.approx(bce.item() / math.log(2), rel=1e-6)
    assert values["ne"] == pytest.approx((bce / -(p * p.log() + (1 - p) * (1 - p).log())).item(), rel=1e-6)
    assert values["ctr"] == pytest.approx(p.item(), rel=1e-12)
    assert values["calibration"] == pytest.approx(torch.sigmoid(logits[keep].double()).sum().item() / labels[keep].sum().item(), rel=1e-6)
    accuracy = BinaryAccuracy(ignore_index=-1)(torch.sigmoid(logits), targets)
    assert values["accuracy"] == pytest.approx(accuracy.item(), rel=1e-6)
    assert 0.7 < values["auc"] < 0.95 and 0.6 < values["accuracy"] < 0.9
    assert ours.compute() == values


def test_window_values_are_the_last_interval_and_lifetime_values_everything():
    logits, labels, weights = _clicks(3000, seed=4)
    metrics = ClickMetrics(torch.device("cpu"), window_samples=1000)
    for k in range(3):  # three intervals of 1000 samples
        part = slice(1000 * k, 1000 * (k + 1))
        metrics.update(logits[part], labels[part], weights[part])
        values = metrics.compute()
    last, whole = ClickMetrics(torch.device("cpu")), ClickMetrics(torch.device("cpu"))
    last.update(logits[2000:], labels[2000:], weights[2000:])
    whole.update(logits, labels, weights)
    last, whole = last.compute(), whole.compute()
    for name in ("auc", "ne", "logloss", "calibration", "ctr", "accuracy"):
        assert values[name] == pytest.approx(last[name], rel=1e-9), name
        assert values[f"{name}_lifetime"] == pytest.approx(whole[name], rel=1e-9), name
    assert values["ne"] != values["ne_lifetime"]


def _rank_metrics(rank: int, init: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        logits, labels, weights = _clicks(4096, seed=5)
        part = slice(0, 1000) if rank == 0 else slice(1000, 4096)  # unequal parts
        metrics = ClickMetrics(torch.device("cpu"))
        metrics.update(logits[part], labels[part], weights[part])
        results[rank] = metrics.compute_async().result()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_click_metrics_reduce_over_ranks_like_one_process():
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "init")
        with mp.Manager() as manager:
            results = manager.dict()
            mp.spawn(_rank_metrics, args=(init, results), nprocs=2)
            per_rank = dict(results)
    whole = ClickMetrics(torch.device("cpu"))
    whole.update(*_clicks(4096, seed=5))
    expected = whole.compute()
    for rank in (0, 1):
        assert per_rank[rank]["auc"] == expected["auc"]
        # sums in another order: NE and log loss (float64 states) 1e-10 apart, calibration (float32) 1e-7
        for name in ("ne", "logloss", "calibration", "ctr", "accuracy"):
            assert per_rank[rank][name] == pytest.approx(expected[name], rel=1e-8 if name in ("ne", "logloss") else 1e-6), name


def test_click_metrics_compute_under_torchmetrics_that_squeezes_every_result(monkeypatch):
    """torchmetrics >= 1.x squeezes what a metric's ``compute`` returns through lightning's
    ``apply_to_collection``, which refuses the frozen ``MetricComputationReport`` that
    TorchRec's metric computations return (torchrec 1.6.1 - 1.8 with torchmetrics 1.9: every
    compute raised). Reproduced here on the installed torchmetrics; recpipe's ClickMetrics
    computes TorchRec's metrics without that squeeze."""
    import torchmetrics.metric
    from lightning_utilities.core.apply_func import apply_to_collection

    monkeypatch.setattr(torchmetrics.metric, "_squeeze_if_scalar",
                        lambda data: apply_to_collection(data, torch.Tensor, lambda t: t.squeeze() if t.numel() == 1 else t))
    g = torch.Generator().manual_seed(3)
    metrics = ClickMetrics(torch.device("cpu"), window_samples=64)
    logits, labels = torch.randn(64, generator=g), torch.randint(0, 2, (64,), generator=g).float()
    metrics.update(logits, labels, torch.ones(64))
    values = metrics.compute()
    assert {"ne", "logloss", "calibration", "ctr", "auc"} <= set(values) and all(math.isfinite(v) for v in values.values())
