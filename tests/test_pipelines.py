"""Every pipeline trains exactly like the plain loop (semi_sync: exactly like its
documented staleness), drains, pads uneven data, and refuses what it cannot run.
Two Gloo processes on CPU; the schedules are the same ones that run on CUDA."""

from __future__ import annotations

import itertools
import types

import pytest
import torch
import torch.distributed as dist

from pipeline_harness import (
    expect_pipeline_error,
    assert_differs,
    build,
    assert_same,
    make_batches,
    semi_sync_reference,
    small_config,
    train,
)
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from recpipe.pipelines import PIPELINES, PipelineError
from recpipe.pipelines import all_schedules
from recpipe.pipelines.defs import fused_sparse_dist
from recpipe.runtime.schedule import Schedule, Step
import schedule_variants as variants

FUSED_TABLES = ["sharding.tables={t_cat_1: {type: row_wise}, t_cat_2: {type: column_wise}}"]
SYNCHRONOUS = [
    ("sparse_dist", {}),
    ("fused_sparse_dist", {}),
    ("fused_sparse_dist", {"schedule": fused_sparse_dist.SCHEDULE_AFTER_OPTIMIZER}),
    ("fused_sparse_dist", {"schedule": variants.FUSED_LOOKUP_ON_OWN_STREAM}),
    ("prefetch", {}),
    ("prefetch", {"schedule": variants.PREFETCH_WAIT_BEFORE_FORWARD}),
    ("prefetch", {"schedule": variants.PREFETCH_EARLY_SPLITS}),
    ("sparse_dist", {"max_batches_ahead": 1}),
]


def _numerics_worker(cfg) -> None:
    init_process_group(cfg)
    batches = make_batches(cfg, 7, dist.get_rank())
    reference = train(cfg, "base", batches)
    for name, options in SYNCHRONOUS:
        assert_same(reference, train(cfg, name, batches, **options), f"{name} {options}")
    # Drains in the middle (eval/checkpoint segments) change nothing either.
    segmented = train(cfg, "base", batches, segments=[3, 1, 3])
    assert_same(reference, segmented, "base in segments")
    for name, options in SYNCHRONOUS[:2] + SYNCHRONOUS[4:5]:
        assert_same(reference, train(cfg, name, batches, segments=[3, 1, 3], **options), f"{name} in segments")


@pytest.mark.slow
def test_synchronous_pipelines_train_bit_identically_to_base():
    launch_local(_numerics_worker, 2, small_config(overrides=FUSED_TABLES))


def _splits_worker(cfg) -> None:
    """recpipe's fused splits all-to-all reads no splits tensor back to the host when
    it launches (torchrec 1.8's FusedKJTListSplitsAwaitable reads each one: a stream
    synchronize on CUDA); its wait (the one host sync on the splits) is torchrec's."""
    from torchrec.distributed.embedding_sharding import FusedKJTListSplitsAwaitable

    from recpipe.runtime import sharded

    device = init_process_group(cfg)
    batches = make_batches(cfg, 5, dist.get_rank())
    reads = {"ours": 0, "torchrec": 0, "fused": 0}
    real_init, real_tolist = sharded.FusedSplits.__init__, torch.Tensor.tolist

    def counting(who):
        def tolist(t):
            reads[who] += 1
            return real_tolist(t)
        return tolist

    def init(self, requests, contexts, pg):
        reads["fused"] += 1
        torch.Tensor.tolist = counting("ours")
        try:
            real_init(self, requests, contexts, pg)
        finally:
            torch.Tensor.tolist = real_tolist
        # torchrec's constructor on the same requests, for the record (it launches its own
        # splits all-to-all, so both ranks run it, in the same order)
        torch.Tensor.tolist = counting("torchrec")
        try:
            theirs = FusedKJTListSplitsAwaitable(requests, contexts, pg)
        finally:
            torch.Tensor.tolist = real_tolist
        theirs.wait()

    sharded.FusedSplits.__init__ = init
    try:
        train(cfg, "sparse_dist", batches, device=device)
    finally:
        sharded.FusedSplits.__init__ = real_init
    assert reads["fused"] >= 3, reads
    assert reads["ours"] == 0, reads
    print(f"rank {dist.get_rank()}: host reads of splits tensors at launch: {reads}")


