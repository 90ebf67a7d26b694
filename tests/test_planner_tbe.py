"""Static planner terms equal, byte for byte, the buffers of real FBGEMM TBEs.

Each TBE the planner predicts (recpipe.planner.tbe.group_tbes) is built for real on
the meta device with the arguments torchrec passes (batched_embedding_kernel.py:
BatchedFusedEmbeddingBag), for every compute kernel and embedding optimizer; its
parameters and buffers are listed with their nbytes and compared to the terms.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from recpipe.planner.estimate import estimate_memory
from recpipe.planner.spec import DenseSpec, PlannerInputs, TableSpec, pipeline_spec, shards_for_tables
from recpipe.planner.tbe import ALLOC_BLOCK, TBE_SMALL_BUFFERS, group_tbes, tbe_static

fbgemm_training = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm, EmbeddingLocation  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_common import MultiPassPrefetchConfig  # noqa: E402

_LOCATION = {"fused": EmbeddingLocation.DEVICE, "fused_uvm": EmbeddingLocation.MANAGED,
             "fused_uvm_caching": EmbeddingLocation.MANAGED_CACHING}
_OPT = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "adam": EmbOptimType.ADAM}

# FBGEMM buffer -> planner term (buffers not listed are O(tables) metadata)
_TERM = {
    "weights_dev": "emb_weights", "weights_uvm": "emb_weights_uvm",
    "lxu_cache_weights": "uvm_cache_weights", "lxu_cache_state": "uvm_cache_state",
    "lxu_state": "uvm_cache_lru_state", "cache_index_table_map": "uvm_cache_index_map",
    "lxu_cache_locking_counter": "uvm_cache_locking_counter",
}


class _Props:
    total_memory = 80 << 30


def inputs_for(tables, *, world_size=1, optimizer="rowwise_adagrad", prefetch=False, passes=1, tw_rank=None):
    tables = tuple(tables)
    tw = {t.name: (tw_rank if tw_rank is not None else i % world_size) for i, t in enumerate(tables)}
    return PlannerInputs(
        tables=tables, shards=shards_for_tables(tables, world_size, tw), world_size=world_size, batch_size=256,
        num_dense_features=13, dense=DenseSpec(num_params=1000), embedding_optimizer=optimizer,
        dense_optimizer="adagrad", pipeline=pipeline_spec("prefetch" if prefetch else "sparse_dist"),
        hbm_capacity_bytes=80 << 30, prefetch_pipeline=prefetch, prefetch_passes=passes, prefetch_min_pass_size=64,
    )


def build_real_tbe(inputs: PlannerInputs, tbe):
    """The FBGEMM TBE torchrec builds for ``tbe`` (meta device; the cache sizing's
    free-memory query is answered with an 80 GiB GPU, as the planner assumes)."""
    specs = [(s.rows, s.cols, _LOCATION[t.kernel], fbgemm_training.ComputeDevice.CUDA)
             for s, t in zip(tbe.shards, tbe.tables)]
    kwargs = dict(optimizer=_OPT[inputs.embedding_optimizer], device="meta", cache_algorithm=CacheAlgorithm.LRU)
    if tbe.cached:
        kwargs.update(cache_load_factor=tbe.cache_load_factor, prefetch_pipeline=inputs.prefetch_pipeline)
        if inputs.prefetch_passes > 1:
            kwargs["multipass_prefetch_config"] = MultiPassPrefetchConfig(inputs.prefetch_passes, inputs.prefetch_min_pass_size)
    with mock.patch("torch.cuda.get_device_properties", return_value=_Props()), \
            mock.patch("torch.cuda.memory_reserved", return_value=0):
        return fbgemm_training.SplitTableBatchedEmbeddingBagsCodegen(specs, feature_table_map=list(range(len(specs))), **kwargs)


def real_terms(inputs: PlannerInputs, tbe, module) -> tuple[dict[str, int], list[torch.Tensor]]:
    terms: dict[str, int] = {}
    small: list[torch.Tensor] = []
    rowwise = inputs.embedding_optimizer == "rowwise_adagrad"
    for name, t in list(module.named_buffers()) + list(module.named_parameters()):
        term = _TERM.get(name)
        states = {"sgd": (), "rowwise_adagrad": ("momentum1",), "adam": ("momentum1", "momentum2")}
        if name.rsplit("_", 1)[0] in states[inputs.embedding_optimizer] and name.endswith(("_dev", "_uvm")):
            term = "emb_optimizer_rowwise" if rowwise else ("emb_optimizer" if name.endswith("_dev") else "emb_optimizer_uvm")
        if term and term.startswith("uvm_cache") and not tbe.cached:
            term = None  # 1-element stand-ins of TBEs without a cache
        if term:
            terms[term] = terms.get(term, 0) + t.numel() * t.element_size()
        elif t.device.type == "meta" and t.numel():
            small.append(t)
    return terms, small


def check_tbe_bytes(inputs: PlannerInputs) -> int:
    tbes = [g for r in range(inputs.world_size) for g in group_tbes(inputs, r)]
    assert tbes
    for tbe in tbes:
        module = build_real_tbe(inputs, tbe)
        real, small = real_terms(inputs, tbe, module)
        ours = {n: b for n, _, b, _ in tbe_static(inputs, tbe) if n != "tbe_metadata"}
        for name in set(real) | set(ours):
            assert ours.get(name, 0) == real.get(name, 0), (tbe.name, name, ours.get(name), real.get(name))
        if tbe.cached:
            assert module.lxu_cache_weights.shape == (tbe.cache_slots, tbe.cache_dim)
        # metadata: each small buffer takes one 512 B block on the GPU
        real_meta = sum(-(-t.numel() * t.element_size() // ALLOC_BLOCK) * ALLOC_BLOCK for t in small)
        assert abs(TBE_SMALL_BUFFERS * ALLOC_BLOCK - real_meta) <= 0.25 * real_meta, (real_meta, len(small))
    return len(tbes)


def _tables(kernel, clfs=(0.2, 0.05, 0.33), rows=(1000, 777, 5003), dims=(16, 16, 16)):
    return [TableSpec(f"t{i}", r, d, 2.0, "table_wise", kernel, clf if kernel == "fused_uvm_caching" else None)
            for i, (r, d, clf) in enumerate(zip(rows, dims, clfs))]


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("kernel", ["fused", "fused_uvm", "fused_uvm_caching"])
def test_static_terms_equal_fbgemm_buffers(kernel, optimizer):
    assert check_tbe_bytes(inputs_for(_tables(kernel), optimizer=optimizer, tw_rank=0)) == 1


@pytest.mark.parametrize("passes", [1, 4])
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_cached_with_prefetch_pipeline_has_locking_counter(optimizer, passes):
    inputs = inputs_for(_tables("fused_uvm_caching"), optimizer=optimizer, prefetch=True, passes=passes, tw_rank=0)
    check_tbe_bytes(inputs)
    assert estimate_memory(inputs).ranks[0].term("uvm_cache_locking_counter") > 0


def test_mixed_dims_cache_is_widest_cached_dim_without_prefetch():
    """planner_memory.md case H: a narrow and a wide cached table share one TBE, and
    every cache slot is as wide as the widest table."""
    tables = _tables("fused_uvm_caching", rows=(100_000, 1000, 300), dims=(8, 64, 32))
    inputs = inputs_for(tables, tw_rank=0)
    (tbe,) = group_tbes(inputs, 0)
    assert tbe.cache_dim == 64
    check_tbe_bytes(inputs)


def test_prefetch_pipeline_buckets_cached_tables_by_dim():
    tables = _tables("fused_uvm_caching", rows=(100_000, 1000, 300), dims=(8, 64, 8))
    inputs = inputs_for(tables, prefetch=True, tw_rank=0)
    tbes = group_tbes(inputs, 0)
    assert sorted(g.cache_dim for g in tbes) == [8, 64]
    check_tbe_bytes(inputs)


def test_mixed_kernels_on_one_rank():
    """fused and fused_uvm share a TBE; the cached table gets its own (cache params
    in its fused params)."""
    tables = [TableSpec("a", 1000, 16, 1.0, "table_wise", "fused"),
              TableSpec("b", 2000, 16, 1.0, "table_wise", "fused_uvm"),
              TableSpec("c", 3000, 16, 1.0, "table_wise", "fused_uvm_caching", 0.25)]
    for optimizer in ("rowwise_adagrad", "adam"):
        inputs = inputs_for(tables, optimizer=optimizer, tw_rank=0)
        assert [g.cached for g in group_tbes(inputs, 0)] == [False, True]
        check_tbe_bytes(inputs)


def test_row_and_column_wise_shards_match_fbgemm():
    tables = [TableSpec("rw", 10_007, 32, 1.0, "row_wise", "fused_uvm_caching", 0.1),
              TableSpec("cw", 3000, 32, 1.0, "column_wise", "fused"),
              TableSpec("tw", 500, 32, 1.0, "table_wise", "fused_uvm")]
    assert check_tbe_bytes(inputs_for(tables, world_size=4, optimizer="adam")) >= 9


def test_data_parallel_weights_equal_dense_tbe():
    tables = [TableSpec("dp0", 1000, 16, 1.0, "data_parallel", "dense"),
              TableSpec("dp1", 3000, 16, 1.0, "data_parallel", "dense")]
    inputs = inputs_for(tables, world_size=2)
    for tbe in group_tbes(inputs, 1):
        real = fbgemm_training.DenseTableBatchedEmbeddingBagsCodegen([(s.rows, s.cols) for s in tbe.shards], use_cpu=True)
        ours = {n: b for n, _, b, _ in tbe_static(inputs, tbe)}
        assert ours["dp_emb_weights"] == real.weights.numel() * real.weights.element_size()
        assert ours["dp_emb_grads"] == ours["dp_emb_weights"]  # zeros_like(dev_weights) in backward
        assert ours["dp_emb_optimizer"] == ours["dp_emb_weights"]  # adagrad state_sum


def test_shard_terms_sum_to_tbe_terms():
    tables = _tables("fused_uvm_caching", rows=(100_003, 1001, 299), dims=(8, 64, 32))
    inputs = inputs_for(tables, tw_rank=0)
    plan = estimate_memory(inputs)
    for name in ("uvm_cache_weights", "uvm_cache_state", "uvm_cache_lru_state", "uvm_cache_index_map",
                 "emb_weights_uvm", "emb_optimizer_rowwise"):
        shard_sum = sum(t.bytes for s in plan.shards for t in s.terms if t.name == name)
        assert shard_sum == plan.ranks[0].term(name), name
