"""``pipeline.cache_fill`` (recpipe's insert) on CUDA: the compiled kernels against the torch
reference (every cache and host row, exactly), and on FBGEMM's own TBE against
FBGEMM's populate: the same outputs and tables bit for bit over training steps with
evictions and conflicts, the same cache counters up to ties between equal LRU times."""

from __future__ import annotations

import contextlib

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_compiled_kernels_match_the_reference():
    import test_cache_fill
    from recpipe.speedups import cache_fill

    if cache_fill.available():
        pytest.skip(cache_fill.available())
    original = test_cache_fill.FakeTBE

    class OnCuda(original):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.cuda()

    test_cache_fill.FakeTBE = OnCuda
    try:
        test_cache_fill.triton_matches_reference()
    finally:
        test_cache_fill.FakeTBE = original


def _tbe(seed: int, cache_sets: int = 0):
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, OptimType, SplitTableBatchedEmbeddingBagsCodegen)

    torch.manual_seed(seed)
    specs = [(40_000, 64, EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA),
             (1_000, 32, EmbeddingLocation.DEVICE, ComputeDevice.CUDA),
             (60_000, 128, EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA)]
    return SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=specs, optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05, cache_load_factor=0.03,
        cache_sets=cache_sets, prefetch_pipeline=True, uvm_host_mapped=True, gather_uvm_cache_stats=True)


@pytest.mark.parametrize("cache_sets", [0, 1, 2, 7], ids=["load_factor", "1set", "2sets", "7sets"])
def test_fbgemm_tbe_trains_the_same_with_either_insert(cache_sets):
    """``cache_sets`` 0: FBGEMM sizes the cache from its load factor (94 sets); 1, 2 and 7:
    the small and odd caches a table's share on several ranks can have."""
    from recpipe.speedups import cache_fill

    if cache_fill.available():
        pytest.skip(cache_fill.available())
    fbgemm, ours = _tbe(0, cache_sets), _tbe(0, cache_sets)
    if cache_sets:
        assert ours.lxu_cache_state.shape[0] == cache_sets
    for a, b in zip(fbgemm.split_embedding_weights(), ours.split_embedding_weights()):
        assert torch.equal(a, b)
    rows = [40_000, 1_000, 60_000]
    g = torch.Generator(device="cuda").manual_seed(1)
    batch = 2048

    def ids():
        u = torch.rand(3 * batch, device="cuda", generator=g)
        per_table = torch.cat([torch.floor(u[t * batch:(t + 1) * batch] ** 3 * r) for t, r in enumerate(rows)])
        return per_table.long(), torch.arange(3 * batch + 1, device="cuda")

    data = [ids() for _ in range(12)]
    compute, side = torch.cuda.current_stream(), torch.cuda.Stream()

    def prefetch(name, tbe, batch):
        with torch.cuda.stream(side), cache_fill.routing(sms=4) if name == "triton" else contextlib.nullcontext():
            tbe.prefetch(*batch, forward_stream=compute)

    outs = {}
    for name, tbe in (("fbgemm", fbgemm), ("triton", ours)):
        prefetch(name, tbe, data[0])
        got = []
        for k in range(len(data)):
            compute.wait_stream(side)
            out = tbe(*data[k])
            if k + 1 < len(data):  # prefetch(i+1) between forward(i) and backward(i)
                prefetch(name, tbe, data[k + 1])
            (out * out).sum().backward()
            got.append(out.detach().clone())
        tbe.flush()
        torch.cuda.synchronize()
        outs[name] = (got, [w.clone() for w in tbe.split_embedding_weights()], tbe.get_uvm_cache_stats().tolist())
    (fo, fw, fs), (oo, ow, os_) = outs["fbgemm"], outs["triton"]
    assert all(torch.equal(a, b) for a, b in zip(fo, oo)), "forward outputs differ"
    assert all(torch.equal(a, b) for a, b in zip(fw, ow)), "tables differ after training"
    print(f"cache counters (calls, requested, unique, misses, conflict misses, conflict lookups): FBGEMM {fs}, "
          f"recpipe {os_}")
    assert fs[:3] == os_[:3] and abs(fs[3] - os_[3]) <= 0.01 * fs[3], (fs, os_)
    assert fs[3] > 0.3 * fs[2], "the test needs many misses"
