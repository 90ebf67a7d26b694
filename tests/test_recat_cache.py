"""``pipeline.recat_cache`` (recpipe.speedups.recat_cache): torchrec's recat indices made
once per splits layout, on 2 Gloo ranks: the pipelines train bit-identically with it, and
after the first step torchrec makes no recat tensor (on CUDA each was a host-to-device copy
the host waited for)."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from pipeline_harness import RunResult, assert_same, build, local_state, make, make_batches, small_config, train
from recpipe.config import load_config
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from recpipe.speedups import recat_cache

STEPS = 6


def _with_cache(cfg, name, batches) -> tuple[RunResult, int, int]:
    """Train ``batches`` with ``name`` and the recat cache; the result, the recat tensors
    torchrec was asked for and those it made."""
    from torchrec.distributed import dist_data

    made = []
    original = dist_data._get_recat
    dist_data._get_recat = lambda *a, **k: made.append(a) or original(*a, **k)
    try:
        sm = build(cfg, torch.device("cpu"))
        pipe = make(name, sm, torch.device("cpu"))
        handle = recat_cache.apply(pipe.context, None)
        losses, weights = [], []
        it = iter(batches)
        for _ in itertools.count():
            try:
                loss, _, _, w = pipe.progress(it)
            except StopIteration:
                break
            losses.append(loss)
            weights.append(w)
        asked = handle.cache.calls
    finally:
        dist_data._get_recat = original
    assert "recat cache" in repr(handle)
    return RunResult(losses, weights, local_state(sm.model)), asked, len(made)


def _worker(cfg) -> None:
    init_process_group(cfg)
    batches = make_batches(cfg, STEPS, dist.get_rank())
    for name in ("base", "sparse_dist", "fused_sparse_dist", "prefetch"):
        want = train(cfg, name, batches)
        got, asked, made = _with_cache(cfg, name, batches)
        assert_same(want, got, f"{name} with the recat cache")
        # torchrec asks at every input dist (one per sharding group and batch); each layout is made once
        assert asked >= STEPS and made < asked, (name, asked, made)
        assert made <= 3, (name, made)


def test_pipelines_train_alike_and_make_each_recat_once():
    launch_local(_worker, 2, small_config(2))


def test_the_config_switches_it():
    from recpipe.speedups.registry import SPEEDUPS

    assert "recat_cache" in SPEEDUPS
    assert not load_config(None, []).pipeline.recat_cache.enabled
    assert load_config(None, ["pipeline.name=sparse_dist", "pipeline.recat_cache=true"]).pipeline.recat_cache.enabled
