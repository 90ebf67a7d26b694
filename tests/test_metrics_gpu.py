"""The click metrics on CUDA (TorchRec's NE, log loss, calibration, CTR, accuracy and
recpipe's binned AUC): an update and a compute queue device work only, with no host sync
(torch's sync debug mode set to error), on 1 and 2 GPUs (NCCL all-reduces); the values reach
the host through PendingMetrics and equal the CPU computation."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipeline_harness import small_config
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from recpipe.train.metrics import ClickMetrics

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _clicks(samples: int, seed: int, device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (samples,), generator=g).float()
    logits = torch.randn(samples, generator=g) + 2 * labels - 1
    weights = (torch.rand(samples, generator=g) > 0.2).float()
    return tuple(t.to(device) for t in (logits, labels, weights))


def _worker(cfg, expected: dict[str, float]) -> None:
    device = init_process_group(cfg)
    rank = dist.get_rank()
    metrics = ClickMetrics(device, window_samples=8192)
    batches = [_clicks(8192, seed=10 * step + rank, device=device) for step in range(3)]
    metrics.update(*batches[0])  # the first update and compute create what they create lazily
    metrics.compute_values()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches[1:]:
            metrics.update(*batch)
            pending = metrics.compute_async()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    values = pending.result()
    for name, value in expected.items():  # the window: the last interval of every rank
        assert values[name] == pytest.approx(value, rel=1e-5), name


@pytest.mark.parametrize("nproc", [1, 2])
def test_click_metrics_make_no_host_sync_on_cuda(nproc):
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    reference = ClickMetrics(torch.device("cpu"))  # no process group here: one process, every rank's samples
    for rank in range(nproc):
        reference.update(*_clicks(8192, seed=20 + rank, device="cpu"))
    launch_local(_worker, nproc, small_config(nproc, ["distributed.backend=nccl"]), reference.compute())
