"""``pipeline.step_graph`` on CPU: everything but the CUDA graph itself.

A stand-in capture (``_no_graph``) returns the step function un-run, so each "replay"
runs the captured step in Python on the static buffers: what the copy into them, the
capacity, the padding, the fixed splits of several ranks, the eager fallback and the
host bookkeeping do is exactly what runs around a real graph. The GPU test
(tests/test_step_graph_gpu.py) replays real graphs and compares them with eager."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipeline_harness import assert_same, build, make_batches, small_config, train
from recpipe.builder import apply_speedups
from recpipe.config import ConfigError, load_config
from recpipe.data.batch import Batch
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from recpipe.pipelines import PIPELINES, PipelineError
from recpipe.preflight import check_rules
from recpipe.speedups.optimizer_graph import fused_optimizers, torch_optimizers
from recpipe.train.learning_rates import LearningRates
from recpipe.speedups import step_graph
from recpipe.speedups.step_graph import StepGraphOptions, apply_step_graph, pad_features, signature

TABLES = ["sharding.tables={t_cat_1: {type: table_wise}, t_cat_2: {type: column_wise}, t_cat_3: {type: table_wise}}"]
# Every sharding type a step graph holds: row-wise tables on several ranks have their ids per
# rank padded to a capacity.
ROW_TABLES = ["sharding.tables={t_cat_0: {type: row_wise}, t_cat_1: {type: table_row_wise}, "
              "t_cat_2: {type: column_wise}, t_cat_3: {type: table_wise}}"]


def _no_graph(step):
    return step


def _fixed_batches(cfg, n, rank, ids_per_sample=(1, 2, 1, 3)):
    """Batches whose every feature has the same number of ids in every batch."""
    g = torch.Generator().manual_seed(rank + 7)
    B = cfg.data.batch_size
    out = []
    for _ in range(n):
        lengths = torch.cat([torch.full((B,), k, dtype=torch.int32) for k in ids_per_sample])
        values = torch.cat([torch.randint(0, rows, (B * k,), generator=g)
                            for k, rows in zip(ids_per_sample, cfg.model.num_embeddings_per_feature)])
        kjt = KeyedJaggedTensor(keys=cfg.model.feature_names, values=values, lengths=lengths)
        out.append(Batch(torch.randn(B, cfg.model.num_dense_features, generator=g), kjt,
                         torch.randint(0, 2, (B,), generator=g).float(), torch.ones(B)))
    return out


def _graphed(cfg, name, batches, options, segments=None):
    """Train ``batches`` with ``name`` and a step graph (stand-in capture); the result and the graph."""
    sm = build(cfg, torch.device("cpu"))
    pipe = PIPELINES[name](sm.model, sm.optimizer, torch.device("cpu"))
    graph = apply_step_graph(pipe.context, options, capture=_no_graph)
    from pipeline_harness import RunResult, local_state

    losses, weights = [], []
    it = iter(batches)
    import itertools

    for size in segments or [len(batches)]:
        seg = itertools.islice(it, size)
        while True:
            try:
                loss, _, _, w = pipe.progress(seg)
            except StopIteration:
                break
            losses.append(loss.clone())
            weights.append(w.clone())
    dist.barrier()
    return RunResult(losses, weights, local_state(sm.model)), graph, sm


def row_features(cfg, ids_per_sample=(1, 2, 1, 3)) -> dict[str, int]:
    """The features of row-wise tables on several ranks -> a capacity no batch of
    ``_fixed_batches`` exceeds in any rank's bucket (all its ids in one bucket)."""
    W = cfg.distributed.nproc
    return {f: k * cfg.data.batch_size * W for f, k, t in zip(cfg.model.feature_names, ids_per_sample,
                                                             (f"t_{f}" for f in cfg.model.feature_names))
            if W > 1 and cfg.sharding.for_table(t).type in ("row_wise", "table_row_wise")}


@contextlib.contextmanager
def _agreements():
    """The step graph's agreements while the block runs: (those that block the host where they
    are made, those started at a fetch and read later), each rank's verdict."""
    blocking, started = [], []
    agree, agree_async = step_graph._agree, step_graph._agree_async
    step_graph._agree = lambda ok: blocking.append(ok) or agree(ok)
    step_graph._agree_async = lambda ok: started.append(ok) or agree_async(ok)
    try:
        yield blocking, started
    finally:
        step_graph._agree, step_graph._agree_async = agree, agree_async