def test_fused_splits_launch_reads_nothing_back():
    launch_local(_splits_worker, 2, small_config(overrides=FUSED_TABLES))


def _one_rank_worker(cfg) -> None:
    """One rank: the pipelines train like base (semi_sync like its reference) with no
    collective at all (the splits of a one-rank all-to-all are its input's: nothing to
    exchange, nothing to read back)."""
    device = init_process_group(cfg)
    batches = make_batches(cfg, 6, 0)
    ref = train(cfg, "base", batches, device=device)
    calls = []
    real = dist.all_to_all_single

    def counting(*args, **kwargs):
        calls.append(len(args) + len(kwargs))
        return real(*args, **kwargs)

    dist.all_to_all_single = counting
    try:
        for name, options in SYNCHRONOUS:
            assert_same(ref, train(cfg, name, batches, device=device, **options), f"one rank {name} {options}")
        got = train(cfg, "semi_sync", batches, device=device, start_batch=1)
        assert_same(semi_sync_reference(cfg, batches, 1, False, device=device), got, "one rank semi_sync")
    finally:
        dist.all_to_all_single = real
    assert not calls, f"{len(calls)} all-to-alls on one rank"


def _host_splits_worker(cfg) -> None:
    """pipeline.splits_exchange=host: the splits go over a Gloo group from host memory
    (on this Gloo job: the job's group), nothing of them to the device; every
    pipeline trains exactly as with the device exchange."""
    from recpipe.runtime import sharded

    device = init_process_group(cfg)
    batches = make_batches(cfg, 6, dist.get_rank())
    ref = train(cfg, "base", batches, device=device)
    made: dict[str, int] = {}
    real = sharded.FusedSplits.__init__

    def counting(self, *a, **k):  # the fused exchanges, by kind
        real(self, *a, **k)
        kind = type(self._splits_awaitable).__name__
        made[kind] = made.get(kind, 0) + 1

    sharded.FusedSplits.__init__ = counting
    try:
        for name, options in SYNCHRONOUS:
            got = train(cfg, name, batches, device=device, splits_exchange="host", **options)
            assert_same(ref, got, f"splits_exchange=host {name} {options}")
        got = train(cfg, "semi_sync", batches, device=device, start_batch=1, splits_exchange="host")
        assert_same(semi_sync_reference(cfg, batches, 1, False, device=device), got, "splits_exchange=host semi_sync")
    finally:
        sharded.FusedSplits.__init__ = real
    # The model's group is not Gloo on GPUs: a Gloo group of its ranks is made, once per job.
    real_backend, groups = sharded._backend, []
    sharded._backend = lambda pg: "nccl"
    real_new_group = dist.new_group

    def new_group(*a, **k):
        groups.append(k.get("backend"))
        return real_new_group(*a, **k)

    dist.new_group = new_group
    try:
        for _ in range(2):
            got = train(cfg, "sparse_dist", batches, device=device, splits_exchange="host")
            assert_same(ref, got, "splits_exchange=host over a Gloo group of its own")
    finally:
        sharded._backend, dist.new_group = real_backend, real_new_group
    assert groups == ["gloo"], groups
    # every fused exchange on the host; each pipeline's first input dist goes unfused (torchrec's
    # own all-to-alls, before the pipeline installs its own), so it exchanges nothing here
    assert set(made) == {"HostSplitsExchange", "NoneType"}, made
    assert made["NoneType"] == len(SYNCHRONOUS) + 1 and made["HostSplitsExchange"] >= 3 * len(SYNCHRONOUS), made


def test_host_splits_exchange_trains_like_the_device_one():
    launch_local(_host_splits_worker, 2, small_config(overrides=FUSED_TABLES))


def _lengths_worker(cfg) -> None:
    """Batches that come without their ids per key get them summed on the host copy,
    so the sharded modules' input dists (``KeyedJaggedTensor.permute``) need not read
    them back from the device."""
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    device = init_process_group(cfg)
    batches = make_batches(cfg, 5, dist.get_rank())
    assert all(b.sparse_features._length_per_key is None for b in batches)  # the harness makes none
    seen = []
    real = ShardedEmbeddingBagCollection.input_dist

    def input_dist(self, ctx, features):
        seen.append(features._length_per_key)
        return real(self, ctx, features)

    ShardedEmbeddingBagCollection.input_dist = input_dist
    try:
        train(cfg, "sparse_dist", batches, device=device)
    finally:
        ShardedEmbeddingBagCollection.input_dist = real
    B, F = cfg.data.batch_size, len(cfg.model.num_embeddings_per_feature)
    # batch 0 runs the model's own forward while the pipeline learns where the inputs are
    assert len(seen) == len(batches)
    assert seen[1:] == [b.sparse_features.lengths().view(F, B).sum(dim=1).tolist() for b in batches[1:]], seen


