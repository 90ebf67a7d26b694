"""Every stage of a training step timed alone, summed per resource: an estimate of the step
a perfectly overlapped pipeline could reach, beside ``recpipe bench``'s rows.

    python benchmarks/studies/bound.py --config configs/bench/dlrm_criteo.yaml --with-torchrec --rounds 3 --out runs/bound

runs the bench's rows (any ``recpipe bench`` flag), then the stages below on every rank;
``bench.json`` gets a ``bound`` section (with each row's P50 / the estimate, ``x_bound``),
``bench.md`` its tables. Stages run faster together than drained one by one, so a pipeline
can step faster than this sum: it is an estimate, not a bound (GPU busy time is the bound).

On a fresh sharded model (same config, ``train.seed``, the bench's pre-generated
batches) each *chain* runs one batch through the stages below, one at a time: the
device is drained before each stage and the clock read after it
(:func:`time_stage`). A chain is a whole forward and backward, so nothing is
left in autograd and FBGEMM's prefetch contract holds (prefetch(i), forward(i),
backward(i)). Chains alternate two ways of running the lookup, both with public
ShardedModule APIs: *split* (``compute`` then ``output_dist``, with the lookup
outputs cut into leaves, so the backward separates the gradient all-to-all from
the TBE backward) and *combined* (``compute_and_output_dist``, as the pipelines
call it; a cross-check that the split costs nothing). Per chain a stage's time is
the slowest rank's; every rank runs the same collectives in the same order.

Resource model (perfect overlap between resources, none inside one)::

    compute  = lookup + dense_fwd_bwd + emb_bwd + optimizer        (SMs)
    comm     = input_dist + output_dist + output_dist_bwd + dense_allreduce
    copy     = h2d                                                  (copy engine)
    prefetch = prefetch   (UVM reads over PCIe by the prefetch kernels; own stream)
    bound    = max over resources (of the sums of P50s)

Not separated: ``input_dist`` includes the bucketize/permute kernels of row-wise
input dists and the splits host sync; ``emb_bwd`` the fused optimizer update.
Stage (d) calls the model inside DistributedModelParallel's DDP wrapper, so DDP's
all-reduce does not run there; (h) times the same bytes alone. The model is built
from the config as given: with the prefetch pipeline's cache-line locking the cache prefetch is
stage (g), on its own stream as FBGEMM requires, and the rows it fills from host
memory are counted from ``lxu_cache_state`` (achieved H2D bandwidth of the misses);
cached tables without it prefetch inside the lookup (c1).

Prefetch memory (stage g, CUDA), read outside the timed stage: the peak allocated
bytes above the allocation just before the prefetch (``reset_peak_memory_stats``
then ``max_memory_allocated`` minus ``memory_allocated``; only the prefetch runs in
between, so this is its scratch plus the cache locations and offsets it leaves),
and the bytes the caching allocator holds in segments of the prefetch stream (its
own pool, which only the prefetch allocates from; a high-water mark, since nothing
empties the cache between chains). ``measure_prefetch_memory`` runs a few chains
for just these numbers (benchmarks/studies/multipass.py).
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

if __package__ in (None, ""):  # run as a script: the repository's packages first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor  # noqa: E402

from benchmarks.studies.common import bench_parser, gpu_names, mib, run_study  # noqa: E402
from recpipe.bench.measure import StepClock, cached_tables, free_device_memory, summarize_ms, synchronize  # noqa: E402
from recpipe.bench.report import Row, grid  # noqa: E402
from recpipe.bench.run import fresh_batches, gather  # noqa: E402
from recpipe.config import RecpipeConfig  # noqa: E402
from recpipe.data import Batch  # noqa: E402
from recpipe.models import make_model  # noqa: E402
from recpipe.pipelines import PIPELINES  # noqa: E402
from recpipe.pipelines.prefetch import cached_tbes  # noqa: E402
from recpipe.runtime.sharded import find_sharded_modules  # noqa: E402
from recpipe.runtime.steps import dense_params  # noqa: E402
from recpipe.runtime.streams import use_stream  # noqa: E402
from recpipe.sharding import shard_model  # noqa: E402

__all__ = ["STAGES", "Bound", "bound_md", "hbm_peak", "measure_bound", "measure_prefetch_memory", "prefetch_memory",
           "stream_reserved_bytes", "time_stage", "x_bound"]

T = TypeVar("T")

WARMUP_CHAINS = 4  # two of each kind: input dists are created, kernels and NCCL warmed
TIMED_CHAINS = 20  # ten of each kind; a chain costs about one training step plus syncs
PREFETCH_WARMUP_CHAINS = 2  # measure_prefetch_memory: the first chains fill the cache
PREFETCH_TIMED_CHAINS = 4
GB = 1e9  # bandwidths in decimal GB/s, memory in GiB

# stage -> (resource it loads, or None for a cross-check; what is timed)
STAGES: dict[str, tuple[str | None, str]] = {
    "h2d": ("copy", "(a) Batch.to(device, non_blocking=True) of one pinned host batch"),
    "input_dist": ("comm", "(b) input all-to-all: input_dist(ctx, kjt).wait().wait() (splits host sync included)"),
    "prefetch": ("prefetch", "(g) UVM-cache prefetch on its own stream: module.prefetch(kjts, forward_stream=compute)"),
    "lookup": ("compute", "(c1) TBE lookup: module.compute(ctx, kjts)"),
    "output_dist": ("comm", "(c2) output all-to-all / reduce-scatter: module.output_dist(ctx, lookups).wait()"),
    "lookup_and_output_dist": (None, "(c) module.compute_and_output_dist(ctx, kjts).wait(), as the pipelines call it"),
    "dense_fwd_bwd": ("compute", "(d) model forward + backward on precomputed pooled embeddings (a leaf), no DDP"),
    "output_dist_bwd": ("comm", "(e1) backward of the output dist: gradient all-to-all (all-gather for row-wise)"),
    "emb_bwd": ("compute", "(e2) TBE backward with the fused embedding optimizer update"),
    "emb_bwd_total": (None, "(e) e1 + e2 in one backward call from the pooled embeddings"),
    "dense_allreduce": ("comm", "(h) all-reduce of the dense gradients in one flat buffer (DDP's bytes)"),
    "optimizer": ("compute", "(f) optimizer.step() as the pipelines call it (dense step; embeddings updated in e2)"),
}
RESOURCES = ("compute", "comm", "copy", "prefetch")

# Peak HBM bandwidth by GPU name (datasheets, bytes/s); other GPUs: not reported.
_HBM_PEAK = (("H200", "H200", 4.8e12), ("H100 80GB HBM3", "H100 SXM", 3.35e12), ("H100 SXM", "H100 SXM", 3.35e12))


def time_stage(device: torch.device, fn: Callable[[], T]) -> tuple[float, T]:
    """Milliseconds of ``fn()`` run alone, and its result: the device drained first,
    then one bench ``StepClock`` interval. Work ``fn`` issues on other streams counts
    only where the current stream waits for it; host syncs inside ``fn`` count."""
    synchronize(device)
    clock = StepClock(device)
    clock.start()
    out = fn()
    clock.stop()
    return clock.times_ms()[0], out


def hbm_peak(gpu_name: str) -> tuple[str, float] | None:
    """(label, bytes/s) of the GPU's HBM, or None for a GPU not in the table."""
    return next(((label, bw) for key, label, bw in _HBM_PEAK if key in gpu_name), None)