def _worker(cfg) -> None:
    init_process_group(cfg)
    rank = dist.get_rank()
    # Fixed shapes: nothing padded (but the buckets of row-wise tables on several ranks,
    # whose ids per rank vary), every step after the measured ones replays.
    fixed = _fixed_batches(cfg, 9, rank)
    want = train(cfg, "base", fixed)
    rows = row_features(cfg)
    for name in ("base", "sparse_dist"):
        with _agreements() as (blocking, started):
            got, graph, sm = _graphed(cfg, name, fixed, StepGraphOptions(enabled=True, capacity_batches=3,
                                                                         capacity=rows), [5, 4])
        assert_same(want, got, f"{name} step graph, fixed shapes")
        # one agreement a step, from the batch whose fetch completed the measurement (the 3rd)
        # on, started at its fetch and read at its train_step: none holds the host at a fetch
        assert len(started) == 9 - 2 and not blocking, (started, blocking)
        assert sorted(graph.buckets) == sorted(rows), (graph.buckets, rows)
        assert graph.replays == 7 and graph.eager_steps == 2 and graph.padded == bool(rows), graph
        assert graph.over_capacity == 0, graph
        # the dense optimizer's host step counts are where eager steps leave them
        counts = {int(s["step"]) for opt in torch_optimizers(sm.optimizer) for s in opt.state.values()}
        assert counts == {9}, counts
    # Varying lengths: padded into one extra bag per feature; over capacity -> eager, counted.
    varying = make_batches(cfg, 10, rank)
    want = train(cfg, "base", varying)
    roomy = {f: 4 * cfg.data.batch_size for f in cfg.model.feature_names}  # at most 3 ids a sample
    got, graph, _ = _graphed(cfg, "sparse_dist", varying, StepGraphOptions(enabled=True, capacity_batches=2,
                                                                          capacity=roomy))
    assert_same(want, got, "step graph, padded batches")
    assert graph.padded and graph.replays == 8 and graph.eager_steps == 2 and graph.over_capacity == 0, graph
    # over capacity: the other features at their measured largest count (row-wise ones never)
    tight = StepGraphOptions(enabled=True, capacity_batches=2, headroom=1.0, capacity=row_features(cfg, (3, 3, 3, 3)))
    with pytest.warns(UserWarning, match="does not fit the captured step"):
        got, graph, _ = _graphed(cfg, "base", varying, tight)
    assert_same(want, got, "step graph, some batches over capacity")
    assert graph.over_capacity > 0 and graph.replays > 0 and graph.replays + graph.eager_steps == 10, graph
    assert "over capacity" in repr(graph)


@pytest.mark.slow
@pytest.mark.parametrize("tables", [TABLES, ROW_TABLES], ids=["table_column_wise", "every_type"])
@pytest.mark.parametrize("nproc", [1, 2])
def test_step_graph_trains_like_the_plain_loop(nproc, tables):
    launch_local(_worker, nproc, small_config(nproc, tables))


def _over_capacity_worker(cfg) -> None:
    init_process_group(cfg)
    rank = dist.get_rank()
    batches = make_batches(cfg, 8, rank)
    B = cfg.data.batch_size
    if rank == 1:  # batch 5: 5 ids a sample of the first feature, over its capacity on this rank only
        kjt = batches[5].sparse_features
        lengths = kjt.lengths().clone()
        lengths[:B] = 5
        values = torch.cat([torch.arange(5 * B) % 12, kjt.values()[kjt.length_per_key()[0]:]])
        batches[5] = Batch(batches[5].dense_features, KeyedJaggedTensor(keys=kjt.keys(), values=values,
                                                                        lengths=lengths),
                           batches[5].labels, batches[5].weights)
    want = train(cfg, "base", batches)
    roomy = {f: 4 * B for f in cfg.model.feature_names}  # at most 3 ids a sample, but batch 5 of rank 1
    options = StepGraphOptions(enabled=True, capacity_batches=2, capacity=roomy)
    eager, strides = step_graph.StepGraph._eager, {}
    step_graph.StepGraph._eager = lambda self, ctx, b: strides.setdefault(
        b.index, b.device.sparse_features.stride()) and eager(self, ctx, b)
    try:
        with pytest.warns(UserWarning, match="does not fit the captured step"), _agreements() as (blocking, started):
            got, graph, _ = _graphed(cfg, "sparse_dist", batches, options)
    finally:
        step_graph.StepGraph._eager = eager
    # rank 0 padded batch 5 at its fetch; rank 1 could not: both train it eagerly, unpadded
    assert started == [True] * 5 + [rank == 0] + [True] * 2, started  # capacities given: from the first batch
    assert strides == {0: B + 1, 1: B + 1, 5: B}, strides  # the warm-up steps padded, batch 5 as it came
    assert not blocking, blocking
    assert_same(want, got, "step graph, a batch over capacity on one rank")
    assert graph.padded and graph.replays == 5 and graph.eager_steps == 3 and graph.over_capacity == 1, graph


