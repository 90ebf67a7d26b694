"""recpipe.train.metrics: the histogram AUROC is torchmetrics' binned AUROC, faster; the
click metrics are torchmetrics' values, reduced over ranks by all-reduce (no host sync)."""

from __future__ import annotations

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


def test_click_metrics_are_torchmetrics_values():
    logits, labels, weights = _clicks(30_000, seed=3)
    keep = weights > 0
    ours = ClickMetrics(torch.device("cpu"))
    ours.update(logits[:10_000], labels[:10_000], weights[:10_000])  # two updates accumulate like one
    ours.update(logits[10_000:], labels[10_000:], weights[10_000:])
    pending = ours.compute_async()
    values = pending.result()
    targets = torch.where(keep, labels.long(), -1)
    accuracy = BinaryAccuracy(ignore_index=-1)(torch.sigmoid(logits), targets)
    auc = BinaryAUROC(thresholds=1000, ignore_index=-1)(torch.sigmoid(logits), targets)
    bce = F.binary_cross_entropy_with_logits(logits[keep].double(), labels[keep].double())
    p = labels[keep].double().mean()
    assert values["accuracy"] == accuracy.item()
    assert values["auc"] == auc.item()
    assert values["bce"] == pytest.approx(bce.item(), rel=1e-12)
    assert values["ne"] == pytest.approx((bce / -(p * p.log() + (1 - p) * (1 - p).log())).item(), rel=1e-12)
    assert 0.7 < values["auc"] < 0.95 and 0.6 < values["accuracy"] < 0.9
    assert ours.compute() == values


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
        assert per_rank[rank]["auc"] == expected["auc"] and per_rank[rank]["accuracy"] == expected["accuracy"]
        assert per_rank[rank]["bce"] == pytest.approx(expected["bce"], rel=1e-12)
        assert per_rank[rank]["ne"] == pytest.approx(expected["ne"], rel=1e-12)