@dataclass
class _Bench:
    """The freshly built model and what the chains need from it."""

    model: Any  # DistributedModelParallel: keeps the whole sharded model alive
    optimizer: Any
    modules: dict[str, Any]
    device: torch.device
    dense_model: Any  # the model inside DistributedModelParallel's DDP (the model itself without one)
    cached_tbes: list  # FBGEMM TBEs with a locked UVM cache
    prefetch_stream: Any  # FBGEMM refuses a prefetch on the forward stream


class PrecomputedForward:
    """Stands in for a sharded module's forward during stage (d): returns the given
    pooled embeddings, so forward and backward touch only the dense model. Installed
    as an instance attribute and deleted right after (``_feeding``)."""

    def __init__(self, fqn: str, pooled: KeyedTensor) -> None:
        self.fqn, self.pooled = fqn, pooled

    def __repr__(self) -> str:
        return f"PrecomputedForward({self.fqn!r}; benchmarks/studies/bound.py, stage dense_fwd_bwd)"

    def __call__(self, *args: Any, **kwargs: Any) -> KeyedTensor:
        return self.pooled


@contextlib.contextmanager
def _feeding(modules: dict[str, Any], pooled: dict[str, KeyedTensor]):
    for fqn, module in modules.items():
        assert "forward" not in vars(module), f"{fqn} already has an instance forward"
        module.forward = PrecomputedForward(fqn, pooled[fqn])
    try:
        yield
    finally:
        for module in modules.values():
            del module.forward


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def batch_bytes(b: Batch) -> int:
    kjt: KeyedJaggedTensor = b.sparse_features
    parts = (b.dense_features, b.labels, b.weights, kjt.values(), kjt.lengths_or_none(), kjt.offsets_or_none(),
             kjt.weights_or_none())
    return sum(_nbytes(t) for t in parts)