@pytest.mark.slow
def test_a_batch_one_rank_cannot_pad_trains_eagerly_on_every_rank():
    launch_local(_over_capacity_worker, 2, small_config(2, TABLES))


def test_padding_adds_one_bag_and_nothing_to_the_pooled_output():
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([3, 4, 5, 7]), lengths=torch.tensor([2, 1, 0, 1]))
    padded = pad_features(kjt, [4, 2])
    assert padded.stride() == 3 and padded.length_per_key() == [4, 2]
    assert padded.lengths().tolist() == [2, 1, 1, 0, 1, 1]
    assert padded.values().tolist() == [3, 4, 5, 3, 7, 7]  # copies of the key's own ids
    assert pad_features(kjt, [3, 1]).lengths().tolist() == [2, 1, 0, 0, 1, 0]  # a bag of nothing
    assert pad_features(kjt, [2, 2]) is None and pad_features(kjt, [3, 0]) is None  # over capacity
    bag = torch.nn.EmbeddingBag(10, 3, mode="sum")  # feature a: its two bags, then the padding bag
    want = bag(torch.tensor([3, 4, 5]), torch.tensor([0, 2]))
    got = bag(padded.values()[:4], torch.tensor([0, 2, 3]))
    assert got.shape[0] == 3 and torch.equal(want, got[:2])
    weighted = KeyedJaggedTensor(keys=["a"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]),
                                 weights=torch.tensor([0.5, 2.0]))
    assert pad_features(weighted, [5]).weights().tolist() == [0.5, 2.0, 0.0, 0.0, 0.0]


def test_signature_sees_ids_per_key_not_only_shapes():
    a = KeyedJaggedTensor(keys=["x", "y"], values=torch.arange(4), lengths=torch.tensor([2, 0, 1, 1]))
    b = KeyedJaggedTensor(keys=["x", "y"], values=torch.arange(4), lengths=torch.tensor([1, 0, 2, 1]))
    assert signature(a) != signature(b)  # same shapes, other ids per key: another captured step


def test_config_refuses_what_a_step_graph_cannot_hold():
    """recpipe.preflight's rules: the pipeline's capability, then the step graph's own."""
    def problems(*overrides):
        with pytest.raises(ConfigError) as err:
            check_rules(load_config(None, ["pipeline.step_graph=true", *overrides]))
        return str(err.value)

    refused = problems("pipeline.name=semi_sync")
    assert "pipeline.name='semi_sync'" in refused and "one_batch_per_step" in refused
    assert "pipelines that do: base, sparse_dist" in refused
    assert "pipeline.cuda_graphs=false" in problems("pipeline.name=sparse_dist", "pipeline.cuda_graphs=true")
    assert "UVM-cached" in problems("pipeline.name=sparse_dist", "sharding.default={kernel: fused_uvm_caching}",
                                    "train.device=cuda")
    for kind in ("row_wise", "table_row_wise"):  # their ids per rank are padded to a capacity: no refusal
        cfg = load_config(None, ["pipeline.step_graph=true", "pipeline.name=sparse_dist", "distributed.nproc=2",
                                 f"sharding.tables={{t_cat_0: {{type: {kind}}}}}"])
        check_rules(cfg)
        assert cfg.pipeline.step_graph.enabled
    assert "Adam" in problems("pipeline.name=sparse_dist", "optimizer.embedding.name=adam")
    assert "dense_gradients" in problems("pipeline.name=sparse_dist", "sharding.dense_gradients=ddp")
    assert "optimizer.dense.name=adagrad or sgd" in problems("pipeline.name=sparse_dist", "optimizer.dense.name=adam")
    assert "DistributedDataParallel" in problems("pipeline.name=sparse_dist",
                                                 "sharding.tables={t_cat_3: {type: data_parallel, kernel: dense}}")
    cfg = load_config(None, ["pipeline.name=sparse_dist", "pipeline.step_graph={capacity: {cat_0: 64}}"])
    assert not cfg.pipeline.step_graph.enabled and cfg.pipeline.step_graph.capacity == {"cat_0": 64}


