"""Every pipeline and speed feature, a few steps and an evaluation under torch's CUDA Stream
Sanitizer (``torch.cuda._sanitizer``, documented at pytorch.org/docs/stable/cuda._sanitizer.html):
it follows every kernel's reads and writes per stream and the events and waits between streams,
and raises on a tensor used on two streams without a synchronization. 0 reports. Batches are
made in the loop (``data.num_workers: 0``): the sanitizer starts CUDA in this process, and a
forked producer that inherits it cannot use CUDA (recpipe's never do; torch refuses them all).
What it cannot see: a CUDA graph's replay (one launch, no ops), and memory the caching allocator
reuses across streams (its trace ends a tensor when Python frees it): tests/test_full_speed_gpu.py
covers those by training at full speed."""

from __future__ import annotations

import pytest
import torch

from benchmarks.studies.full_speed import config, train
from test_full_speed_gpu import CASES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SMALL = [
    "train.device=cuda", "distributed.backend=nccl", "distributed.nproc=1",
    "model.num_embeddings_per_feature=[400,400,200,200]", "model.embedding_dim=16",
    "model.dense_arch_layer_sizes=[32,16]", "model.over_arch_layer_sizes=[64,1]",
    "data.source=synthetic", "data.batch_size=256", "data.synthetic.mean_pooling_factors=1.0",
    "data.synthetic.num_eval_batches=3", "sharding.default={type: table_wise, kernel: fused}", "sharding.tables={}",
    "train.log_every=4", "train.steps=10", "data.num_workers=0",
]


@pytest.fixture
def sanitizer():
    from torch.cuda import _sanitizer

    torch.cuda.synchronize()
    _sanitizer.enable_cuda_sanitizer()
    try:
        yield
    finally:
        _sanitizer.cuda_sanitizer.disable()


@pytest.mark.parametrize("case", list(CASES))
def test_no_unsynchronized_access(tmp_path, sanitizer, case):
    trained = train(config(SMALL, tmp_path, CASES[case]))  # CUDASanitizerErrors on a report
    assert trained.steps == 10 and torch.isfinite(trained.losses).all()
