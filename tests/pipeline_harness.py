"""Shared by the pipeline tests: train a small sharded DLRM with any pipeline from
one seed on fixed batches, and return what a numerics comparison needs."""

from __future__ import annotations

from typing import Any

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.capabilities import INTERCEPTS, PREFETCH_STEP
from recpipe.config import RecpipeConfig, load_config
from recpipe.data.batch import Batch
from recpipe.models import make_model
from recpipe.pipelines import PIPELINES
from recpipe.sharding import shard_model

SMALL_TABLES = [40, 60, 80, 100]


def small_config(nproc: int = 2, overrides: list[str] | None = None) -> RecpipeConfig:
    base = [
        f"distributed.nproc={nproc}",
        f"model.num_embeddings_per_feature={SMALL_TABLES}",
        "model.embedding_dim=8",
        "model.dense_arch_layer_sizes=[16,8]",
        "model.over_arch_layer_sizes=[16,1]",
        "data.batch_size=16",
        # one table of each sharding type, so every all-to-all path is exercised
        "sharding.tables={t_cat_1: {type: row_wise}, t_cat_2: {type: column_wise}, "
        "t_cat_3: {type: data_parallel, kernel: dense}}",
        "optimizer.embedding.lr=0.1",
        "optimizer.dense.lr=0.1",
    ]
    return load_config(None, base + list(overrides or []))


