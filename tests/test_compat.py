"""recpipe/compat/: each accessor of a library's private name still finds it in the installed
torch, torchrec and fbgemm-gpu. A failure here names the field or method a release moved:
fix its accessor in recpipe/compat/, nowhere else."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from torch import nn

from recpipe.compat import fbgemm as compat_fbgemm
from recpipe.compat import torch as compat_torch
from recpipe.compat import torchrec as compat_torchrec


def _sets(cls: type, *fields: str) -> None:
    """Every ``fields`` is assigned as ``self.<field>`` somewhere in ``cls``'s MRO's source."""
    source = "\n".join(inspect.getsource(c) for c in inspect.getmro(cls) if c.__module__.split(".")[0] != "builtins"
                       and c.__module__.split(".")[0] in ("torch", "torchrec", "fbgemm_gpu"))
    missing = [f for f in fields if not re.search(rf"self\.{f}\b\s*[:=]", source)]
    assert missing == [], f"{cls.__module__}.{cls.__qualname__} no longer sets {missing}"


def test_all_to_all_layout_fields():
    from torchrec.distributed.dist_data import KJTAllToAll

    _sets(KJTAllToAll, "_pg", "_splits", "_stagger")
    fake = type("D", (), {"_pg": "pg", "_splits": [1, 2], "_stagger": 1})()
    assert compat_torchrec.all_to_all_layout(fake) == ("pg", [1, 2], 1)


def test_input_dist_fields():
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.distributed.sharding.rw_sharding import RwSparseFeaturesDist

    _sets(ShardedEmbeddingBagCollection, "_has_uninitialized_input_dist", "_input_dists", "_lookups",
          "_sharding_types", "_embedding_shardings")
    _sets(RwSparseFeaturesDist, "_dist")
    module = nn.Module()
    module._has_uninitialized_input_dist = True
    assert compat_torchrec.input_dist_all_to_alls(module) is None


def test_sharding_groups_fields():
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.sharding.rw_sharding import BaseRwEmbeddingSharding

    _sets(ShardedEmbeddingCollection, "_sharding_type_to_sharding")
    assert "_get_feature_hash_sizes" in vars(BaseRwEmbeddingSharding)


def test_feature_processor_field():
    from torchrec.distributed.fp_embeddingbag import ShardedFeatureProcessedEmbeddingBagCollection

    # torchrec 1.8 recognises it by its class name; ``_feature_processor`` is the fallback for others
    assert compat_torchrec.has_feature_processor(object.__new__(ShardedFeatureProcessedEmbeddingBagCollection))
    assert not compat_torchrec.has_feature_processor(nn.Module())


def test_lookups_only_modules():
    module = nn.Module()
    assert compat_torchrec.lookups(module) is None
    module._lookups = [nn.Linear(1, 1)]
    assert compat_torchrec.lookups(module) == module._lookups


def test_set_length_per_key_is_what_the_kjt_reports():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.arange(3), torch.tensor([1, 1, 1, 0]))
    compat_torchrec.set_length_per_key(kjt, [7, 5])
    assert kjt.length_per_key() == [7, 5] and kjt.offset_per_key() == [0, 7, 12]


def test_keyed_tensor_key_index():
    from torchrec.sparse.jagged_tensor import KeyedTensor

    kt = KeyedTensor(keys=["a", "b"], length_per_key=[1, 2], values=torch.zeros(2, 3), key_dim=1)
    assert compat_torchrec.keyed_tensor_key_index(kt) == {"a": 0, "b": 1}


def test_fused_splits_fields_are_what_its_wait_reads():
    from torchrec.distributed.embedding_sharding import FusedKJTListSplitsAwaitable

    _sets(FusedKJTListSplitsAwaitable, "_contexts", "_awaitables", "_output_lengths", "_lengths", "_splits_awaitable")
    wait = inspect.getsource(FusedKJTListSplitsAwaitable._wait_impl)
    assert all(f"self.{f}" in wait for f in ("_awaitables", "_lengths", "_splits_awaitable", "_output_lengths"))


def test_ebc_awaitable_parts_and_wait():
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionAwaitable

    _sets(EmbeddingBagCollectionAwaitable, "_awaitables", "_resize_awaitables", "_embedding_names", "_embedding_dims")
    assert "_wait_impl" in vars(EmbeddingBagCollectionAwaitable)
    from torchrec.distributed.types import Awaitable

    assert "_wait_impl()" in inspect.getsource(Awaitable.wait)  # wait() calls the instance's _wait_impl

    class Done(Awaitable):
        def _wait_impl(self):
            return 1

    done = Done()
    compat_torchrec.replace_wait(done, lambda self: 2)
    assert done.wait() == 2


def test_recat_replaced_and_restored():
    from torchrec.distributed import dist_data

    original = compat_torchrec.recat_function()
    assert list(inspect.signature(original).parameters) == [
        "local_split", "num_splits", "stagger", "device", "batch_size_per_rank"]
    assert "_get_recat(" in inspect.getsource(dist_data.KJTAllToAllTensorsAwaitable)  # looked up by name per call
    with compat_torchrec.recat_replaced(len):
        assert dist_data._get_recat is len
    assert dist_data._get_recat is original


def test_reserved_hbm_fields():
    from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation

    _sets(HeuristicalStorageReservation, "_dense_storage", "_kjt_storage")
    assert compat_torchrec.reserved_hbm(HeuristicalStorageReservation(percentage=0.15)) == (0, 0)


def test_module_children_and_backward_pre_hooks():
    seq = nn.Sequential(nn.Linear(1, 1))
    seq.register_module("gone", None)
    assert compat_torchrec.module_children(seq) == [seq[0]]
    handle = seq.register_full_backward_pre_hook(lambda m, g: None)
    assert list(compat_torch.backward_pre_hooks(seq)) == [handle.id]


def test_tbe_batch_fields():
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    source = inspect.getsource(SplitTableBatchedEmbeddingBagsCodegen)
    missing = [f for f in compat_fbgemm.TBE_BATCH_FIELDS if not re.search(rf"self\.{f}\s*=", source)]
    assert missing == [], f"FBGEMM's TBE no longer sets {missing}"


def test_module_hooks_and_batch_norms():
    linear = nn.Linear(1, 1)
    assert not compat_torch.has_module_hooks(linear)
    for register in (linear.register_forward_hook, linear.register_forward_pre_hook, linear.register_full_backward_hook):
        handle = register(lambda *args: None)
        assert compat_torch.has_module_hooks(linear), register.__name__
        handle.remove()
    assert not compat_torch.has_module_hooks(linear)
    norms = [nn.BatchNorm1d(2), nn.BatchNorm2d(2), nn.BatchNorm3d(2), nn.SyncBatchNorm(2), nn.LazyBatchNorm1d()]
    assert all(compat_torch.is_batch_norm(m) for m in norms)
    assert not any(compat_torch.is_batch_norm(m) for m in (nn.LayerNorm(2), nn.InstanceNorm1d(2), linear))


def test_optimizer_step_hooks_own_and_global():
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    assert not compat_torch.has_optimizer_step_hooks(opt)
    handle = opt.register_step_pre_hook(lambda *args: None)
    assert compat_torch.has_optimizer_step_hooks(opt)
    handle.remove()
    handle = opt.register_step_post_hook(lambda *args: None)
    assert compat_torch.has_optimizer_step_hooks(opt)
    handle.remove()
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(lambda *args: None)
    try:
        assert compat_torch.has_optimizer_step_hooks(opt)
    finally:
        handle.remove()
    assert not compat_torch.has_optimizer_step_hooks(opt)


def test_foreach_ops_and_tree_map():
    dst, src = [torch.zeros(2), torch.zeros(3)], [torch.ones(2), torch.full((3,), 2.0)]
    compat_torch.foreach_copy_(dst, src)
    assert [d.tolist() for d in dst] == [[1.0, 1.0], [2.0, 2.0, 2.0]]
    compat_torch.foreach_add_(dst, torch.tensor(1.0), alpha=2.0)
    compat_torch.foreach_add_(dst, 1.0)
    assert [d.tolist() for d in dst] == [[4.0, 4.0], [5.0, 5.0, 5.0]]
    t = torch.ones(1)
    out = compat_torch.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, {"a": (t, 1), "b": [t]})
    assert out["a"][1] == 1 and out["a"][0] is not t and torch.equal(out["b"][0], t)


def test_backward_callback_runs_after_the_backward():
    w = torch.ones(2, requires_grad=True)
    seen = []
    w.register_post_accumulate_grad_hook(lambda p: compat_torch.queue_backward_callback(lambda: seen.append(p.grad.sum().item())))
    (w * 3).sum().backward()
    assert seen == [6.0]


def test_profiler_flag_follows_the_profiler():
    assert not compat_torch.profiler_enabled()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert compat_torch.profiler_enabled()
    assert not compat_torch.profiler_enabled()


def test_sharded_tensor_is_torchrecs():
    from torchrec.distributed.types import ShardedTensor

    # an instance without a process group (its constructor needs one)
    assert compat_torch.is_sharded_tensor(torch.Tensor._make_subclass(ShardedTensor, torch.empty(0)))
    assert not compat_torch.is_sharded_tensor(torch.zeros(1))


def test_ddp_start_up_sync_on_one_rank():
    import torch.distributed as dist
    from torch.distributed.utils import _sync_module_states, _verify_param_shape_across_processes

    assert list(inspect.signature(_sync_module_states).parameters) == [
        "module", "process_group", "broadcast_bucket_size", "src", "params_and_buffers_to_ignore", "broadcast_buffers"]
    assert list(inspect.signature(_verify_param_shape_across_processes).parameters)[:2] == ["process_group", "tensors"]
    if dist.is_initialized():
        pytest.skip("a process group of another test is up")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Linear(2, 1)
        before = model.weight.detach().clone()
        compat_torch.verify_param_shapes(dist.group.WORLD, list(model.parameters()))
        compat_torch.broadcast_parameters(model, dist.group.WORLD, 1 << 20, 0, {"bias"})
        assert torch.equal(model.weight, before)
    finally:
        dist.destroy_process_group()


def test_dcp_set_element_and_pickled_globals():
    root: dict = {}
    compat_torch.dcp_set_element(root, ("a", "b", 0), 7)
    assert root == {"a": {"b": [7]}}
    names = {(g.__module__, g.__qualname__) for g in compat_torch.dcp_metadata_private_globals()}
    assert names == {("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
                     ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                     ("torch.serialization", "_get_layout")}
    layout = torch.sparse_coo
    assert torch.serialization._get_layout(str(layout)) is layout  # how a layout pickles


def test_dynamo_config_kept_and_counters():
    import torch._dynamo

    before = torch._dynamo.config.cache_size_limit
    with compat_torch.dynamo_config_kept():
        torch._dynamo.config.cache_size_limit = before + 1
    assert torch._dynamo.config.cache_size_limit == before
    counters = compat_torch.dynamo_counters(if_loaded=True)  # imported above
    assert counters is compat_torch.dynamo_counters() and isinstance(counters["stats"]["unique_graphs"], int)


def test_inductor_modes_fx_logger_and_size_oblivious():
    assert compat_torch.inductor_mode_options("max-autotune")["max_autotune"] is True
    import torch.fx._symbolic_trace as symbolic_trace
    from torch.fx.experimental import _config as fx_config

    assert compat_torch.fx_trace_logger() is symbolic_trace.log
    assert fx_config.backed_size_oblivious is False
    with compat_torch.backed_size_oblivious():
        assert fx_config.backed_size_oblivious is True
    assert fx_config.backed_size_oblivious is False


def test_optimizer_wrappers_keep_the_wrapped_optimizer():
    from torchrec.optim.keyed import KeyedOptimizerWrapper, OptimizerWrapper

    params = {"w": nn.Parameter(torch.ones(1))}
    keyed = KeyedOptimizerWrapper(params, lambda p: torch.optim.SGD(p, lr=0.1))
    assert isinstance(compat_torchrec.wrapped_optimizer(keyed), torch.optim.SGD)
    assert compat_torchrec.wrapped_optimizer(OptimizerWrapper(keyed)) is keyed


def test_sharded_parameter_names_of_an_unsharded_model():
    from torchrec.distributed import DistributedModelParallel

    assert "_sharded_parameter_names" in vars(DistributedModelParallel)
    assert compat_torchrec.sharded_parameter_names(nn.Sequential(nn.Linear(1, 1))) == []


def test_pipelined_modules_field():
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    _sets(TrainPipelineSparseDist, "_pipelined_modules")
    assert compat_torchrec.pipelined_modules(object()) is None


def test_kjt_fields_are_its_constructor_arguments():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recpipe.data.flat import KJT_FIELDS

    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([1, 1, 1, 0]))
    fields = dict(zip(KJT_FIELDS, compat_torchrec.kjt_fields(kjt, KJT_FIELDS)))
    assert fields["keys"] == ["a", "b"] and torch.equal(fields["values"], torch.arange(3))
    assert fields["offsets"] is None  # not computed yet
    assert torch.equal(KeyedJaggedTensor(**fields).lengths(), kjt.lengths())


def test_metric_computations_field():
    from torchrec.metrics.ctr import CTRMetric
    from torchrec.metrics.metrics_config import RecTaskInfo

    task = RecTaskInfo(name="t", label_name="label", prediction_name="prediction", weight_name="weight")
    metric = CTRMetric(world_size=1, my_rank=0, batch_size=1, tasks=[task])
    assert [type(c).__name__ for c in compat_torchrec.metric_computations(metric)] == ["CTRMetricComputation"]


def test_clearing_cublas_workspaces_never_starts_cuda():
    """Without CUDA (or before it started) nothing to free, no error, and CUDA not started by it."""
    started = torch.cuda.is_initialized()
    compat_torch.clear_cublas_workspaces()
    assert torch.cuda.is_initialized() == started


@pytest.mark.gpu
def test_cublas_workspaces_are_freed_on_cuda():
    a = torch.randn(256, 256, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # a stream's first matmul takes a workspace from the allocator
        (a @ a).sum().item()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    compat_torch.clear_cublas_workspaces()
    assert torch.cuda.memory_allocated() < before


def test_torchrecs_planner_reads_a_reservations_share():
    """What torchrec's planner names in its no-plan error: its reservation's ``_percentage``."""
    import inspect as _inspect

    from torchrec.distributed.planner import planners

    assert "_storage_reservation._percentage" in _inspect.getsource(planners.EmbeddingShardingPlanner.plan)

    class Reservation:
        pass

    r = Reservation()
    compat_torchrec.name_reservation_share(r, 0.0)
    assert r._percentage == 0.0


def test_make_graphed_callables_looks_up_torch_cuda_graph_at_each_capture():
    """compat.torch.make_graphed_callables sets the capture mode by replacing ``torch.cuda.graph``
    while torch's function runs: it must still construct its graphs through that name."""
    source = inspect.getsource(torch.cuda.graphs.make_graphed_callables)
    assert "torch.cuda.graph(" in source
    assert "capture_error_mode" in inspect.signature(torch.cuda.graph.__init__).parameters


def test_the_collector_is_collected_then_paused_for_a_capture():
    import gc

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    collected = []
    cycle = Cycle()
    gc.callbacks.append(lambda phase, info: collected.append(info["collected"]) if phase == "stop" else None)
    try:
        del cycle
        with compat_torch._collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled() and sum(collected) >= 1
    finally:
        gc.callbacks.pop()


@pytest.mark.gpu
def test_graphed_callables_capture_in_thread_local_mode():
    modes = []
    real = compat_torch._ThreadLocalGraph.__init__

    def record(self, *args, **kwargs):
        real(self, *args, **kwargs)
        modes.append(self.capture_error_mode)

    linear = nn.Linear(8, 8).cuda()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compat_torch._ThreadLocalGraph, "__init__", record)
        graphed = compat_torch.make_graphed_callables(linear, (torch.randn(4, 8, device="cuda"),))
    x = torch.randn(4, 8, device="cuda")
    assert torch.allclose(graphed(x), linear(x), atol=1e-6)
    assert modes == ["thread_local", "thread_local"], modes  # the forward's graph and the backward's
    assert torch.cuda.graph is not compat_torch._ThreadLocalGraph