def _backward(tensors: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    pairs = [(t, g) for t, g in zip(tensors, grads) if g is not None and t.requires_grad]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


# ------------------------------------------------------------------ one chain
def _lookup(m: _Bench, ctxs: dict, kjts: dict, split: bool, t: dict[str, float]) -> tuple[dict, Any]:
    """Stage (c), split or combined; returns the pooled KeyedTensors and, when split,
    (lookup outputs, their leaves) for the separated backward."""
    if not split:
        t["lookup_and_output_dist"], pooled = time_stage(
            m.device, lambda: {f: mod.compute_and_output_dist(ctxs[f], kjts[f]).wait() for f, mod in m.modules.items()})
        return pooled, None
    t["lookup"], outs = time_stage(m.device, lambda: {f: mod.compute(ctxs[f], kjts[f]) for f, mod in m.modules.items()})
    leaves = {f: [o.detach().requires_grad_(o.requires_grad) for o in outs[f]] for f in outs}
    t["output_dist"], pooled = time_stage(
        m.device, lambda: {f: mod.output_dist(ctxs[f], leaves[f]).wait() for f, mod in m.modules.items()})
    return pooled, (outs, leaves)


def _dense(m: _Bench, batch: Batch, pooled: dict[str, KeyedTensor], t: dict[str, float]) -> dict[str, Any]:
    """Stage (d); returns the gradient of each module's pooled embeddings."""
    leaves = {f: kt.values().detach().requires_grad_() for f, kt in pooled.items()}
    feed = {f: KeyedTensor(keys=kt.keys(), length_per_key=kt.length_per_key(), values=leaves[f], key_dim=kt.key_dim())
            for f, kt in pooled.items()}
    m.optimizer.zero_grad()

    def fwd_bwd() -> None:
        # The module under DDP's wrapper: without DDP's forward the reducer is never
        # armed, so backward all-reduces nothing (timed alone: dense_allreduce).
        # ``no_sync`` is no substitute: torchrec's DDP has static_graph=True, whose
        # first backward asserts that the reducer was armed.
        with _feeding(m.modules, feed):
            loss = m.dense_model(batch)[0]
            torch.sum(loss).backward()

    t["dense_fwd_bwd"], _ = time_stage(m.device, fwd_bwd)
    return {f: leaf.grad for f, leaf in leaves.items()}


def stream_reserved_bytes(device: torch.device, stream: torch.cuda.Stream) -> int:
    """Bytes of the caching allocator's segments that belong to ``stream`` on ``device``
    (``torch.cuda.memory_snapshot()``: a segment belongs to the stream that allocated it,
    and only that stream reuses its free blocks)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if seg.get("device", index) == index and seg["stream"] == stream.cuda_stream)


def _prefetch(m: _Bench, ctxs: dict, kjts: dict, t: dict[str, float], counts: dict[str, int]) -> None:
    """Stage (g) on the prefetch stream; counts the cache rows it filled from host
    memory (slots of ``lxu_cache_state`` whose row changed; -1 = empty slot), its
    peak allocated bytes above the allocation before it, and the prefetch stream's
    reserved bytes (module docstring)."""
    before = [tbe.lxu_cache_state.clone() for tbe in m.cached_tbes]
    compute = torch.cuda.current_stream(m.device)
    torch.cuda.reset_peak_memory_stats(m.device)  # after the clones: only the prefetch's own bytes count
    allocated = torch.cuda.memory_allocated(m.device)
    with use_stream(m.prefetch_stream):
        t["prefetch"], _ = time_stage(m.device, lambda: [
            mod.prefetch(kjts[f], forward_stream=compute, ctx=ctxs[f]) for f, mod in m.modules.items()])
    counts.update(prefetch_peak_alloc_bytes=torch.cuda.max_memory_allocated(m.device) - allocated,
                  prefetch_stream_reserved_bytes=stream_reserved_bytes(m.device, m.prefetch_stream))
    inserted = evicted = inserted_bytes = 0
    for tbe, old in zip(m.cached_tbes, before):
        changed = tbe.lxu_cache_state != old
        n = int(changed.sum())  # host sync, outside the timed stage
        inserted += n
        evicted += int((changed & (old >= 0)).sum())
        inserted_bytes += n * tbe.lxu_cache_weights.shape[1] * tbe.lxu_cache_weights.element_size()
    counts.update(prefetch_rows_in=inserted, prefetch_rows_evicted=evicted, prefetch_bytes_in=inserted_bytes)


def _inputs(m: _Bench, host: Batch, t: dict[str, float], counts: dict[str, int]) -> tuple[Batch, dict, dict]:
    """Stages (a) and (b): the device batch, the module contexts, the KJTLists."""
    t["h2d"], batch = time_stage(m.device, lambda: host.to(m.device, non_blocking=True))
    counts["h2d_bytes"] = batch_bytes(batch)
    ctxs = {f: mod.create_context() for f, mod in m.modules.items()}
    t["input_dist"], kjts = time_stage(m.device, lambda: {
        f: mod.input_dist(ctxs[f], batch.sparse_features).wait().wait() for f, mod in m.modules.items()})
    counts["lookup_ids"] = sum(k.values().numel() for kl in kjts.values() for k in kl)
    return batch, ctxs, kjts


def _emb_backward(m: _Bench, pooled: dict[str, KeyedTensor], parts: Any, grads: dict, t: dict[str, float]) -> None:
    """Stage (e): in one call (combined chains) or as (e1) then (e2) (split chains)."""
    values = [kt.values() for kt in pooled.values()]
    if parts is None:
        t["emb_bwd_total"], _ = time_stage(m.device, lambda: _backward(values, list(grads.values())))
        return
    outs, leaves = parts
    t["output_dist_bwd"], _ = time_stage(m.device, lambda: _backward(values, list(grads.values())))
    flat_outs = [o for f in outs for o in outs[f]]
    flat_grads = [leaf.grad for f in leaves for leaf in leaves[f]]
    t["emb_bwd"], _ = time_stage(m.device, lambda: _backward(flat_outs, flat_grads))


def _allreduce(m: _Bench, t: dict[str, float], counts: dict[str, int]) -> None:
    """Stage (h): the dense gradients in one flat buffer (same bytes as DDP's buckets)."""
    flat = [p.grad.reshape(-1) for p in dense_params(m.optimizer) if p.grad is not None]
    buffer = torch.cat(flat) if flat else torch.zeros(1, device=m.device)
    counts["allreduce_bytes"] = _nbytes(buffer)
    t["dense_allreduce"], _ = time_stage(m.device, lambda: dist.all_reduce(buffer))


def _chain(m: _Bench, host: Batch, split: bool) -> tuple[dict[str, float], dict[str, int]]:
    """One batch through every stage. What a stage no longer needs is dropped before
    the next one, so each stage runs with the memory a training step would have."""
    t: dict[str, float] = {}
    counts: dict[str, int] = {}
    batch, ctxs, kjts = _inputs(m, host, t, counts)
    if m.cached_tbes:
        _prefetch(m, ctxs, kjts, t, counts)
    pooled, parts = _lookup(m, ctxs, kjts, split, t)
    del kjts
    grads = _dense(m, batch, pooled, t)
    del batch
    _emb_backward(m, pooled, parts, grads, t)  # frees the autograd graph of the lookup
    del pooled, parts, grads
    _allreduce(m, t, counts)
    t["optimizer"], _ = time_stage(m.device, m.optimizer.step)
    return t, counts


# ------------------------------------------------------------------ per rank
def _build(cfg: RecpipeConfig, device: torch.device) -> _Bench:
    torch.manual_seed(cfg.train.seed)
    sharded = shard_model(make_model(cfg), cfg, device)
    model = sharded.model
    ddp = next((x for x in model.modules() if isinstance(x, DistributedDataParallel)), None)
    cached = cached_tbes(model) if device.type == "cuda" else []
    stream = torch.cuda.Stream(device=device) if cached else None
    dense_model = ddp.module if ddp is not None else model
    return _Bench(model, sharded.optimizer, find_sharded_modules(model), device, dense_model, cached, stream)


def _local(cfg: RecpipeConfig, batches: list[Batch], device: torch.device, warmup: int = WARMUP_CHAINS,
           timed: int = TIMED_CHAINS) -> dict[str, Any]:
    """This rank's chains; never raises (the error goes into the result)."""
    free_device_memory(device)
    m = None
    try:
        m = _build(cfg, device)
        chains = []
        for i in range(warmup + timed):
            t, counts = _chain(m, batches[i % len(batches)], split=i % 2 == 0)
            if i >= warmup:
                chains.append((t, counts))
        return {"status": "ok", "chains": chains, "prefetch": bool(m.cached_tbes), "cuda": device.type == "cuda"}
    except Exception as err:  # noqa: BLE001 - the bench still writes the pipelines' rows
        traceback.print_exc()
        return {"status": "failed", "reason": f"{type(err).__name__}: {str(err).strip()[:300]}"}
    finally:
        del m
        free_device_memory(device)


# ------------------------------------------------------------------ all ranks
def measure_bound(cfg: RecpipeConfig, batches: list[Batch], device: torch.device, gpu_name: str) -> dict[str, Any]:
    """Collective: build, run the chains on every rank, and summarize (the same dict
    on every rank). ``status`` is 'failed' with the reason if any rank failed."""
    per_rank = gather(_local(cfg, batches, device))
    bad = [f"rank {r}: {x['reason']}" for r, x in enumerate(per_rank) if x["status"] != "ok"]
    if bad:
        return {"status": "failed", "reason": " | ".join(dict.fromkeys(bad))}
    return _summarize(cfg, per_rank, gpu_name)


def measure_prefetch_memory(cfg: RecpipeConfig, batches: list[Batch], device: torch.device,
                            warmup: int = PREFETCH_WARMUP_CHAINS, timed: int = PREFETCH_TIMED_CHAINS) -> dict[str, Any]:
    """Collective, never raises: the prefetch's own memory and time on a fresh model
    built from ``cfg``, from ``warmup`` + ``timed`` whole chains (fwd + bwd, so every
    cache line the prefetch locked is released before the next one); the same dict on
    every rank. ``status`` is 'failed' (a rank failed) or 'skipped' (no stage g)."""
    per_rank = gather(_local(cfg, batches, device, warmup, timed))
    bad = [f"rank {r}: {x['reason']}" for r, x in enumerate(per_rank) if x["status"] != "ok"]
    if bad:
        return {"status": "failed", "reason": " | ".join(dict.fromkeys(bad))}
    if not any(r["prefetch"] for r in per_rank):
        return {"status": "skipped", "reason": _na(cfg, "prefetch", False)}
    return dict(prefetch_memory(per_rank), status="ok", chains={"warmup": warmup, "timed": timed})


def prefetch_memory(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Stage (g)'s memory over the timed chains: per rank the largest peak above the
    allocation before the prefetch and the prefetch stream's reserved bytes (bytes;
    rank 0 and the maximum over ranks; 0 on a rank without a cached TBE, which does
    not run the stage), and the stage's time (per chain the slowest rank that ran it)."""
    ran = [r["chains"] if r["prefetch"] else [] for r in per_rank]
    alloc = [max((c["prefetch_peak_alloc_bytes"] for _, c in chains), default=0) for chains in ran]
    reserved = [max((c["prefetch_stream_reserved_bytes"] for _, c in chains), default=0) for chains in ran]
    slowest = [max(col) for col in zip(*([t["prefetch"] for t, _ in chains] for chains in ran if chains))]
    return {
        "peak_alloc_bytes": alloc[0],
        "peak_alloc_bytes_max": max(alloc),
        "stream_reserved_bytes": reserved[0],
        "stream_reserved_bytes_max": max(reserved),
        "peak_alloc_bytes_per_rank": alloc,
        "stream_reserved_bytes_per_rank": reserved,
        "ms": summarize_ms(slowest),
    }


def _stage_times(per_rank: list[dict[str, Any]], stage: str) -> tuple[list[float], list[list[float]]]:
    """(per chain the slowest rank's ms, each rank's own ms) over the chains that ran ``stage``."""
    chains = [i for i, (t, _) in enumerate(per_rank[0]["chains"]) if stage in t]
    own = [[r["chains"][i][0][stage] for i in chains] for r in per_rank]
    return [max(col) for col in zip(*own)], own


def _rate(per_rank: list[dict[str, Any]], stage: str, count: str, bytes_per: float = 1.0) -> dict[str, Any] | None:
    """Bytes moved by ``stage`` over its P50, per rank; the headline is the rank whose
    stage is slowest (the one that binds the step)."""
    _, own = _stage_times(per_rank, stage)
    if not own[0]:
        return None
    out: list[dict[str, float]] = []
    for r, times in zip(per_rank, own):
        counted = [c[count] for t, c in r["chains"] if stage in t]
        nbytes = bytes_per * sum(counted) / len(counted)
        p50 = summarize_ms(times)["p50"]
        out.append({"bytes": nbytes, "p50_ms": p50, "GB_per_s": nbytes / (p50 / 1e3) / GB if p50 > 0 else None})
    slow = max(range(len(out)), key=lambda i: out[i]["p50_ms"])
    return dict(out[slow], rank=slow, per_rank=out)


def _na(cfg: RecpipeConfig, stage: str, ran_prefetch: bool) -> str:
    if stage != "prefetch":
        return "not run"
    cached = cached_tables(cfg)
    if not cached:
        return "n/a: no fused_uvm_caching table"
    if not cfg.cache_line_locking:
        return f"n/a: cached tables {cached} without cache-line locking (another pipeline than prefetch) prefetch inside the lookup (in c1)"
    return "n/a: CPU run (no UVM cache)" if not ran_prefetch else "not run"


def _summarize(cfg: RecpipeConfig, per_rank: list[dict[str, Any]], gpu_name: str) -> dict[str, Any]:
    stages: dict[str, dict[str, Any]] = {}
    for name, (resource, what) in STAGES.items():
        slowest, own = _stage_times(per_rank, name)
        entry: dict[str, Any] = {"resource": resource, "what": what, "chains": len(slowest)}
        if slowest:
            entry.update(ms=summarize_ms(slowest), p50_per_rank=[summarize_ms(o)["p50"] for o in own])
        else:
            entry.update(ms=None, reason=_na(cfg, name, per_rank[0]["prefetch"]))
        stages[name] = entry
    resources = {}
    for res in RESOURCES:
        names = [n for n, (r, _) in STAGES.items() if r == res and stages[n]["ms"] is not None]
        if names:
            resources[res] = {"ms": sum(stages[n]["ms"]["p50"] for n in names), "stages": names}
    bound_resource = max(resources, key=lambda r: resources[r]["ms"])
    out: dict[str, Any] = {
        "status": "ok",
        "method": "Each stage alone on a fresh model (same config, seed, batches); device drained before, "
                  "clock read after; per chain the slowest rank; resources = sums of stage P50s",
        "timing": "cuda_events_per_stage" if per_rank[0]["cuda"] else "host_wall_per_stage",
        "chains": {"warmup": WARMUP_CHAINS, "timed": TIMED_CHAINS, "kinds": "alternating split / combined lookup"},
        "stages": stages,
        "resources": resources,
        "bound_ms": resources[bound_resource]["ms"],
        "bound_resource": bound_resource,
        "bandwidth": _bandwidths(cfg, per_rank, gpu_name),
        "notes": [],
    }
    if any(r["prefetch"] for r in per_rank):
        out["prefetch_memory"] = prefetch_memory(per_rank)
    if not per_rank[0]["cuda"]:
        out["notes"].append("CPU run: Batch.to(cpu) copies nothing (h2d), Gloo collectives, no HBM")
    split, combined = stages["lookup"]["ms"], stages["lookup_and_output_dist"]["ms"]
    if split and combined:
        out["notes"].append(
            f"lookup + output_dist alone sum to {split['p50'] + stages['output_dist']['ms']['p50']:.3f} ms; "
            f"compute_and_output_dist takes {combined['p50']:.3f} ms (P50)")
    return out


def _bandwidths(cfg: RecpipeConfig, per_rank: list[dict[str, Any]], gpu_name: str) -> dict[str, Any]:
    """Achieved bandwidths (decimal GB/s); the TBE's against the GPU's peak HBM bandwidth."""
    out: dict[str, Any] = {"h2d": _rate(per_rank, "h2d", "h2d_bytes"),
                           "dense_allreduce": _rate(per_rank, "dense_allreduce", "allreduce_bytes")}
    kinds = {s.type for s in cfg.table_sharding().values()}
    if "column_wise" in kinds:
        out["tbe_lookup"] = {"reason": "n/a: column_wise tables read a slice of each row; ids x dim would overcount"}
    else:  # fp32 rows: every id reads one row of embedding_dim floats
        tbe = _rate(per_rank, "lookup", "lookup_ids", bytes_per=4.0 * cfg.model.embedding_dim)
        peak = hbm_peak(gpu_name)
        if tbe is not None and peak is not None and tbe["GB_per_s"] is not None:
            tbe.update(hbm_peak=peak[0], hbm_peak_GB_per_s=peak[1] / GB, fraction_of_peak=tbe["GB_per_s"] * GB / peak[1])
        elif tbe is not None:
            tbe["hbm_peak_reason"] = f"peak HBM bandwidth of {gpu_name!r} not in the table (H100 SXM, H200)"
        uvm = sorted({s.kernel for s in cfg.table_sharding().values()} & {"fused_uvm", "fused_uvm_caching"})
        if tbe is not None and uvm:
            tbe["note"] = f"kernels {uvm}: misses read host memory over PCIe, so HBM is not the only source"
        out["tbe_lookup"] = tbe
    if per_rank[0]["prefetch"]:
        out["prefetch_h2d"] = _rate(per_rank, "prefetch", "prefetch_bytes_in")
        rows = [sum(c["prefetch_rows_in"] for _, c in r["chains"]) / len(r["chains"]) for r in per_rank]
        evicted = [sum(c["prefetch_rows_evicted"] for _, c in r["chains"]) / len(r["chains"]) for r in per_rank]
        out["prefetch_h2d"].update(rows_in_per_batch=rows, rows_evicted_per_batch=evicted)
    return out


def x_bound(rows: list[Row], bound: dict[str, Any]) -> list[dict[str, Any]]:
    """Each measured row's P50 as a multiple of the estimate (1.0 = perfect overlap)."""
    if bound.get("status") != "ok" or not bound["bound_ms"] > 0:
        return []
    return [{"pipeline": r.pipeline, "impl": r.impl, "x_bound": r.step_ms["p50"] / bound["bound_ms"]}
            for r in rows if r.status == "ok" and r.step_ms.get("p50")]


def _ms(stage: dict[str, Any], key: str) -> str:
    return "-" if not stage.get("ms") else f"{stage['ms'][key]:.3f}"


def _gbs(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}" if x >= 10 else f"{x:.3g}"


def _bytes(n: float) -> str:
    return f"{n / 1e6:,.2f} MB" if n >= 1e5 else f"{n / 1e3:,.1f} kB"


def _rate_line(label: str, rate: dict[str, Any] | None) -> str:
    if rate is None:
        return f"- {label}: n/a (stage not run)"
    if "reason" in rate:
        return f"- {label}: {rate['reason']}"
    line = (f"- {label}: {_bytes(rate['bytes'])} in {rate['p50_ms']:.3f} ms = "
            f"**{_gbs(rate['GB_per_s'])} GB/s** (rank {rate['rank']})")
    if "fraction_of_peak" in rate:
        line += f", {rate['fraction_of_peak']:.1%} of {rate['hbm_peak']} HBM peak ({rate['hbm_peak_GB_per_s']:,.0f} GB/s)"
    elif "hbm_peak_reason" in rate:
        line += f"; {rate['hbm_peak_reason']}"
    if "rows_in_per_batch" in rate:
        line += (f"; cache rows filled per batch {[round(x) for x in rate['rows_in_per_batch']]}, "
                 f"of them evictions {[round(x) for x in rate['rows_evicted_per_batch']]} (per rank)")
    return line + (f"; {rate['note']}" if "note" in rate else "")


def _prefetch_memory_line(pm: dict[str, Any]) -> str:
    """Stage (g)'s own memory (bytes in the JSON, MiB here)."""
    return (f"- cache prefetch memory: peak {mib(pm['peak_alloc_bytes'])} MiB allocated above the allocation before "
            f"it (max over ranks {mib(pm['peak_alloc_bytes_max'])}), prefetch stream holds "
            f"{mib(pm['stream_reserved_bytes'])} MiB reserved "
            f"(max over ranks {mib(pm['stream_reserved_bytes_max'])}); rank 0, largest over the timed chains")


def bound_md(bound: dict[str, Any]) -> list[str]:
    lines = ["## Stages timed alone: an estimate, not a bound", "",
             "Each stage is timed alone and the stages are summed per resource; a pipeline can step faster than "
             "this sum (stages run faster together than drained one by one), so it bounds nothing. The lower "
             "bound is the GPU busy time above.", ""]
    if bound.get("status") != "ok":
        return lines + [f"failed: {bound.get('reason')}", ""]
    chains = bound["chains"]
    lines += [
        f"{bound['method']}; {bound['timing']}; {chains['timed']} chains after {chains['warmup']} warm-up "
        f"({chains['kinds']}).",
        "",
    ]
    body = [[name, s["resource"] or "cross-check", _ms(s, "p50"), _ms(s, "p90"),
             s["what"] + (f" — {s['reason']}" if s.get("reason") else "")] for name, s in bound["stages"].items()]
    lines += [grid(("stage", "resource", "P50 ms", "P90 ms", "what"), body, markdown=True), ""]
    body = [[name, f"{r['ms']:.3f}", " + ".join(r["stages"])] for name, r in bound["resources"].items()]
    lines += [grid(("resource", "ms (sum of P50s)", "stages"), body, markdown=True), ""]
    lines += [f"**Stages alone: {bound['bound_ms']:.3f} ms per step, largest on {bound['bound_resource']}**.", ""]
    if bound.get("x_bound"):
        body = [[x["pipeline"], x["impl"], f"{x['x_bound']:.2f}"] for x in bound["x_bound"]]
        lines += [grid(("pipeline", "impl", "x stages alone (P50 / stages alone)"), body, markdown=True), ""]
    bw = bound["bandwidth"]
    lines += ["Achieved bandwidth (decimal GB/s, at the stage's P50, on the rank where it is slowest):", ""]
    lines.append(_rate_line("H2D copy of a batch", bw.get("h2d")))
    lines.append(_rate_line("TBE lookup (ids x dim x 4 B of rows read)", bw.get("tbe_lookup")))
    if "prefetch_h2d" in bw:
        lines.append(_rate_line("cache prefetch, rows filled from host memory", bw["prefetch_h2d"]))
    if "prefetch_memory" in bound:
        lines.append(_prefetch_memory_line(bound["prefetch_memory"]))
    lines.append(_rate_line("dense gradient all-reduce (bytes / time)", bw.get("dense_allreduce")))
    lines += [f"- note: {n}" for n in bound.get("notes", [])]
    return lines + [""]


@dataclass(frozen=True)
class Bound:
    """The study's measurement after the bench's rows (every rank): the stages alone and
    each row's ``x_bound``."""

    def __call__(self, cfg: RecpipeConfig, opts: Any, rows: list[Row], batches: list[Batch], device: torch.device,
                 bar: Any) -> tuple[dict[str, Any], list[str]]:
        bar.set_description("bound")
        bound = measure_bound(cfg, list(fresh_batches(batches, device)), device, ", ".join(sorted(set(gpu_names(device)))))
        bound["x_bound"] = x_bound(rows, bound)
        if dist.get_rank() == 0:
            bar.write(f"bound {bound['bound_ms']:.3f} ms ({bound['bound_resource']})" if bound["status"] == "ok"
                      else f"bound failed: {bound['reason']}")
        return {"bound": bound}, bound_md(bound)


def main(argv: list[str] | None = None) -> int:
    args = bench_parser(__doc__).parse_args(argv)
    return run_study("bound", argv, args, Bound, default_pipelines=tuple(PIPELINES))


if __name__ == "__main__":
    sys.exit(main())