def make_batches(cfg: RecpipeConfig, n: int, rank: int, seed: int = 0, spread: bool = True) -> list[Batch]:
    """Deterministic host batches; few distinct ids so consecutive batches share rows
    (otherwise one-step staleness would be invisible), spread over each whole table so a
    row-wise table's ids fall in every rank's rows (otherwise the other ranks' partial
    sums are zero and the row-wise reduction is not tested). ``spread=False``: ids 0-11 only."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    B = cfg.data.batch_size
    out = []
    for _ in range(n):
        lengths = torch.randint(1, 4, (len(SMALL_TABLES) * B,), generator=g, dtype=torch.int32)
        chunks, start = [], 0
        for f, rows in enumerate(cfg.model.num_embeddings_per_feature):
            count = int(lengths[f * B : (f + 1) * B].sum())
            ids = torch.randint(0, min(rows, 12), (count,), generator=g)
            chunks.append(ids * max(rows // 12, 1) if spread else ids)
            start += count
        kjt = KeyedJaggedTensor(keys=cfg.model.feature_names, values=torch.cat(chunks), lengths=lengths)
        dense = torch.randn(B, cfg.model.num_dense_features, generator=g)
        labels = torch.randint(0, 2, (B,), generator=g).float()
        out.append(Batch(dense, kjt, labels, torch.ones(B)))
    return out


@dataclass
class RunResult:
    losses: list[torch.Tensor]
    weights: list[torch.Tensor]  # per-step loss weights (padding batches are 0)
    state: dict[str, torch.Tensor]  # every local tensor of the model state (shards included)


def local_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in model.state_dict().items():
        if hasattr(value, "local_shards"):
            for i, shard in enumerate(value.local_shards()):
                out[f"{key}#{i}"] = shard.tensor.detach().clone()
        else:
            out[key] = value.detach().clone()
    return out


def build(cfg: RecpipeConfig, device: torch.device):
    torch.manual_seed(cfg.train.seed)
    return shard_model(make_model(cfg), cfg, device)


def make(name: str, sm: Any, device: torch.device, *, cuda_graphs: bool = False,
         cuda_graph_modules: tuple[str, ...] = (), cuda_graph_optimizer: bool = True, cache_fill: bool = True,
         cache_fill_sms: int = 4, splits_exchange: str = "device", **options: Any) -> Any:
    """Pipeline ``name`` on the sharded model ``sm`` with the speed features
    ``make_pipeline`` applies for the same config: ``cuda_graphs=True``
    (recpipe.speedups.cuda_graphs on its model and optimizer) and, with a prefetch step,
    recpipe's cache insert unless ``cache_fill=False`` (recpipe.speedups.cache_fill) and
    the cache bookkeeping on the prefetch stream (recpipe.speedups.cache_bookkeeping);
    ``splits_exchange="host"``: the splits exchanged on the host (recpipe.speedups.splits_exchange)."""
    if cuda_graphs:
        from recpipe.speedups.cuda_graphs import CudaGraphsOptions, apply_cuda_graphs

        apply_cuda_graphs(sm.model, sm.optimizer, device, CudaGraphsOptions(
            enabled=True, modules=list(cuda_graph_modules), optimizer=cuda_graph_optimizer))
    pipe = PIPELINES[name](sm.model, sm.optimizer, device, **options)
    if PREFETCH_STEP in PIPELINES[name].offers:
        from recpipe.speedups.cache_fill import CacheFillOptions, apply_cache_fill

        from recpipe.speedups.cache_bookkeeping import apply_cache_bookkeeping

        installed = apply_cache_fill(pipe, pipe.tbes, CacheFillOptions(enabled=cache_fill, sms=cache_fill_sms))
        moved = apply_cache_bookkeeping(pipe, pipe.tbes)
        pipe.applied += [a for a in (installed, moved) if a is not None]
    if INTERCEPTS in PIPELINES[name].offers:
        from recpipe.speedups.splits_exchange import apply as apply_splits_exchange

        pipe.applied += [a for a in (apply_splits_exchange(pipe.context, splits_exchange),) if a is not None]
    return pipe


def train(
    cfg: RecpipeConfig,
    name: str,
    batches: list[Batch],
    segments: list[int] | None = None,
    device: torch.device = torch.device("cpu"),
    init_from: dict | None = None,
    **options,
) -> RunResult:
    """Train ``batches`` with pipeline ``name``; ``segments`` splits them into
    passes (each ends in a drain), like the trainer's eval/checkpoint segments.
    ``init_from``: a model state_dict to start from (to compare kernels)."""
    sm = build(cfg, device)
    if init_from is not None:  # a copy: DMP strips key prefixes in place while loading
        sm.model.load_state_dict(dict(init_from))
    if device.type == "cuda":
        batches = [b.pin_memory() for b in batches]
    pipe = make(name, sm, device, **options)
    losses, weights = [], []
    it = iter(batches)
    for size in segments or [len(batches)]:
        seg = itertools.islice(it, size)
        while True:
            try:
                loss, _, _, w = pipe.progress(seg)
            except StopIteration:
                break
            losses.append(loss)
            weights.append(w)
    assert pipe.in_flight() == 0
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    return RunResult([x.cpu() for x in losses], [w.cpu() for w in weights], {k: v.cpu() for k, v in local_state(sm.model).items()})


def assert_same(a: RunResult, b: RunResult, what: str) -> None:
    assert len(a.losses) == len(b.losses), f"{what}: {len(a.losses)} vs {len(b.losses)} steps"
    for i, (x, y) in enumerate(zip(a.losses, b.losses)):
        assert torch.equal(x, y), f"{what}: loss of step {i} differs: {x.item()!r} vs {y.item()!r}"
    assert a.state.keys() == b.state.keys()
    for key in a.state:
        assert torch.equal(a.state[key], b.state[key]), f"{what}: {key} differs (max abs diff {(a.state[key] - b.state[key]).abs().max().item()})"


def assert_differs(a: RunResult, b: RunResult, what: str) -> None:
    same = all(torch.equal(a.state[k], b.state[k]) for k in a.state)
    assert not same, f"{what}: expected different weights, got identical ones"


def expect_pipeline_error(fn, *needles) -> None:
    """``fn()`` raises a PipelineError whose message holds every needle (collective:
    every rank checks, then they meet at a barrier)."""
    from recpipe.pipelines import PipelineError

    try:
        fn()
    except PipelineError as err:
        for needle in needles:
            assert needle in str(err), f"{needle!r} not in: {err}"
    else:
        raise AssertionError(f"no PipelineError (wanted {needles})")
    dist.barrier()


def pairwise(items):
    return itertools.pairwise(items)


def semi_sync_reference(
    cfg: RecpipeConfig, batches: list[Batch], start_batch: int, stash_gradients: bool, device: torch.device = torch.device("cpu")
) -> RunResult:
    """semi_sync's documented semantics as a plain loop on the same sharded model:
    batch t+1's pooled embeddings are computed before batch t's backward (stale)
    once t >= start_batch, after batch t's optimizer step otherwise; with
    ``stash_gradients`` the dense optimizer applies batch t-1's gradient at step t,
    nothing at the first semi-sync step, and the last gradient at the end."""
    from recpipe.runtime.sharded import find_sharded_modules
    from recpipe.runtime.steps import dense_params

    sm = build(cfg, device)
    batches = [b.to(device) for b in batches]
    (fqn, ebc), = find_sharded_modules(sm.model).items()
    dense = dense_params(sm.optimizer)
    lookup = lambda b: ebc(b.sparse_features).wait()  # noqa: E731  (the module's own forward)
    losses, weights, stash = [], [], None
    pooled = lookup(batches[0])
    for t, batch in enumerate(batches):
        sm.optimizer.zero_grad()
        current = pooled
        ebc.forward = lambda *_: current  # the model reads the precomputed embeddings
        loss, _ = sm.model(batch)
        del ebc.forward
        stale = t >= start_batch
        if stale and t + 1 < len(batches):
            pooled = lookup(batches[t + 1])
        loss.backward()
        if stash_gradients and stale:
            fresh = [None if p.grad is None else p.grad.clone() for p in dense]
            if stash is not None:
                for p, g in zip(dense, stash):
                    p.grad = g
                sm.optimizer.step()
            stash = fresh
        else:
            sm.optimizer.step()
        if not stale and t + 1 < len(batches):
            pooled = lookup(batches[t + 1])
        losses.append(loss.detach())
        weights.append(batch.weights)
    if stash is not None:
        for p, g in zip(dense, stash):
            p.grad = g
        sm.optimizer.step()
    dist.barrier()
    return RunResult([x.cpu() for x in losses], [w.cpu() for w in weights], {k: v.cpu() for k, v in local_state(sm.model).items()})