def test_pipelines_hand_the_input_dist_its_ids_per_key():
    launch_local(_lengths_worker, 1, small_config(1, overrides=FUSED_TABLES))


def test_one_rank_pipelines_run_no_collective():
    launch_local(_one_rank_worker, 1, small_config(1, overrides=FUSED_TABLES))


def _pass_fence_worker(cfg) -> None:
    """Every pass over data starts with the side streams fenced on the caller's stream
    (``Streams.start_pass``), before any step of the pass; never with a batch in
    flight. Work queued between passes (an eval, FBGEMM's cache reset) must come
    before the pass's first prefetch (GPU test: test_prefetch_with_small_uvm_cache_trains_like_hbm)."""
    from recpipe.runtime.streams import Streams

    device = init_process_group(cfg)
    batches = make_batches(cfg, 6, 0)
    for name in sorted(PIPELINES):
        sm = build(cfg, device)
        events: list = []
        pipe = PIPELINES[name](sm.model, sm.optimizer, device)
        real = Streams.start_pass
        Streams.start_pass = lambda self: events.append(("start", pipe.in_flight()))
        pipe.on_batch_fetched = lambda batch: events.append(("fetch", pipe.in_flight()))
        try:
            for part in (batches[:4], batches[4:]):
                _drain(pipe, iter(part))
                events.append(("drained", pipe.in_flight()))
                with pipe.detached():
                    pass
        finally:
            Streams.start_pass = real
        assert all(n == 0 for kind, n in events if kind == "start"), (name, events)
        passes = [list(g) for k, g in itertools.groupby(events, lambda e: e[0] == "drained") if not k]
        assert len(passes) == 2, (name, events)
        for got, size in zip(passes, (4, 2)):
            assert got[0][0] == "start", (name, got)  # before the pass's first batch is fetched
            assert sum(kind == "fetch" for kind, _ in got) == size, (name, got)
            # once at the first call, once at the call that finds nothing left (StopIteration)
            assert sum(kind == "start" for kind, _ in got) == 2, (name, got)


def test_every_pass_starts_with_the_side_streams_fenced():
    launch_local(_pass_fence_worker, 1, small_config(1, overrides=FUSED_TABLES))


def _one_rank_ddp_worker(cfg) -> None:
    """One rank: no DDP around the unsharded modules (it has no peer; its hooks cost
    host time every step), and training is bit-identical to torchrec's default DDP
    wrapper, for base and a pipelined schedule."""
    from torch.nn.parallel import DistributedDataParallel
    from torchrec.distributed.model_parallel import DefaultDataParallelWrapper

    from recpipe.sharding import build as sharding_build

    device = init_process_group(cfg)
    batches = make_batches(cfg, 6, dist.get_rank())
    ddp_count = lambda model: sum(isinstance(m, DistributedDataParallel) for m in model.modules())  # noqa: E731
    assert ddp_count(build(cfg, device).model) == 0
    ours = {name: train(cfg, name, batches, device=device) for name in ("base", "sparse_dist")}
    real = sharding_build.DataParallelAcrossRanks.wrap
    sharding_build.DataParallelAcrossRanks.wrap = lambda self, dmp, env, device: DefaultDataParallelWrapper().wrap(
        dmp, env, device)
    try:
        assert ddp_count(build(cfg, device).model) == 1
        for name, got in ours.items():
            assert_same(train(cfg, name, batches, device=device), got, f"{name}: no DDP vs DDP at one rank")
    finally:
        sharding_build.DataParallelAcrossRanks.wrap = real


def test_one_rank_trains_without_ddp_exactly_as_with_it():
    launch_local(_one_rank_ddp_worker, 1, small_config(1, overrides=FUSED_TABLES))


