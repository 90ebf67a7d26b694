"""Every pipeline and speed feature, a few steps and an evaluation under torch's CUDA Stream
Sanitizer (``torch.cuda._sanitizer``, documented at pytorch.org/docs/stable/cuda._sanitizer.html):
it follows every kernel's reads and writes per stream and the events and waits between streams,
and raises on a tensor used on two streams without a synchronization. 0 reports. Batches are
made in the loop (``data.num_workers: 0``): the sanitizer starts CUDA in this process, and a
forked producer that inherits it cannot use CUDA (recpipe's never do; torch refuses them all).
What it cannot see: a CUDA graph's replay (one launch, no ops), and memory the caching allocator
reuses across streams (its trace ends a tensor when Python frees it): tests/test_full_speed_gpu.py
covers those by training at full speed.

Two things the sanitizer reports that are not races of these runs, and are kept out:

* the ops recorded while a CUDA graph is captured: nothing runs then, but the sanitizer takes
  them for launches on the capture's stream, and the first eager op of the next step on another
  stream conflicts with them (``pipeline.cuda_graphs``, ``pipeline.step_graph``). The sanitizer is
  paused while a graph is captured (it sees the steps before the capture and around each replay);
* FBGEMM's prefetch pipeline (``prefetch``), which works on parts of one tensor from two streams by
  its design: it checks a batch's ids on the prefetch stream and again in the forward, on the
  compute stream, and both checks may add to the TBE's one ``bounds_check_warning`` counter (an
  atomic add per id out of range; none in these runs); and the prefetch of batch i+1 inserts rows
  into ``lxu_cache_weights`` (``lru_cache_populate``) while the lookups of batch i read other rows
  of it, the cache lines batch i's own prefetch locked, which no insert may evict until batch i's
  backward has released them (FBGEMM's cache-line locking; tests/test_pipelines_gpu.py's prefetch
  cases check the numbers against tables in HBM). Only reports naming those two pairs of
  operations on those tensors are dropped; any other report fails the test."""

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


_CACHE_OPS = ("fbgemm::lru_cache_populate", "recpipe::lru_cache_populate", "fbgemm::split_embedding")


def _fbgemm_prefetch_by_design(error) -> bool:
    """A report on the two tensors FBGEMM's prefetch pipeline shares between streams by design
    (see above): the bounds-check warning counter, or the cache's rows between an insert and a lookup."""
    accesses = (error.current_access, error.previous_access)
    ops = [str(a.operator) for a in accesses]
    if all("fbgemm::bounds_check_indices" in op and a.aliases == ["warning"] for op, a in zip(ops, accesses)):
        return True
    inserts = sum(("lru_cache_populate" in op) for op in ops)
    return (inserts >= 1 and all(a.aliases == ["lxu_cache_weights"] for a in accesses)
            and all(op.startswith(_CACHE_OPS) for op in ops))


@pytest.fixture
def sanitizer(monkeypatch):
    from torch.cuda import _sanitizer

    torch.cuda.synchronize()
    _sanitizer.enable_cuda_sanitizer()
    csan = _sanitizer.cuda_sanitizer
    handler = csan.dispatch.event_handler
    launch = handler._handle_kernel_launch
    monkeypatch.setattr(handler, "_handle_kernel_launch",
                        lambda *args: [e for e in launch(*args) if not _fbgemm_prefetch_by_design(e)])
    enter, exit_ = torch.cuda.graph.__enter__, torch.cuda.graph.__exit__

    def capture_enter(self):
        csan.disable()
        return enter(self)

    def capture_exit(self, *exc):
        try:
            return exit_(self, *exc)
        finally:
            csan.enable()

    monkeypatch.setattr(torch.cuda.graph, "__enter__", capture_enter)
    monkeypatch.setattr(torch.cuda.graph, "__exit__", capture_exit)
    try:
        yield
    finally:
        csan.disable()


@pytest.mark.parametrize("case", list(CASES))
def test_no_unsynchronized_access(tmp_path, sanitizer, case):
    trained = train(config(SMALL, tmp_path, CASES[case]))  # CUDASanitizerErrors on a report
    assert trained.steps == 10 and torch.isfinite(trained.losses).all()
