"""recpipe.train.metrics: the histogram AUROC is torchmetrics' binned AUROC, faster."""

from __future__ import annotations

import pytest
import torch
from torchmetrics.classification import BinaryAUROC

from recpipe.train.metrics import BinnedAUROC


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