def _dense_gradients_worker(cfg) -> None:
    """Two ranks: ``sharding.dense_gradients: all_reduce`` (recpipe's one flat
    all-reduce after the backward, no DDP) trains bit-identically to torchrec's DDP
    wrapper (``ddp``), for base and the pipelined schedules. (torchrec keeps its own
    DDP inside a data_parallel table's lookup; both ways have it.)"""
    from torch.nn.parallel import DistributedDataParallel

    device = init_process_group(cfg)
    batches = make_batches(cfg, 6, dist.get_rank())
    outer_ddp = lambda model: isinstance(model._dmp_wrapped_module, DistributedDataParallel)  # noqa: E731
    sm = build(cfg, device)
    sync = sm.model.gradient_all_reduce
    assert not outer_ddp(sm.model) and len(sync.names) == 8 and all("_arch" in n for n in sync.names), sync.names
    ddp = cfg.model_copy(update={"sharding": cfg.sharding.model_copy(update={"dense_gradients": "ddp"})})
    assert outer_ddp(build(ddp, device).model)
    device_set = [f"train.device={cfg.train.device}"]
    fused = small_config(2, device_set + FUSED_TABLES)  # semi_sync refuses data_parallel tables
    fused_ddp = small_config(2, device_set + FUSED_TABLES + ["sharding.dense_gradients=ddp"])
    runs = [("base", cfg, ddp, {}), ("sparse_dist", cfg, ddp, {}), ("semi_sync", fused, fused_ddp, {"start_batch": 1})]
    if device.type == "cuda":  # the dense part's backward replayed as a CUDA graph feeds the same hooks
        runs += [("sparse_dist", fused, fused_ddp, {"cuda_graphs": True}),
                 ("semi_sync", fused, fused_ddp, {"start_batch": 1, "cuda_graphs": True})]
    for name, ours, theirs, options in runs:
        got = train(ours, name, batches, device=device, **options)
        assert build(ours, device).model.gradient_all_reduce is not None
        assert_same(train(theirs, name, batches, device=device, **options), got, f"{name}: all_reduce vs DDP, two ranks")
        assert_differs(train(ours, name, batches[:3] + batches[3:][::-1], device=device, **options), got,
                       f"{name}: other batches")


def test_two_ranks_average_dense_gradients_exactly_as_ddp():
    launch_local(_dense_gradients_worker, 2, small_config())


def _one_rank_row_wise_worker(cfg) -> None:
    """One rank: a row_wise table is placed table_wise (torchrec batches it into the
    table_wise tables' TBE) and trains exactly as torchrec's row-wise sharding of it."""
    from recpipe.table_sharding import placement

    device = init_process_group(cfg)
    batches = make_batches(cfg, 6, dist.get_rank())

    def placed(name: str) -> str:
        plans = build(cfg, device).plan.plan.values()
        return next(p[name].sharding_type for p in plans if name in p)

    assert cfg.sharding.for_table("t_cat_1").type == "row_wise" and placed("t_cat_1") == "table_wise"
    assert placed("t_cat_2") == "column_wise"
    ours = {name: train(cfg, name, batches, device=device) for name in ("base", "sparse_dist")}
    real = placement.placed_type
    placement.placed_type = lambda t, world_size: t.type
    try:
        assert placed("t_cat_1") == "row_wise"
        for name, got in ours.items():
            assert_same(train(cfg, name, batches, device=device), got,
                        f"{name}: row_wise placed table_wise vs row_wise at one rank")
    finally:
        placement.placed_type = real


def test_one_rank_places_row_wise_tables_table_wise_with_the_same_numbers():
    launch_local(_one_rank_row_wise_worker, 1, small_config(1, overrides=FUSED_TABLES))