def _refusals_worker(cfg) -> None:
    init_process_group(cfg)
    sm = build(cfg, torch.device("cpu"))
    first = PIPELINES["sparse_dist"](sm.model, sm.optimizer, torch.device("cpu"))
    with pytest.raises(PipelineError, match="CUDA device"):
        apply_step_graph(first.context, StepGraphOptions())
    first.detach()
    pipe = PIPELINES["fused_sparse_dist"](sm.model, sm.optimizer, torch.device("cpu"))
    with pytest.raises(PipelineError, match="does not offer one_batch_per_step"):
        apply_step_graph(pipe.context, StepGraphOptions(), capture=_no_graph)
    with pytest.raises(PipelineError, match="pipeline.step_graph needs one_batch_per_step"):
        apply_speedups(pipe, load_config(None, ["pipeline.name=fused_sparse_dist", "pipeline.step_graph=true"]).pipeline)
    pipe.detach()

    class Hooked(PIPELINES["sparse_dist"].engine_class()):
        def after_backward(self, batch, loss):
            pass

    with pytest.raises(PipelineError, match="after_backward"):
        apply_step_graph(Hooked(sm.model, sm.optimizer, torch.device("cpu")).context, StepGraphOptions(), capture=_no_graph)


def test_apply_refuses_other_pipelines_and_per_step_hooks():
    launch_local(_refusals_worker, 1, small_config(1, TABLES))


def _baked_embedding_rate(model, optimizer):
    """A stand-in capture that keeps, as a CUDA graph does, the embedding rate FBGEMM read
    on the host while capturing: each "replay" runs the step with that rate in the TBEs,
    whatever rate is set now, and no Python hook can change it (none runs in a replay)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    from recpipe.runtime.sharded import all_modules

    tbes = [m for m in all_modules(model) if isinstance(m, SplitTableBatchedEmbeddingBagsCodegen)]
    captures = []

    def capture(step):
        baked = [group["lr"] for opt in fused_optimizers(optimizer) for group in opt.param_groups]
        captures.append(baked)

        def replay():
            for tbe, rate in zip(tbes, itertools.cycle(baked)):
                tbe.set_learning_rate(rate)
            for tbe in tbes:
                tbe.set_learning_rate = lambda lr: None  # noqa: E731  (the host reads nothing in a replay)
            try:
                step()
            finally:
                for tbe in tbes:
                    del tbe.set_learning_rate
        return replay

    return capture, captures


def _scheduled_worker(cfg) -> None:
    from pipeline_harness import RunResult, local_state

    init_process_group(cfg)
    batches = _fixed_batches(cfg, 12, dist.get_rank())

    def run(graphed: bool):
        sm = build(cfg, torch.device("cpu"))
        pipe = PIPELINES["sparse_dist"](sm.model, sm.optimizer, torch.device("cpu"))
        graph = captures = None
        if graphed:
            capture, captures = _baked_embedding_rate(sm.model, sm.optimizer)
            graph = apply_step_graph(pipe.context, StepGraphOptions(enabled=True, capacity_batches=2), capture=capture)
        rates = LearningRates(cfg.optimizer, sm.optimizer, sm.model)
        losses, it = [], iter(batches)
        while True:
            rates.set_step(len(losses) + 1)
            try:
                loss, *_ = pipe.progress(it)
            except StopIteration:
                break
            losses.append(loss.clone())
        dist.barrier()
        return RunResult(losses, [], local_state(sm.model)), graph, captures

    want, _, _ = run(graphed=False)
    got, graph, captures = run(graphed=True)
    assert_same(want, got, "step graph with an embedding warm-up and step decay")
    # steps 1-2: eager (the graph's warm-up), 3: eager at a new rate (the warm-up's end), 4:
    # captured at lr, 5-6 replay it, 7: eager at a new rate (the decay), 8: captured at lr/2,
    # 9-12 replay it
    assert [c[0] for c in captures] == [pytest.approx(0.1), pytest.approx(0.05)], captures
    assert (graph.replays, graph.eager_steps, graph.lr_steps) == (8, 4, 2), graph


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_step_graph_trains_at_the_scheduled_embedding_rates(nproc):
    """FBGEMM reads the embedding rate on the host: a graph keeps the rate of its capture.
    A step at another rate runs eagerly and the graph is captured again once the rate holds;
    the dense rate (a device tensor) changes every step inside the replays."""
    schedules = ["optimizer.embedding.schedule={warmup_steps: 3, decay: step, decay_start_step: 7, gamma: 0.5}",
                 "optimizer.dense.schedule={warmup_steps: 12}"]
    launch_local(_scheduled_worker, nproc, small_config(nproc, TABLES + schedules))
