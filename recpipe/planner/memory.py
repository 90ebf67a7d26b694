"""The memory estimate's terms, assembled by
:func:`recpipe.planner.estimate.estimate_memory` (pure: ``PlannerInputs`` in,
``MemoryPlan`` out; no process group, no GPU).

Per rank r the HBM total is

    static(r) + per_step(r) + allocator(r) + runtime(r)

* static: the TBE buffers of every TBE torchrec builds on r (:mod:`recpipe.planner.tbe`),
  the dense model with its gradients and optimizer state, the cuBLAS workspace.
* per_step: what is alive at the peak of a training step: the pipeline's batches in
  flight (always alive) plus the transients of the step's largest *phase*:

  - ``forward_lookup``: TBE outputs and the pooled embeddings after the output dist;
  - ``forward_end``: all saved activations (the interaction copied the pooled
    embeddings and dropped them), + prefetch of batch i+1 on the prefetch stream,
    which the prefetch pipeline issues right here;
  - ``cache_bookkeeping``: the same activations, + batch i's cache locations
    recomputed on the prefetch stream right after that prefetch
    (``recpipe.speedups.cache_bookkeeping``);
  - ``backward_emb``: gradient of the TBE output + TBE backward scratch + the dense
    arch's activations (its backward runs after the embeddings');
  - ``inline_prefetch``: cached tables without the prefetch pipeline prefetch inside
    their forward, on the default stream, in one pass.

* allocator: the caching allocator keeps one pool per stream; blocks freed by one
  stream are not reused by another, so every stream's pool holds its own peak,
  whichever phase it occurs in (:func:`per_step_and_allocator`).
* runtime: CUDA context, NCCL communicators.

Constants marked "calibrate" are fitted from ``tests/test_planner_gpu.py`` runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from recpipe.planner.plan import (
    MemoryPlan,
    PrecisionSavings,
    RankMemory,
    ShardMemory,
    TbeGroupInfo,
    Term,
    fmt_bytes,
)
from recpipe.planner.spec import PlannerInputs, TableSpec
from recpipe.planner.tbe import (
    INDEX_BYTES,
    LOCATION_BYTES,
    STATE_BYTES,
    Tbe,
    backward_scratch_bytes,
    cache_relookup_bytes,
    group_tbes,
    prefetch_pass_sizes,
    prefetch_scratch_bytes,
    shard_bags,
    shard_indices,
    shard_output_rows,
    shard_static,
    tbe_cache_insert,
    tbe_static,
)

MiB = 1 << 20
# Fitted on tests/test_planner_gpu.py's rows with PyTorch's default segments; expandable
# segments reserve less (docs/planner.md, "Allocator and runtime").
ALLOCATOR_FRAGMENTATION = 0.35  # calibrate per site
# Context, kernel images of torch and FBGEMM, a 1-rank NCCL communicator (torch 2.11 + CUDA 13,
# fbgemm 1.6): tests/test_planner_gpu.py's "meas used" against "est total" measures it
# (benchmarks/results/h100x1/planner.md).
CUDA_CONTEXT_BYTES = 1320 * MiB
NCCL_BYTES = 1024 * MiB  # calibrate: communicator buffers per rank when world size > 1 (not measured yet)
CUBLAS_WORKSPACE_BYTES = 64 * MiB  # cuBLAS + cuBLASLt workspaces, 32 MiB each on sm90 (tests/test_planner_gpu.py)
# pipeline.cuda_graphs: what one captured dense part's warm-up stream and graph pool reserve
# beyond what they hold allocated (partly used 20 MiB pages of expandable segments, and the
# blocks the warm-up and capture passes freed, which no other stream or pool can reuse).
# Fitted on tests/test_planner_ranks_gpu.py's bf16 DLRM with expandable segments, dense arch
# and head graphed (docs/planner.md, "Allocator and runtime";
# benchmarks/results/h200x4/planner_ranks.md). It grows with the parts' activations:
# calibrate per model.
CUDA_GRAPH_PART_SEGMENT_BYTES = 88 * MiB
# W > 1: the streams the input and output dists allocate on keep whole pages beyond the
# plan's pools. Fitted on the same test's row_wise and table_wise runs at 2 and 4 ranks
# (docs/planner.md, "Allocator and runtime").
COLLECTIVE_STREAM_PAGE_BYTES = 44 * MiB
LENGTH_BYTES = 4  # KJT lengths/offsets are int32 (recpipe.data.synthetic)
TBE_OFFSET_BYTES = 8  # the TBE casts offsets to int64
OUTPUT_BYTES = 4  # pooled outputs fp32
_DENSE_OPT = {"sgd": 0, "adagrad": 1, "adam": 2}


# ------------------------------------------------------------------ batch sizes
WEIGHT_BYTES = 4  # per-id KJT weights are fp32


def local_ids(inputs: PlannerInputs) -> float:
    return inputs.batch_size * sum(t.ids_per_sample for t in inputs.tables)


def _local_weighted_ids(inputs: PlannerInputs) -> float:
    return inputs.batch_size * sum(t.ids_per_sample for t in inputs.tables if t.weighted)


def _num_features(inputs: PlannerInputs) -> int:
    return sum(t.num_features for t in inputs.tables)


def batch_bytes(inputs: PlannerInputs) -> int:
    """One input batch on the device: dense fp32 [B, nd], labels and weights fp32
    [B] (the built-in batch; unknown for a model.factory model, not counted), KJT
    int64 values, fp32 per-id weights of weighted tables, int32 lengths and offsets."""
    B, F = inputs.batch_size, _num_features(inputs)
    dense = 4 * B * (inputs.num_dense_features + 2) if inputs.dense_batch else 0
    kjt = INDEX_BYTES * local_ids(inputs) + WEIGHT_BYTES * _local_weighted_ids(inputs)
    return int(dense + kjt + LENGTH_BYTES * (2 * B * F + 1))


def local_sparse_bytes(inputs: PlannerInputs) -> int:
    """The rank's own KJT (values, weights, lengths) of the tables behind an input
    all-to-all (all but data_parallel ones): what input dist permutes / bucketizes
    into the buffer it sends."""
    sent = [t for t in inputs.tables if t.sharding_type != "data_parallel"]
    B = inputs.batch_size
    ids = B * sum(INDEX_BYTES * t.ids_per_sample + (WEIGHT_BYTES * t.ids_per_sample if t.weighted else 0) for t in sent)
    return int(ids + LENGTH_BYTES * B * sum(t.num_features for t in sent))


def received_kjt_bytes(n: float, bags: int, world_size: int, weighted: bool = False) -> int:
    """A KJT after the input all-to-all (int64 values, fp32 weights when
    ``weighted``, int32 lengths) plus the int64 offsets the TBE builds from it. With
    one rank torchrec's all-to-all returns its input (``KJTAllToAllTensorsAwaitable``:
    ``if self._workers == 1``): offsets only."""
    values = (INDEX_BYTES + (WEIGHT_BYTES if weighted else 0)) * n
    received = values + LENGTH_BYTES * bags if world_size > 1 else 0
    return int(received + TBE_OFFSET_BYTES * (bags + 1))


def module_received_kjt_bytes(t: TableSpec, n: float, bags: int, world_size: int) -> int:
    """:func:`received_kjt_bytes` for ``n`` ids and ``bags`` bags of tables of
    ``t``'s module (weightedness is per module); a feature processor's weights are
    created after the all-to-all, beside the received ids."""
    fp_weights = WEIGHT_BYTES * n if t.feature_processed else 0
    return received_kjt_bytes(n, bags, world_size, t.weighted) + int(fp_weights)


def pooled_output_bytes(inputs: PlannerInputs) -> int:
    """Embeddings of this rank's own samples after the output dist, every table that
    is not data parallel: [B, dim] per feature of a pooled table, [ids, dim] of a
    sequence table."""
    B = inputs.batch_size
    rows = lambda t: B * t.num_features if t.pooled else B * t.ids_per_sample  # noqa: E731
    return int(OUTPUT_BYTES * sum(rows(t) * t.dim for t in inputs.tables if t.sharding_type != "data_parallel"))


@dataclass(frozen=True)
class RankIO:
    """Per-batch sizes on one rank, from its TBEs."""

    tbes: tuple[Tbe, ...]
    indices: tuple[float, ...]  # per TBE
    bags: tuple[int, ...]  # per TBE
    lookup: int  # TBE outputs (pooled, before output dist)
    pooled: int  # pooled embeddings after output dist (0 extra when W == 1: same tensor)
    received: int  # input-dist KJTs of one batch (+ TBE offsets)
    cached_indices: float
    prefetch_scratch: int  # largest TBE's, at the configured passes
    prefetch_scratch_one_pass: int
    prefetch_insert: str  # the insert of the TBE with the largest prefetch scratch: recpipe | fbgemm
    relookup_scratch: int  # largest TBE's cache locations recomputed on the prefetch stream (0: on main)
    inline_scratch: int  # no prefetch pipeline: forward prefetches in one pass
    backward_scratch: int
    passes_effective: tuple[tuple[str, int], ...]


def rank_io(inputs: PlannerInputs, rank: int) -> RankIO:
    W, B = inputs.world_size, inputs.batch_size
    tbes = tuple(group_tbes(inputs, rank))
    ns = tuple(sum(shard_indices(inputs, s) for s in g.shards) for g in tbes)
    bags = tuple(sum(shard_bags(inputs, s) for s in g.shards) for g in tbes)
    lookup = int(sum(inputs.tbe_output_bytes * shard_output_rows(inputs, s) * s.cols for g in tbes for s in g.shards))
    pooled = pooled_output_bytes(inputs) if W > 1 else 0
    received = sum(module_received_kjt_bytes(g.tables[0], n, b, W)
                   for g, n, b in zip(tbes, ns, bags) if g.sharding_type != "data_parallel")
    version, min_pass = inputs.fbgemm_version, inputs.prefetch_min_pass_size
    cached = [(g, n) for g, n in zip(tbes, ns) if g.cached]
    pf = inputs.prefetch_pipeline
    inserts = [tbe_cache_insert(inputs.pipeline.cache_insert, g) for g, _ in cached]
    scratch = [(prefetch_scratch_bytes(n, inputs.prefetch_passes, min_pass, version, i), i)
               for (_, n), i in zip(cached, inserts)] if pf else []
    largest, insert = max(scratch, default=(0, "fbgemm"))
    relookup = pf and inputs.pipeline.cache_bookkeeping_stream == "prefetch"
    return RankIO(
        tbes=tbes, indices=ns, bags=bags, lookup=lookup, pooled=pooled, received=received,
        cached_indices=sum(n for _, n in cached),
        prefetch_scratch=largest,
        prefetch_scratch_one_pass=max((prefetch_scratch_bytes(n, 1, min_pass, version, i)
                                       for (_, n), i in zip(cached, inserts)), default=0) if pf else 0,
        prefetch_insert=insert,
        relookup_scratch=max((cache_relookup_bytes(n, g.cache_slots) for g, n in cached), default=0) if relookup else 0,
        inline_scratch=0 if pf else max((prefetch_scratch_bytes(n, 1, 1, version) for _, n in cached), default=0),
        backward_scratch=max((backward_scratch_bytes(n, g.cached and not pf) for g, n in zip(tbes, ns)), default=0),
        passes_effective=tuple((g.name, len(prefetch_pass_sizes(int(round(n)), inputs.prefetch_passes, min_pass)))
                               for g, n in cached) if pf else (),
    )


# ------------------------------------------------------------------ static
def _merge(terms: list[Term]) -> tuple[Term, ...]:
    """Sum terms of the same (name, side, category) (one per TBE) into one."""
    out: dict[tuple[str, str, str], list[Term]] = {}
    for t in terms:
        out.setdefault((t.name, t.side, t.category), []).append(t)
    return tuple(
        ts[0] if len(ts) == 1 else dataclasses.replace(ts[0], bytes=sum(t.bytes for t in ts), detail=f"sum of {len(ts)} TBEs")
        for ts in out.values()
    )


def static_terms(inputs: PlannerInputs, io: RankIO) -> tuple[Term, ...]:
    terms = [Term(name, side, "static", b, d) for g in io.tbes for name, side, b, d in tbe_static(inputs, g)]
    P = inputs.dense.num_params
    k = _DENSE_OPT[inputs.dense_optimizer]
    terms += [Term("dense_params", "hbm", "static", 4 * P + inputs.dense.buffer_bytes, f"{P} params")]
    if inputs.world_size > 1:  # on one rank nothing holds them between steps: the backward makes them (alive_items)
        terms.append(Term("dense_grads", "hbm", "static", 4 * P, f"{P} params (views of the flat all-reduce buffer or DDP buckets)"))
    terms += [
        Term("dense_optimizer", "hbm", "static", k * STATE_BYTES * P, f"{inputs.dense_optimizer}: {k} x params"),
        Term("cublas_workspace", "hbm", "static", CUBLAS_WORKSPACE_BYTES, "cuBLAS + cuBLASLt, default stream"),
    ]
    parts = inputs.pipeline.graphed_parts
    if parts:
        # torch.cuda.make_graphed_callables warms each part up on a new stream, whose cuBLAS
        # workspaces stay cached; the capture stream's (in the first graph's pool) take the
        # default stream's place, which then runs no GEMM. Measured (see
        # CUDA_GRAPH_PART_SEGMENT_BYTES): 64 MiB on each warm-up stream, 64 in the first pool.
        dense_out = inputs.batch_size * inputs.dense.dense_out_grad_bytes
        terms += [
            Term("cuda_graph_workspaces", "hbm", "static", parts * CUBLAS_WORKSPACE_BYTES,
                 f"{parts} graphed parts' warm-up streams (cuBLAS + cuBLASLt)"),
            Term("cuda_graph_buffers", "hbm", "static", pooled_output_bytes(inputs) + 2 * dense_out,
                 "the graphs' static outputs and input gradients (the dense arch's output and its gradient, "
                 "the pooled embeddings' gradient), in their pools for the model's life"),
        ]
    return _merge(terms)


def shard_memory(inputs: PlannerInputs, io: RankIO) -> list[ShardMemory]:
    """Per shard: its static bytes and the per-step bytes that scale with it."""
    pipe = inputs.pipeline
    loc_batches = 2 if pipe.prefetch else 1
    out = []
    for g in io.tbes:
        for i, s in enumerate(g.shards):
            t = g.tables[i]
            terms = [Term(name, side, "static", b, d) for name, side, b, d in shard_static(inputs, g, i)]
            n, out_rows = shard_indices(inputs, s), shard_output_rows(inputs, s)
            if t.sharding_type != "data_parallel":
                kjt = pipe.dist_kjts_in_flight * module_received_kjt_bytes(t, n, shard_bags(inputs, s), inputs.world_size)
                terms.append(Term("input_dist_kjts", "hbm", "per_step", kjt, f"{pipe.dist_kjts_in_flight} x {n:.0f} indices"))
            rows_what = "bags" if t.pooled else "ids"
            terms.append(Term("pooled_lookup", "hbm", "per_step", int(inputs.tbe_output_bytes * out_rows * s.cols),
                              f"{out_rows:.0f} {rows_what} x {s.cols}"))
            if t.cached:
                name = "prefetch_cache_locations" if pipe.prefetch else "cache_locations"
                terms.append(Term(name, "hbm", "per_step", int(loc_batches * LOCATION_BYTES * n), f"{loc_batches} x {n:.0f} x int32"))
            out.append(ShardMemory(s.table, g.rank, s.rows, s.cols, t.sharding_type, t.kernel, tuple(terms)))
    return out


# ------------------------------------------------------------------ per step
def _lookup_stream(inputs: PlannerInputs) -> str:
    """Stream that runs the embedding lookup (and, autograd following it, its backward)."""
    return inputs.pipeline.lookup_stream


def alive_items(inputs: PlannerInputs, io: RankIO) -> list[tuple[str, int, str, str]]:
    """(term, bytes, stream, detail) alive through the whole step (batches in flight)."""
    pipe = inputs.pipeline
    bb = batch_bytes(inputs)
    dist = "dist" if "dist" in pipe.side_streams else "main"
    items = [
        ("input_batches", pipe.batches_in_flight * bb, "memcpy", f"{pipe.batches_in_flight} x {bb} B"),
        ("input_dist_kjts", pipe.dist_kjts_in_flight * io.received, dist,
         f"{pipe.dist_kjts_in_flight} x received KJT" + (" (W=1: TBE offsets only)" if inputs.world_size == 1 else "")),
    ]
    if inputs.world_size > 1 and pipe.pending_input_dists:  # at W = 1 torchrec sends nothing
        sent = local_sparse_bytes(inputs)
        items.append(("input_dist_sent_kjts", pipe.pending_input_dists * sent, dist,
                      f"{pipe.pending_input_dists} x {sent} B, held by the all-to-all's awaitable until waited"))
    if pipe.early_pooled:
        items.append(("early_pooled_embeddings", io.lookup + io.pooled, _lookup_stream(inputs), "batch i+1"))
    if inputs.world_size == 1:  # no all-reduce buffer (recpipe.sharding.data_parallel): autograd makes them
        items.append(("dense_grads", 4 * inputs.dense.num_params, "main",
                      f"{inputs.dense.num_params} params, made by each backward (one rank: no all-reduce)"))
    if pipe.stash_dense_grads:
        items.append(("stashed_dense_grads", 4 * inputs.dense.num_params, "main", "dense grads"))
    if io.cached_indices:
        k = 2 if pipe.prefetch else 1
        items.append(("prefetch_cache_locations" if pipe.prefetch else "cache_locations",
                      int(k * LOCATION_BYTES * io.cached_indices), "prefetch" if pipe.prefetch else "main",
                      f"{k} x {io.cached_indices:.0f} x int32"))
    return items


def phase_items(inputs: PlannerInputs, io: RankIO) -> dict[str, list[tuple[str, int, str]]]:
    """Transients of each phase of a step: (term, bytes, stream)."""
    B = inputs.batch_size
    act_dense = B * inputs.dense.dense_arch_bytes  # at the model's precision (spec.activation_bytes)
    act_top = B * inputs.dense.top_bytes
    emb = _lookup_stream(inputs)
    pipe = inputs.pipeline
    tbe_backward = [("pooled_embedding_grads", io.lookup, "main"), ("sparse_backward_scratch", io.backward_scratch, emb)]
    phases = {
        "forward_lookup": [("pooled_lookup", io.lookup, emb), ("pooled_embeddings", io.pooled, "main"),
                           ("dense_arch_activations", act_dense, "main")],
        # the interaction copies the pooled embeddings (torch.cat) and drops them
        "forward_end": [("dense_arch_activations", act_dense, "main"), ("top_activations", act_top, "main")],
        # the dense arch's backward comes after the embeddings' (autograd runs newer nodes first)
        "backward_emb": tbe_backward + [("dense_arch_activations", act_dense, "main"),
                                        ("dense_output_grad", B * inputs.dense.dense_out_grad_bytes, "main")],
    }
    if pipe.dense_backward_first:  # once running (spec.PipelineSpec); semi_sync holds batch i's TBE outputs
        held = [("semi_sync_emb_graph", io.lookup + io.pooled, "main")] if pipe.keeps_emb_graph else []
        if pipe.early_pooled_at_update:
            # semi_sync before_update: batch i's pooled outputs are held through its dense backward
            # and freed by the output all-to-all backward; batch i+1's lookup (the same bytes) then
            # runs before this TBE backward. One at a time: counted once, under i+1's name.
            held = [("early_pooled_embeddings", io.lookup + io.pooled, emb)]
        phases["backward_emb_after_dense"] = tbe_backward + held
    if pipe.lookup_after_backward:  # fused_sparse_dist: lookup(i+1) after backward(i), beside the optimizer
        phases["lookup_next"] = [("early_pooled_embeddings", io.lookup + io.pooled, emb)]
    if pipe.prefetch and io.prefetch_scratch:  # prefetch(i+1) is issued right after forward(i)
        phases["forward_end"].append((prefetch_scratch_term(io.prefetch_insert), io.prefetch_scratch, "prefetch"))
    if io.relookup_scratch:  # after prefetch(i+1), its scratch freed: batch i's locations recomputed
        phases["cache_bookkeeping"] = [x for x in phases["forward_end"] if x[2] != "prefetch"] + [
            ("cache_bookkeeping_scratch", io.relookup_scratch, "prefetch")]
    if io.inline_scratch:
        phases["inline_prefetch"] = [("prefetch_scratch_inline", io.inline_scratch, "main"),
                                     ("dense_arch_activations", act_dense, "main")]
    if inputs.world_size > 1:  # the output dist's backward: see quantized_output_grad_bytes
        phases["backward_output_dist"] = [("pooled_output_grads", 2 * io.pooled, "main"),
                                          ("output_dist_quantized_grads", quantized_output_grad_bytes(inputs, io), "main"),
                                          ("dense_arch_activations", act_dense, "main")]
    return phases


def prefetch_scratch_term(insert: str) -> str:
    """The term name of the prefetch scratch of a TBE with ``insert``."""
    return "prefetch_scratch_recpipe_insert" if insert == "recpipe" else "prefetch_scratch"


def quantized_output_grad_bytes(inputs: PlannerInputs, io: RankIO) -> int:
    """Quantized comms (torchrec's qcomm codecs) change what the output dist holds:

    * forward: the TBE outputs are encoded and sent at ``p`` bytes per value and
      decoded into fp32 on arrival. The send and receive buffers replace fp32 ones
      of twice the size while the decoded copy adds one, so the forward peak (the
      fp32 outputs, their send copy or received values, and the output) does not grow.
      Where the TBEs write ``p`` bytes themselves (``PlannerInputs.tbe_output_bytes``)
      their outputs shrink instead (``io.lookup``);
    * backward (the ``backward_output_dist`` phase, any precision, W > 1): the
      gradient of the embeddings and its per-rank regrouped copy (fp32, 2 x pooled)
      are alive while the copy is sent; a quantized backward encodes it first:
      ``p`` x pooled more, returned here. Its all-to-all then moves half the bytes.

    0 at world size 1 (torchrec's all-to-alls return their input) or fp32 gradients."""
    p = inputs.comm_bytes[1]
    return 0 if inputs.world_size == 1 or p >= OUTPUT_BYTES else int(p * io.pooled / OUTPUT_BYTES)


def per_step_and_allocator(inputs: PlannerInputs, io: RankIO) -> tuple[list[Term], list[Term], str, dict[str, int]]:
    """Per-step terms at the peak phase, and the allocator's per-stream pools.

    allocated = static + alive + max over phases of the phase's transients.
    Each stream's pool keeps its own peak (alive on it + its largest phase), and
    blocks cached in one pool are not reused by another stream, so
    reserved = static + (1 + phi) * sum of pools, where a pool also covers staging
    the peak does not see (one batch on memcpy with default segments; on dist when W > 1, one more
    permuted local KJT: the next batch's input dist is launched while the one
    before is still held). With fused_sparse_dist's lookup on the dist stream,
    staging and lookup share that pool; on a 'new' stream they cannot (TorchRec #2916)."""
    alive = alive_items(inputs, io)
    phases = phase_items(inputs, io)
    totals = {p: sum(b for _, b, _ in items) for p, items in phases.items()}
    peak = max(totals, key=lambda p: totals[p])
    per_step = [Term(n, "hbm", "per_step", b, d) for n, b, _, d in alive]
    per_step += [Term(n, "hbm", "per_step", b, f"phase {peak}") for n, b, _ in phases[peak] if b]
    streams = ("main",) + inputs.pipeline.side_streams
    on = {s: sum(b for _, b, st, _ in alive if st == s) for s in streams}
    at_peak = {s: on[s] + sum(b for _, b, st in phases[peak] if st == s) for s in streams}
    # staging the peak does not see: on memcpy, with PyTorch's default segments, the next
    # batch's copy, made before the device has released the finished one's block (with
    # expandable segments the pool needs none: tests/test_planner_gpu.py and
    # tests/test_planner_precision_gpu.py measure both); one more permuted local KJT on
    # dist (W > 1). It reuses the pool's blocks when the lookup shares the stream.
    staging = {"memcpy": 0 if inputs.expandable_segments else batch_bytes(inputs),
               "dist": local_sparse_bytes(inputs) if inputs.world_size > 1 else 0}
    pool = {s: on[s] + max([sum(b for _, b, st in items if st == s) for items in phases.values()] + [staging.get(s, 0)])
            for s in streams}
    allocator = [Term("allocator_fragmentation", "hbm", "allocator",
                      int(ALLOCATOR_FRAGMENTATION * sum(pool.values())) + pool["main"] - at_peak["main"],
                      f"{ALLOCATOR_FRAGMENTATION:.0%} of the per-step pools + default pool outside the peak phase")]
    for s in inputs.pipeline.side_streams:
        allocator.append(Term(f"reserve_{s}_stream", "hbm", "allocator", pool[s] - at_peak[s],
                              f"pool {fmt_bytes(pool[s])}, {fmt_bytes(at_peak[s])} of it at the peak"))
    if inputs.world_size > 1:
        allocator.append(Term("collective_stream_pages", "hbm", "allocator", COLLECTIVE_STREAM_PAGE_BYTES,
                              "whole pages the dists' streams keep beyond their pools (measured)"))
    if inputs.pipeline.graphed_parts:
        allocator.append(Term("cuda_graph_segments", "hbm", "allocator",
                              inputs.pipeline.graphed_parts * CUDA_GRAPH_PART_SEGMENT_BYTES,
                              f"{inputs.pipeline.graphed_parts} graphed parts' warm-up streams and pools (measured)"))
    # The passes' segments stay beside the cache bookkeeping's (its blocks, over all of a batch's
    # indices at once, are larger than any a pass freed), so the two are not one pool;
    # tests/test_planner_gpu.py's 12-pass row with default segments measures it
    # (benchmarks/results/h200x4/planner.md).
    one_pass, passes = io.prefetch_scratch_one_pass, io.prefetch_scratch
    if inputs.pipeline.prefetch and one_pass > passes and not inputs.expandable_segments:
        # With PyTorch's default segments the prefetch stream's segments hold about one
        # pass's scratch, not the M-pass peak: each torch.cat of the merged indices asks for
        # a block larger than any the passes freed, so the allocator cuts a new segment. The
        # allocator releases them before it would fail. With expandable segments freed
        # blocks coalesce: no such term. tests/test_planner_gpu.py's allocator snapshots
        # measure it (docs/planner.md, "Allocator and runtime").
        extra = one_pass - passes
        allocator.append(Term("prefetch_pass_segments", "hbm", "cached", int((1 + ALLOCATOR_FRAGMENTATION) * extra),
                              f"(1 + {ALLOCATOR_FRAGMENTATION}) x (one-pass prefetch-stream scratch "
                              f"{fmt_bytes(one_pass)} - {fmt_bytes(passes)}), PyTorch's default segments"))
    return per_step, allocator, peak, totals


# ------------------------------------------------------------------ one rank
def _rank(inputs: PlannerInputs, rank: int) -> tuple[RankMemory, list[ShardMemory], RankIO]:
    io = rank_io(inputs, rank)
    per_step, allocator, peak, totals = per_step_and_allocator(inputs, io)
    runtime = [Term("cuda_context", "hbm", "runtime", CUDA_CONTEXT_BYTES, "measured on H100 (calibrate per site)")]
    if inputs.world_size > 1:
        runtime.append(Term("nccl_communicators", "hbm", "runtime", NCCL_BYTES, "calibrate"))
    bb = batch_bytes(inputs)
    host = [Term("pinned_host_batches", "ddr", "per_step", inputs.pipeline.batches_in_flight * bb, "pinned host batches")]
    terms = static_terms(inputs, io) + _merge(per_step) + tuple(allocator) + tuple(runtime) + tuple(host)
    groups = tuple(
        TbeGroupInfo(rank, g.name, g.sharding_type, "cached" if g.cached else g.kernel_class,
                     tuple(s.table for s in g.shards), round(n, 1), g.cache_rows, g.cache_slots, g.cache_dim,
                     dict(io.passes_effective).get(g.name, 0))
        for g, n in zip(io.tbes, io.indices)
    )
    rm = RankMemory(rank, inputs.hbm_capacity_bytes, terms, peak, tuple(totals.items()), groups)
    return rm, shard_memory(inputs, io), io


# ------------------------------------------------------------------ the plan
def plan_warnings(inputs: PlannerInputs, ranks: list[RankMemory], infos: list[RankIO]) -> list[str]:
    out: list[str] = []
    for rm, info in zip(ranks, infos):
        cache = rm.term("uvm_cache_weights")
        if cache and cache > rm.capacity_bytes - (rm.term("emb_weights") + rm.term("emb_optimizer_rowwise")):
            out.append(f"rank {rm.rank}: the UVM cache ({cache} B) exceeds the GPU memory left after the other "
                       "static buffers; FBGEMM would shrink it at construction")
        for name, eff in info.passes_effective:
            if inputs.prefetch_passes > 1 and eff < inputs.prefetch_passes:
                n = next(g.indices_per_batch for g in rm.tbe_groups if g.name == name)
                out.append(f"rank {rm.rank} TBE {name}: sharding.prefetch_passes={inputs.prefetch_passes} but only "
                           f"{eff} pass(es) happen: {n:.0f} indices per batch, "
                           f"sharding.prefetch_min_pass_size={inputs.prefetch_min_pass_size}")
    if inputs.pipeline.prefetch and inputs.prefetch_passes > 6 and tuple(inputs.fbgemm_version) >= (1, 4):
        out.append(f"sharding.prefetch_passes={inputs.prefetch_passes}: with FBGEMM >= 1.4 prefetch scratch floors at "
                   "2x the index bytes (merged linear indices); passes beyond about 6 save nothing")
    for s in inputs.shards:
        if s.cols % 4:
            out.append(f"{s.table}: shard of {s.cols} columns; FBGEMM needs a multiple of 4")
    return out + list(inputs.notes)


def estimate_ranks(inputs: PlannerInputs) -> tuple[list[RankMemory], list[ShardMemory], list[RankIO]]:
    ranks, shards, infos = [], [], []
    for r in range(inputs.world_size):
        rm, sh, info = _rank(inputs, r)
        ranks.append(rm)
        shards += sh
        infos.append(info)
    return ranks, shards, infos