def _semi_sync_worker(cfg) -> None:
    init_process_group(cfg)
    batches = make_batches(cfg, 7, dist.get_rank())
    base = train(cfg, "base", batches)
    for start_batch, stash in [(0, False), (3, False), (0, True), (2, True)]:
        got = train(cfg, "semi_sync", batches, start_batch=start_batch, stash_gradients=stash)
        assert_same(semi_sync_reference(cfg, batches, start_batch, stash), got, f"semi_sync {start_batch} {stash}")
        assert_differs(base, got, "semi_sync vs base (staleness must be visible on these batches)")
    # The variant that waits for the output all-to-all right after the lookup: same numbers.
    got = train(cfg, "semi_sync", batches, start_batch=2, output_dist_wait="early")
    assert_same(semi_sync_reference(cfg, batches, 2, False), got, "semi_sync output_dist_wait=early")
    # The lookup of i+1 inside backward(i), before its TBE update: same numbers, with either wait.
    for start_batch, stash, wait in [(0, False, "in_forward"), (2, True, "in_forward"), (1, False, "early")]:
        got = train(cfg, "semi_sync", batches, start_batch=start_batch, stash_gradients=stash, output_dist_wait=wait,
                    emb_lookup="before_update")
        assert_same(semi_sync_reference(cfg, batches, start_batch, stash), got,
                    f"semi_sync emb_lookup=before_update {start_batch} {stash} {wait}")
    # All warm-up: synchronous numerics, identical to base.
    assert_same(base, train(cfg, "semi_sync", batches, start_batch=100), "semi_sync warm-up only")
    # before_update's forward hooks on torchrec's lookup modules live while the pipeline is attached
    from pipeline_harness import build
    from recpipe.pipelines import SemiSyncPipeline
    from recpipe.runtime import sharded

    sm = build(cfg, torch.device("cpu"))
    lookups = [lk for m in sharded.find_sharded_modules(sm.model).values() for lk in m._lookups]
    before = sum(len(lk._forward_hooks) for lk in lookups)
    pipe = SemiSyncPipeline(sm.model, sm.optimizer, torch.device("cpu"), emb_lookup="before_update")
    assert sum(len(lk._forward_hooks) for lk in lookups) == before + len(lookups)
    pipe.detach()
    assert sum(len(lk._forward_hooks) for lk in lookups) == before, "hooks left after detach"
    pipe.attach()
    assert sum(len(lk._forward_hooks) for lk in lookups) == before + len(lookups)
    pipe.detach()


@pytest.mark.slow
def test_semi_sync_matches_its_documented_staleness():
    launch_local(_semi_sync_worker, 2, small_config(overrides=FUSED_TABLES))


def _data_worker(cfg) -> None:
    init_process_group(cfg)
    rank = dist.get_rank()
    # Uneven: rank 0 has 6 batches, rank 1 has 4. Both train 6 steps; rank 1's last
    # two are zero-weight padding, exactly as if it had been handed them.
    full = make_batches(cfg, 6, rank)
    mine = full if rank == 0 else full[:4]
    explicit = full if rank == 0 else full[:4] + [full[3].as_padding()] * 2
    reference = train(cfg, "base", explicit)
    for name in ("base", "sparse_dist", "fused_sparse_dist", "prefetch"):
        got = train(cfg, name, mine)
        assert len(got.losses) == 6, f"{name}: rank {rank} trained {len(got.losses)} steps, expected 6"
        assert_same(reference, got, f"{name} with uneven data")
        pad = [bool(w.eq(0).all()) for w in got.weights]
        assert pad == ([False] * 6 if rank == 0 else [False] * 4 + [True] * 2), pad
    try:
        train(cfg, "sparse_dist", mine, uneven_data="error")
    except PipelineError as err:
        assert "ran out of data" in str(err), err
    else:
        raise AssertionError("uneven_data='error' did not raise")
    dist.barrier()
    # A rank with no batch of its own (resumed past its end) pads from padding_template.
    sm = build(cfg, torch.device("cpu"))
    pipe = PIPELINES["sparse_dist"](sm.model, sm.optimizer, torch.device("cpu"))
    pipe.padding_template = full[0]
    outs = _drain(pipe, iter(full[:2] if rank == 0 else []))
    assert [bool(w.eq(0).all()) for *_, w in outs] == ([False, False] if rank == 0 else [True, True])
    dist.barrier()
    # Epochs: a new iterator each time, and one iterator object reused after it ended.
    batches = make_batches(cfg, 5, rank)
    torch.manual_seed(0)
    two_epochs = train(cfg, "sparse_dist", batches + batches)
    assert len(two_epochs.losses) == 10
    assert_same(two_epochs, train(cfg, "sparse_dist", batches + batches, segments=[5, 5]), "new iterator per epoch")
    reused = _Reusable(batches, epochs=2)
    from recpipe.models import build_model
    from recpipe.sharding import shard_model

    torch.manual_seed(cfg.train.seed)
    sm = shard_model(build_model(cfg.model), cfg, torch.device("cpu"))
    pipe = PIPELINES["sparse_dist"](sm.model, sm.optimizer, torch.device("cpu"))
    per_pass, losses = [], []
    for _ in range(2):
        count = 0
        while True:
            try:
                losses.append(pipe.progress(reused)[0])
                count += 1
            except StopIteration:
                break
        per_pass.append(count)
    assert per_pass == [5, 5] and pipe.in_flight() == 0, (per_pass, pipe.in_flight())
    assert all(torch.equal(a, b) for a, b in zip(losses, two_epochs.losses)), "reused iterator trains differently"
    # 5 batches + the one StopIteration per epoch: no next() after an epoch ended
    # (which would pull the next epoch's first batch into this pass).
    assert reused.calls == 12, reused.calls


