"""The pipeline numerics on CUDA streams (NCCL), with one, two and four GPUs, and
the prefetch pipeline with a UVM cache far smaller than the working set."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipeline_harness import assert_same, local_state, make, make_batches, semi_sync_reference, small_config, train
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from recpipe.pipelines.defs import fused_sparse_dist
import schedule_variants as variants

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FUSED = "sharding.tables={t_cat_1: {type: row_wise}, t_cat_2: {type: column_wise}}"
SYNCHRONOUS = [
    ("sparse_dist", {}),
    ("fused_sparse_dist", {}),
    ("fused_sparse_dist", {"schedule": variants.FUSED_LOOKUP_ON_OWN_STREAM}),
    ("fused_sparse_dist", {"schedule": variants.FUSED_LOOKUP_ON_DIST}),
    ("fused_sparse_dist", {"schedule": fused_sparse_dist.SCHEDULE_AFTER_OPTIMIZER}),
    ("prefetch", {}),
    ("prefetch", {"schedule": variants.PREFETCH_WAIT_BEFORE_FORWARD}),
    ("prefetch", {"schedule": variants.PREFETCH_EARLY_SPLITS}),
    ("sparse_dist", {"max_batches_ahead": 1}),
    ("sparse_dist", {"splits_exchange": "host"}),  # a Gloo group beside NCCL on 2 GPUs
    ("fused_sparse_dist", {"splits_exchange": "host"}),
]


def _numerics(cfg) -> None:
    device = init_process_group(cfg)
    batches = make_batches(cfg, 8, dist.get_rank())
    ref = train(cfg, "base", batches, device=device)
    for name, options in SYNCHRONOUS:
        assert_same(ref, train(cfg, name, batches, device=device, **options), f"cuda {name} {options}")
    assert_same(ref, train(cfg, "sparse_dist", batches, segments=[3, 5], device=device), "cuda segments")
    for start_batch, stash in [(0, False), (2, True)]:
        want = semi_sync_reference(cfg, batches, start_batch, stash, device=device)
        for wait in ("in_forward", "early"):
            got = train(cfg, "semi_sync", batches, device=device, start_batch=start_batch, stash_gradients=stash,
                        output_dist_wait=wait)
            assert_same(want, got, f"cuda semi_sync {start_batch} {stash} output_dist_wait={wait}")
            got = train(cfg, "semi_sync", batches, device=device, start_batch=start_batch, stash_gradients=stash,
                        output_dist_wait=wait, emb_lookup="before_update")
            assert_same(want, got, f"cuda semi_sync {start_batch} {stash} output_dist_wait={wait} before_update")


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_pipelines_match_base_on_cuda(nproc):
    launch_local(_numerics, nproc, small_config(nproc, ["train.device=cuda", FUSED]))


CACHED_ROWS = [2000, 3000, 4000, 5000]


def _zipf_batches(cfg, n, rank):
    """Zipf-distributed ids over tables far larger than the cache (forces evictions)."""
    from recpipe.data.synthetic import SyntheticClickLog
    from recpipe.data.spec import DataSpec

    log = SyntheticClickLog(DataSpec.from_config(cfg))
    return [log.batch(rank=rank, split="train", epoch=0, index=i) for i in range(n)]


def _prefetch_vs_hbm(hbm_cfg, cached_cfg) -> None:
    device = init_process_group(cached_cfg)
    rank = dist.get_rank()
    batches = _zipf_batches(cached_cfg, 10, rank)
    from pipeline_harness import build

    start = {k: v for k, v in build(hbm_cfg, device).model.state_dict().items()}
    hbm = train(hbm_cfg, "base", batches, device=device, init_from=start)
    for segments in ([10], [4, 6]):  # [4, 6]: a drain (and an eval, below) in the middle
        orders = {"the product's order": {}, "wait before forward": {"schedule": variants.PREFETCH_WAIT_BEFORE_FORWARD},
                  "early splits": {"schedule": variants.PREFETCH_EARLY_SPLITS}}
        for order, options in orders.items():  # recpipe's cache insert (the default)
            cached = train(cached_cfg, "prefetch", batches, device=device, init_from=start, segments=segments,
                           **options)
            assert_same(hbm, cached, f"prefetch ({order}) with a small UVM cache, segments {segments}")
        for options, sms in (({}, 2), ({"schedule": variants.PREFETCH_WAIT_BEFORE_FORWARD}, 8)):
            cached = train(cached_cfg, "prefetch", batches, device=device, init_from=start, segments=segments,
                           cache_fill_sms=sms, **options)
            assert_same(hbm, cached, f"prefetch cache_fill on {sms} SMs {options}, segments {segments}")
        cached = train(cached_cfg, "prefetch", batches, device=device, init_from=start, segments=segments,
                       cache_fill=False)  # FBGEMM's insert
        assert_same(hbm, cached, f"prefetch cache_fill=false, segments {segments}")
    for fill in (False, True):
        _eval_releases_locks(cached_cfg, batches, device, start, cache_fill=fill)
        _cache_reset_between_passes(cached_cfg, batches, device, start, cache_fill=fill)


def _cache_reset_between_passes(cfg, batches, device, start, **options) -> None:
    """Work queued on the compute stream between two passes (here a long kernel, then
    FBGEMM's flush and reset_cache_states, as the bench's cache sweep does) comes
    before the next pass's first prefetch on the prefetch stream: the pass trains as if
    the host had waited for it, and no cache-line lock is left over or negative."""
    from pipeline_harness import build
    from recpipe.pipelines.prefetch import cached_tbes

    def run(host_waits: bool):
        sm = build(cfg, device)
        sm.model.load_state_dict(dict(start))
        pipe = make("prefetch", sm, device, **options)
        losses = []
        for part in (batches[:5], batches[5:]):
            if losses:  # between the passes
                torch.cuda._sleep(200_000_000)  # ~0.1 s: the next pass's host work runs well ahead of it
                for tbe in cached_tbes(sm.model, locked=False):
                    tbe.flush()
                    tbe.reset_cache_states()
                if host_waits:
                    torch.cuda.synchronize()
            it = iter([b.pin_memory() for b in part])
            while True:
                try:
                    losses.append(pipe.progress(it)[0])
                except StopIteration:
                    break
        torch.cuda.synchronize()
        locks = [t.lxu_cache_locking_counter for t in cached_tbes(sm.model)]
        return losses, locks, {k: v.cpu() for k, v in local_state(sm.model).items()}

    want, _, want_state = run(host_waits=True)
    got, locks, got_state = run(host_waits=False)
    what = f"prefetch {options}, flush + reset_cache_states queued between passes"
    assert all(int(c.min()) >= 0 for c in locks), f"{what}: negative cache-line lock counts {[int(c.min()) for c in locks]}"
    assert all(int(c.sum()) == 0 for c in locks), f"{what}: locks left after the drain {[int(c.sum()) for c in locks]}"
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"{what}: loss of step {i} differs: {a.item()!r} vs {b.item()!r}"
    for key in want_state:
        assert torch.equal(want_state[key], got_state[key]), f"{what}: {key} differs"


def _eval_releases_locks(cfg, batches, device, start, **options) -> None:
    from pipeline_harness import build
    from recpipe.pipelines.prefetch import cached_tbes

    sm = build(cfg, device)
    sm.model.load_state_dict(dict(start))
    pipe = make("prefetch", sm, device, **options)
    it = iter([b.pin_memory() for b in batches[:4]])
    while True:
        try:
            pipe.progress(it)
        except StopIteration:
            break
    tbes = cached_tbes(sm.model)
    assert tbes, "no cached TBE found"
    assert all(int(t.lxu_cache_locking_counter.sum()) == 0 for t in tbes), "locks left after a drained pass"
    with pipe.detached(), torch.no_grad():
        sm.model.eval()
        sm.model(batches[5].to(device))
        sm.model.train()
        locked = sum(int(t.lxu_cache_locking_counter.sum()) for t in tbes)
    assert all(int(t.lxu_cache_locking_counter.sum()) == 0 for t in tbes), "eval forward left cache lines locked"
    print(f"rank {dist.get_rank()}: eval forward held {locked} cache-line locks until detached() released them")


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("passes", [1, 3])
def test_prefetch_with_small_uvm_cache_trains_like_hbm(nproc, passes):
    common = [
        "train.device=cuda",
        f"model.num_embeddings_per_feature={CACHED_ROWS}",
        "data.batch_size=256",
        "data.synthetic.zipf_alpha=1.1",
        "data.synthetic.mean_pooling_factors=3.0",
    ]
    hbm_cfg = small_config(nproc, common + ["sharding.tables={t_cat_1: {type: row_wise}}"])
    cached_cfg = small_config(
        nproc,
        common
        + [
            "sharding.default={type: table_wise, kernel: fused_uvm_caching, cache_load_factor: 0.02}",
            "sharding.tables={t_cat_1: {type: row_wise, kernel: fused_uvm_caching, cache_load_factor: 0.02}}",
            "sharding.uvm_host_mapped=true",
            f"sharding.prefetch_passes={passes}",
            "sharding.prefetch_min_pass_size=1",
            "pipeline.name=prefetch",
        ],
    )
    launch_local(_prefetch_vs_hbm, nproc, hbm_cfg, cached_cfg)


def _models(cfg) -> None:
    """Every model of tests/model_zoo.py on CUDA streams: each pipeline equals the plain
    loop (semi_sync its reference). Every case runs; the failures are reported together."""
    import model_zoo
    from test_pipelines_models import CASES

    device = init_process_group(cfg)
    rank = dist.get_rank()
    failures = []
    for case_name, make in CASES.items():
        case = make()
        batches = case.batches(rank, 6)
        ref = model_zoo.plain_loop(case, batches, device=device)
        runs = [("base", {}), ("sparse_dist", {}), ("prefetch", {})]
        runs += [("fused_sparse_dist", {}), ("fused_sparse_dist", {"schedule": variants.FUSED_LOOKUP_ON_OWN_STREAM})
                 ] if case.fused_ok else []
        for name, options in runs + [("semi_sync", {})]:
            try:
                got = model_zoo.run_pipeline(case, name, batches, device=device, **options)
                want = model_zoo.semi_sync_reference(case, batches, 0, False, device=device) if name == "semi_sync" else ref
                assert_same(want, got, f"cuda {case.name}: {name} {options}")
            except AssertionError as err:
                failures.append(str(err))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("nproc", [1, 2])
def test_any_model_matches_the_plain_loop_on_cuda(nproc):
    launch_local(_models, nproc, small_config(nproc, ["train.device=cuda"]))


def _graphs(cfg) -> None:
    """pipeline.cuda_graphs: every synchronous pipeline with graphs equals base with
    graphs bit for bit; semi_sync with graphs equals semi_sync's reference up to the
    graphed kernels; graphs vs eager is printed (and must agree closely)."""
    device = init_process_group(cfg)
    batches = make_batches(cfg, 8, dist.get_rank())
    ref = train(cfg, "base", batches, device=device, cuda_graphs=True)
    for name, options in SYNCHRONOUS:
        assert_same(ref, train(cfg, name, batches, device=device, cuda_graphs=True, **options), f"graphs {name} {options}")
    assert_same(ref, train(cfg, "sparse_dist", batches, segments=[3, 5], device=device, cuda_graphs=True), "graphs segments")
    eager = train(cfg, "base", batches, device=device)
    loss_diff = max(float((a - b).abs()) for a, b in zip(ref.losses, eager.losses))
    weight_diff = max(float((ref.state[k] - eager.state[k]).abs().max()) for k in ref.state)
    print(f"rank {dist.get_rank()}: graphs vs eager over {len(batches)} steps: max |loss diff| {loss_diff:.3g}, "
          f"max |weight diff| {weight_diff:.3g}, bit-identical: {loss_diff == 0 and weight_diff == 0}")
    assert loss_diff < 1e-4 and weight_diff < 1e-4
    got = train(cfg, "semi_sync", batches, device=device, cuda_graphs=True)
    want = semi_sync_reference(cfg, batches, 0, False, device=device)
    assert max(float((a - b).abs()) for a, b in zip(got.losses, want.losses)) < 1e-4


@pytest.mark.parametrize("nproc", [1, 2])
def test_cuda_graphs_keep_pipelines_bit_identical(nproc):
    launch_local(_graphs, nproc, small_config(nproc, ["train.device=cuda", FUSED]))


def _graphs_user_model(cfg) -> None:
    """Capture by module path (pipeline.cuda_graphs.modules) in a model recpipe has not seen."""
    import model_zoo

    device = init_process_group(cfg)
    case = model_zoo.two_tower()
    batches = case.batches(dist.get_rank(), 6)
    paths = {"cuda_graphs": True, "cuda_graph_modules": ["user_tower", "item_tower"]}
    base = model_zoo.run_pipeline(case, "base", batches, device=device, **paths)
    for name in ("sparse_dist", "fused_sparse_dist"):
        assert_same(base, model_zoo.run_pipeline(case, name, batches, device=device, **paths), f"two-tower graphs {name}")
    plain = model_zoo.plain_loop(case, batches, device=device)
    assert max(float((a - b).abs()) for a, b in zip(base.losses, plain.losses)) < 1e-4


@pytest.mark.parametrize("nproc", [1, 2])
def test_cuda_graphs_by_module_path(nproc):
    launch_local(_graphs_user_model, nproc, small_config(nproc, ["train.device=cuda"]))


def test_one_rank_shortcuts_are_exact_on_cuda():
    """The two one-rank shortcuts of recpipe.sharding (no DDP; row_wise tables placed
    table_wise) train bit-identically to torchrec's defaults on CUDA too."""
    from test_pipelines import FUSED_TABLES, _one_rank_ddp_worker, _one_rank_row_wise_worker

    cfg = small_config(1, ["train.device=cuda", *FUSED_TABLES])
    launch_local(_one_rank_ddp_worker, 1, cfg)
    launch_local(_one_rank_row_wise_worker, 1, cfg)


@pytest.mark.gpus(2)
def test_two_ranks_average_dense_gradients_exactly_as_ddp_on_cuda():
    """recpipe's flat all-reduce of the dense gradients (NCCL) trains bit-identically
    to torchrec's DDP wrapper on two GPUs, with and without CUDA graphs."""
    from test_pipelines import _dense_gradients_worker

    launch_local(_dense_gradients_worker, 2, small_config(2, ["train.device=cuda"]))