def _drain(pipe, it):
    outs = []
    while True:
        try:
            outs.append(pipe.progress(it))
        except StopIteration:
            return outs


class _Reusable:
    """An iterator that ends each epoch with StopIteration and then hands out the
    next epoch (like DataLoader iterators with persistent workers)."""

    def __init__(self, batches, epochs):
        self.batches, self.epochs, self.pos, self.calls = batches, epochs, 0, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.calls += 1
        if self.pos == len(self.batches):
            self.pos, self.epochs = 0, self.epochs - 1
            raise StopIteration
        self.pos += 1
        return self.batches[self.pos - 1]


@pytest.mark.slow
def test_drain_uneven_data_and_epochs():
    launch_local(_data_worker, 2, small_config(overrides=FUSED_TABLES))


def _errors_worker(cfg) -> None:
    from recpipe.models import RecModel, build_model
    from recpipe.sharding import shard_model

    init_process_group(cfg)
    cpu = torch.device("cpu")
    batches = make_batches(cfg, 3, dist.get_rank())

    def sharded(model_cls=RecModel, c=cfg):
        torch.manual_seed(0)
        model = model_cls(build_model(c.model).model)
        return shard_model(model, c, cpu)

    expect = expect_pipeline_error

    sm = sharded(_PermutingModel)
    pipe = PIPELINES["sparse_dist"](sm.model, sm.optimizer, cpu)
    expect(lambda: pipe.progress(iter(batches)), "model.sparse_arch.embedding_bag_collection", "not in the batch", "data loader", "inputs=")

    sm = sharded(_TwiceModel)
    pipe = PIPELINES["sparse_dist"](sm.model, sm.optimizer, cpu)
    expect(lambda: pipe.progress(iter(batches)), "called twice")

    sm = sharded()
    pipe = PIPELINES["sparse_dist"](sm.model, sm.optimizer, cpu)
    expect(lambda: sm.model(batches[0]), "outside pipeline.progress()", "detached()")
    with pipe.detached():  # evaluation outside the pipeline works
        sm.model(batches[0])
    assert "PipelinedForward" in repr(pipe)

    dp_cfg = small_config(overrides=["sharding.tables={t_cat_3: {type: data_parallel, kernel: dense}}"])
    sm = sharded(c=dp_cfg)
    # The dense optimizer steps a data_parallel table: the lookup of i+1 waits for it.
    assert PIPELINES["fused_sparse_dist"](sm.model, sm.optimizer, cpu).schedule is fused_sparse_dist.SCHEDULE_AFTER_OPTIMIZER
    sm = sharded(c=dp_cfg)
    expect(lambda: PIPELINES["fused_sparse_dist"](sm.model, sm.optimizer, cpu, schedule=fused_sparse_dist.SCHEDULE),
           "t_cat_3", "data_parallel")
    expect(lambda: PIPELINES["semi_sync"](sm.model, sm.optimizer, cpu), "t_cat_3", "data_parallel")

    plain = RecModel(build_model(cfg.model, device=cpu).model)
    expect(lambda: PIPELINES["sparse_dist"](plain, torch.optim.SGD(plain.parameters(), lr=0.1), cpu), "no torchrec sharded module")


class _PermutingModel(torch.nn.Module):
    """Changes the KJT before the embedding module: cannot be input-dist'ed ahead."""

    def __init__(self, dlrm):
        super().__init__()
        self.model = dlrm

    def forward(self, batch):
        kjt = batch.sparse_features
        kjt = kjt.permute(list(reversed(range(len(kjt.keys())))))
        kjt = kjt.permute(list(reversed(range(len(kjt.keys())))))
        logits = self.model(batch.dense_features, kjt).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


class _TwiceModel(_PermutingModel):
    def forward(self, batch):
        self.model.sparse_arch(batch.sparse_features)
        logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


@pytest.mark.slow
def test_unpipelinable_models_get_errors_that_say_what_to_change():
    launch_local(_errors_worker, 2, small_config(overrides=FUSED_TABLES))


def test_every_schedule_is_valid_and_printable(capsys):
    from recpipe.cli import main

    for name, schedules in all_schedules().items():
        assert name in PIPELINES
        for schedule in schedules:
            schedule.validate()
            # A pipeline switches between schedules that move batches alike (semi_sync's warm-up and
            # main schedule, fused_sparse_dist's two lookup orders); the engine checks the pair it runs.
            assert len(schedules) == 1 or any(schedule.same_stages(o) for o in schedules if o is not schedule), schedule.name
        assert main(["schedule", name]) == 0
        printed = capsys.readouterr().out
        assert all(s.name in printed for s in schedules[0].steps)
    assert main(["schedule", "nope"]) == 2


@pytest.mark.parametrize(
    "steps, message",
    [
        ((Step("h2d", "memcpy", 1), Step("h2d", "memcpy", 1), Step("forward", "compute", 0)), "more than once"),
        ((Step("forward", "compute", 0), Step("input_dist", "dist", 1), Step("h2d", "memcpy", 1)), "first step"),
        ((Step("h2d", "memcpy", 1), Step("forward", "compute", 0, waits=(("backward", 0),)), Step("backward", "compute", 0)), "runs later"),
        ((Step("h2d", "gpu", 1), Step("forward", "compute", 0)), "stream role"),
    ],
)
def test_schedule_validation_rejects_broken_tables(steps, message):
    with pytest.raises(ValueError, match=message):
        Schedule("broken", steps, doc="").validate()


def test_catch_up_runs_every_earlier_stage_once():
    for schedules in all_schedules().values():
        s = schedules[0]
        for slot in range(s.depth):
            names = [step.name for step in s.catch_up(slot)]
            assert names == [step.name for off in range(s.depth - 1, slot, -1) for step in s.steps_at(off)]
            assert len(names) == len(set(names))


@pytest.mark.parametrize("lookup_on", ["dist", "new", "compute"])
@pytest.mark.parametrize("max_batches_ahead", [None, 1])
def test_compiled_plans_drop_only_same_stream_fences(lookup_on, max_batches_ahead):
    """The engine drops a schedule's wait only when both steps run on one stream
    (stream order), keeps every wait across streams, and records an event after
    every step such a wait names. Checked with distinct stand-in streams (as on CUDA)."""
    from recpipe.runtime.streams import Streams

    s = {role: object() for role in ("compute", "memcpy", "dist", "prefetch", "new")}
    streams = Streams(s["compute"], s["memcpy"], s["dist"], s[lookup_on] if lookup_on != "dist" else s["dist"], s["prefetch"])
    for name, schedules in all_schedules().items():
        for schedule in (*schedules, *variants.VARIANTS.get(name, ())):
            pipe = object.__new__(PIPELINES[name].engine_class())  # only what compiling a plan reads
            pipe.context = types.SimpleNamespace(streams=streams)
            pipe.max_batches_ahead, pipe._plans, pipe.schedule = max_batches_ahead, {}, schedule
            pipe._wrappers, pipe._extra_steps = {}, {}
            _, ops, by_name = pipe._plan(schedule)
            stream_of = {step.name: streams.by_role(step.stream) for step in schedule.steps}
            for op in ops:
                assert op.stream is stream_of[op.step.name]
                cross = tuple((d, k) for d, k in op.step.waits if stream_of[d] is not op.stream)
                assert op.fences == cross, (name, schedule.name, op.step.name, op.fences, cross)
                for dep, _ in cross:
                    assert by_name[dep].record, (name, schedule.name, dep)
            if max_batches_ahead is not None:
                assert by_name["optimizer"].record
