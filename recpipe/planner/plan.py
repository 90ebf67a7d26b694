"""The frozen memory plan and its two renderings (table, JSON).

A plan is a list of named :class:`Term` per rank and per shard. Every term has a
stable snake_case ``name`` (documented in :data:`TERM_DOC` and docs/planner.md), a
``side`` (``hbm`` = GPU memory, ``ddr`` = host memory), a ``category`` and its
``bytes``. A rank's HBM total is the sum of its ``hbm`` terms:

* ``static``: allocated once (weights, optimizer state, UVM cache, dense model);
* ``per_step``: alive at the step's memory peak (batches in flight, pooled
  embeddings, scratch of the peak phase);
* ``allocator``: reserved-but-not-allocated memory of the caching allocator
  (fragmentation of the default stream, and one pool per side stream);
* ``cached``: segments the caching allocator keeps when memory is plentiful but
  releases (and retries) before it raises out-of-memory: counted in what
  ``max_memory_reserved`` reads, not in what the GPU must hold;
* ``runtime``: outside PyTorch's allocator (CUDA context, NCCL).

``hbm_allocated_bytes`` (static + per_step) is what ``torch.cuda.max_memory_allocated``
should read, ``hbm_reserved_bytes`` (+ allocator + cached) what ``max_memory_reserved``
should read, ``hbm_bytes`` (static + per_step + allocator + runtime) what the GPU must
hold.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

GiB = float(1 << 30)
MiB = float(1 << 20)

CATEGORIES = ("static", "per_step", "allocator", "cached", "runtime")
NEEDED = ("static", "per_step", "allocator", "runtime")  # what the GPU must hold: all but ``cached``

# Every term name the planner emits, with what it is. docs/planner.md has the formulas.
TERM_DOC: dict[str, str] = {
    # static, embeddings (FBGEMM TBE buffers)
    "emb_weights": "TBE weights in HBM (weights_dev; kernel fused)",
    "emb_weights_uvm": "TBE weights in UVM = host DDR (weights_uvm; fused_uvm, fused_uvm_caching)",
    "emb_optimizer_rowwise": "row-wise optimizer state, always HBM, fp32 (momentum1_dev of rowwise_adagrad)",
    "emb_optimizer": "full optimizer state of HBM tables, fp32 (momentum1/2_dev of adam)",
    "emb_optimizer_uvm": "full optimizer state of UVM tables, fp32, in UVM (momentum1/2_uvm of adam)",
    "uvm_cache_weights": "HBM cache rows: slots x widest cached dim of the TBE (lxu_cache_weights)",
    "uvm_cache_state": "int64 per cache slot (lxu_cache_state)",
    "uvm_cache_lru_state": "int64 per cache slot, LRU timestamps (lxu_state)",
    "uvm_cache_index_map": "int32 per cached row (cache_index_table_map)",
    "uvm_cache_locking_counter": "int32 per cache slot when prefetch_pipeline (lxu_cache_locking_counter)",
    "tbe_metadata": "O(tables) TBE buffers (offsets, placements, counters), at the allocator's 512 B block",
    "dp_emb_weights": "data-parallel table weights (DenseTableBatchedEmbeddingBagsCodegen.weights)",
    "dp_emb_grads": "full dense gradient of data-parallel tables (= DDP bucket view)",
    "dp_emb_optimizer": "dense optimizer state of data-parallel tables",
    "dense_params": "dense (MLP) parameters and buffers",
    "dense_grads": "dense gradients; views of the flat all-reduce buffer (or of DDP's buckets) on several ranks",
    "dense_optimizer": "dense optimizer state (adagrad 1x, adam 2x parameters)",
    "cublas_workspace": "cuBLAS workspace of the default stream (taken from the caching allocator)",
    "cuda_graph_workspaces": "pipeline.cuda_graphs: the cuBLAS workspaces each graphed part's warm-up stream keeps",
    "cuda_graph_buffers": "pipeline.cuda_graphs: the graphs' static outputs and input gradients, kept in their pools",
    # per step, always alive
    "input_batches": "device copies of the input batches in flight (dense, labels, weights, KJT)",
    "input_dist_kjts": "KJTs received by the input all-to-all, for the batches past input dist",
    "input_dist_sent_kjts": "the permuted local KJT a batch's input all-to-all sent, held by torchrec's awaitable "
                            "until the batch's forward / lookup waits it: the batch in input dist during backward (W > 1)",
    "early_pooled_embeddings": "pooled embeddings (TBE outputs + output dist) of batch i+1 made ahead of its forward: "
                               "alive through backward(i) in semi_sync; only in its TBE backward with emb_lookup=before_update; "
                               "made after it in fused_sparse_dist (phase lookup_next)",
    "semi_sync_emb_graph": "semi_sync once running: batch i's TBE outputs kept until its embedding backward",
    "stashed_dense_grads": "semi_sync stash_gradients: one more copy of the dense gradients",
    "cache_locations": "int32 cache slot per index of the batch in training (lxu_cache_locations)",
    "prefetch_cache_locations": "int32 cache slot per index, batch i (autograd) and i+1 (prefetched)",
    # per step, phase transients
    "pooled_lookup": "TBE outputs before the output all-to-all / reduce-scatter (a row per bag; per id for sequence tables)",
    "pooled_embeddings": "embeddings after the output dist (B x sum of dims; ids x dim for sequence tables)",
    "pooled_embedding_grads": "gradients of the pooled embeddings, both sides of the output dist",
    "dense_arch_activations": "activations the dense arch saves for backward",
    "dense_output_grad": "gradient of the dense arch's output, waiting through the TBE backward for the dense arch's "
                         "(DLRM B x D; DCNv2 x0's B x (F+1) x D; x 2 bytes with bf16, else 4)",
    "top_activations": "activations of the interaction and over arch saved for backward",
    "sparse_backward_scratch": "TBE backward temporaries (transpose_embedding_input sort, ~36 B/index)",
    "prefetch_scratch": "prefetch-stream temporaries of the UVM cache prefetch at the passes that happen "
                        "(FBGEMM's insert, lru_cache_populate)",
    "prefetch_scratch_recpipe_insert": "prefetch-stream temporaries of the UVM cache prefetch at the passes that happen, "
                                       "with recpipe's insert (pipeline.cache_fill)",
    "cache_bookkeeping_scratch": "prefetch stream, after prefetch(i+1): batch i's cache locations recomputed over all its "
                                 "indices at once (recpipe.speedups.cache_bookkeeping)",
    "prefetch_scratch_inline": "temporaries of the in-forward cache prefetch (no prefetch pipeline, one pass)",
    "pooled_output_grads": "gradient of the embeddings after the output dist and its copy regrouped per rank (W > 1)",
    "output_dist_quantized_grads": "quantized comms: the regrouped gradient encoded to sharding.comm_precision.backward",
    # allocator
    "allocator_fragmentation": "reserved-over-allocated of the default stream's pool",
    "reserve_memcpy_stream": "memcpy stream pool: one batch freed late (record_stream)",
    "reserve_dist_stream": "dist stream pool: input all-to-all staging (permuted/bucketized KJT)",
    "reserve_lookup_stream": "lookup stream pool (a schedule with a lookup role): early pooled embeddings not reusable by the default stream",
    "reserve_prefetch_stream": "prefetch stream pool: its scratch when not overlapping the peak",
    "collective_stream_pages": "W > 1: whole allocator pages the input and output dists' streams keep beyond their pools",
    "cuda_graph_segments": "pipeline.cuda_graphs: what each graphed part's warm-up stream and graph pool reserve "
                           "beyond what they hold",
    # cached
    "prefetch_pass_segments": "multi-pass prefetch with PyTorch's default segments: the prefetch pool's segments stay "
                              "near one pass's (released under pressure; none with expandable segments)",
    # runtime
    "cuda_context": "CUDA context and kernel images (outside PyTorch's allocator)",
    "nccl_communicators": "NCCL communicator buffers (world size > 1)",
    # host
    "pinned_host_batches": "pinned host copies of the batches in flight (data.pin_memory)",
}


@dataclass(frozen=True)
class Term:
    name: str
    side: str  # hbm | ddr
    category: str  # static | per_step | allocator | cached | runtime
    bytes: int
    detail: str = ""  # the numbers that went into it

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "side": self.side, "category": self.category, "bytes": self.bytes, "detail": self.detail}


def _sum(terms: tuple[Term, ...], side: str, categories: tuple[str, ...] = CATEGORIES) -> int:
    return sum(t.bytes for t in terms if t.side == side and t.category in categories)


@dataclass(frozen=True)
class TbeGroupInfo:
    """One FBGEMM TBE as torchrec will build it on a rank (show-your-work)."""

    rank: int
    name: str
    sharding_type: str
    kernel: str
    tables: tuple[str, ...]
    indices_per_batch: float
    cache_rows: int = 0
    cache_slots: int = 0
    cache_dim: int = 0
    prefetch_passes_effective: int = 0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__, tables=list(self.tables))


@dataclass(frozen=True)
class ShardMemory:
    table: str
    rank: int
    rows: int
    cols: int
    sharding_type: str
    kernel: str
    terms: tuple[Term, ...]

    @property
    def hbm_bytes(self) -> int:
        return _sum(self.terms, "hbm", NEEDED)

    @property
    def ddr_bytes(self) -> int:
        return _sum(self.terms, "ddr")

    def to_json(self) -> dict[str, Any]:
        return {
            "table": self.table, "rank": self.rank, "rows": self.rows, "cols": self.cols,
            "sharding_type": self.sharding_type, "kernel": self.kernel,
            "hbm_bytes": self.hbm_bytes, "ddr_bytes": self.ddr_bytes,
            "terms": [t.to_json() for t in self.terms],
        }


@dataclass(frozen=True)
class RankMemory:
    rank: int
    capacity_bytes: int
    terms: tuple[Term, ...]
    peak_phase: str
    phases: tuple[tuple[str, int], ...]  # transient bytes of each phase
    tbe_groups: tuple[TbeGroupInfo, ...] = ()

    @property
    def hbm_bytes(self) -> int:
        return _sum(self.terms, "hbm", NEEDED)

    @property
    def ddr_bytes(self) -> int:
        return _sum(self.terms, "ddr")

    @property
    def hbm_allocated_bytes(self) -> int:
        return _sum(self.terms, "hbm", ("static", "per_step"))

    @property
    def hbm_reserved_bytes(self) -> int:
        return _sum(self.terms, "hbm", ("static", "per_step", "allocator", "cached"))

    @property
    def fits(self) -> bool:
        return self.hbm_bytes <= self.capacity_bytes

    def term(self, name: str) -> int:
        return sum(t.bytes for t in self.terms if t.name == name)

    def largest(self, n: int = 3, side: str = "hbm") -> list[Term]:
        return sorted((t for t in self.terms if t.side == side and t.bytes), key=lambda t: -t.bytes)[:n]

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "hbm_bytes": self.hbm_bytes, "ddr_bytes": self.ddr_bytes,
            "hbm_allocated_bytes": self.hbm_allocated_bytes, "hbm_reserved_bytes": self.hbm_reserved_bytes,
            "capacity_bytes": self.capacity_bytes, "fits": self.fits, "peak_phase": self.peak_phase,
            "phases": dict(self.phases), "terms": [t.to_json() for t in self.terms],
            "tbe_groups": [g.to_json() for g in self.tbe_groups],
        }


@dataclass(frozen=True)
class PrefetchSavings:
    """What multi-pass prefetch buys on one rank: HBM at the configured passes vs one."""

    rank: int
    passes: int
    passes_effective: tuple[tuple[str, int], ...]  # per cached TBE
    scratch_bytes: int
    scratch_bytes_one_pass: int
    hbm_bytes: int
    hbm_bytes_one_pass: int

    @property
    def saved_bytes(self) -> int:
        return self.hbm_bytes_one_pass - self.hbm_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "passes": self.passes, "passes_effective": dict(self.passes_effective),
            "prefetch_scratch_bytes": self.scratch_bytes, "prefetch_scratch_bytes_one_pass": self.scratch_bytes_one_pass,
            "hbm_bytes": self.hbm_bytes, "hbm_bytes_one_pass": self.hbm_bytes_one_pass, "saved_bytes": self.saved_bytes,
        }


@dataclass(frozen=True)
class PrecisionSavings:
    """What the configured precisions (tables, caches, comms) save on one rank,
    against the same plan with every precision fp32."""

    rank: int
    hbm_bytes: int
    hbm_bytes_fp32: int
    ddr_bytes: int
    ddr_bytes_fp32: int
    table_hbm_bytes: int  # weights + caches in HBM (emb_weights, uvm_cache_weights)
    table_hbm_bytes_fp32: int
    output_a2a_bytes: int  # output + backward all-to-all bytes per step, busier direction
    output_a2a_bytes_fp32: int

    @property
    def saved_hbm_bytes(self) -> int:
        return self.hbm_bytes_fp32 - self.hbm_bytes

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__, saved_hbm_bytes=self.saved_hbm_bytes,
                    saved_ddr_bytes=self.ddr_bytes_fp32 - self.ddr_bytes)


@dataclass(frozen=True)
class MemoryPlan:
    ranks: tuple[RankMemory, ...]
    shards: tuple[ShardMemory, ...]
    pipeline: str
    world_size: int
    batch_size: int
    fbgemm_version: tuple[int, int]
    prefetch: tuple[PrefetchSavings, ...] = ()
    warnings: tuple[str, ...] = field(default=())
    precision: tuple[PrecisionSavings, ...] = ()  # only when some precision is not fp32

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.ranks)

    def rank(self, r: int) -> RankMemory:
        return self.ranks[r]

    def to_json(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "pipeline": self.pipeline, "world_size": self.world_size, "batch_size": self.batch_size,
            "fbgemm_version": ".".join(map(str, self.fbgemm_version)),
            "ranks": [r.to_json() for r in self.ranks],
            "shards": [s.to_json() for s in self.shards],
            "prefetch": [p.to_json() for p in self.prefetch],
            "warnings": list(self.warnings),
            **({"precision": [p.to_json() for p in self.precision]} if self.precision else {}),
            "term_doc": {k: v for k, v in TERM_DOC.items()},
        }

    def json(self) -> str:
        return json.dumps(self.to_json(), indent=2)


# ------------------------------------------------------------------ rendering
def fmt_bytes(n: float) -> str:
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / 1024:.1f} KiB" if abs(n) >= 1024 else f"{int(n)} B"


def grid(header: tuple[str, ...], rows: list[tuple[str, ...]], right: set[int] = frozenset()) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    def line(r: tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return [line(header), line(tuple("-" * w for w in widths))] + [line(r) for r in rows]


def describe_does_not_fit(rank: RankMemory, n: int = 3) -> str:
    big = ", ".join(f"{t.name} {fmt_bytes(t.bytes)}" for t in rank.largest(n))
    return (
        f"rank {rank.rank} needs {fmt_bytes(rank.hbm_bytes)} of GPU memory but has "
        f"{fmt_bytes(rank.capacity_bytes)} (sharding.hbm_gib / hbm_gb); largest terms: {big}"
    )


def check_fits(plan: MemoryPlan) -> str | None:
    """None when every rank fits, else one line per rank that does not."""
    bad = [describe_does_not_fit(r) for r in plan.ranks if not r.fits]
    return "\n".join(bad) if bad else None


def summary(plan: MemoryPlan) -> str:
    """Per-rank totals against capacity (what ``recpipe train`` prints at start)."""
    header = ("rank", "HBM", "capacity", "used", "allocated", "reserved", "host DDR", "largest HBM terms")
    rows = []
    for r in plan.ranks:
        big = ", ".join(f"{t.name} {fmt_bytes(t.bytes)}" for t in r.largest(3))
        rows.append((
            str(r.rank), fmt_bytes(r.hbm_bytes), fmt_bytes(r.capacity_bytes),
            f"{100.0 * r.hbm_bytes / r.capacity_bytes:.0f}%" + ("" if r.fits else " !"),
            fmt_bytes(r.hbm_allocated_bytes), fmt_bytes(r.hbm_reserved_bytes), fmt_bytes(r.ddr_bytes), big,
        ))
    title = (
        f"memory plan: pipeline {plan.pipeline}, {plan.world_size} rank(s), batch {plan.batch_size}/rank, "
        f"fbgemm {'.'.join(map(str, plan.fbgemm_version))}: {'fits' if plan.fits else 'DOES NOT FIT'}"
    )
    return "\n".join([title] + grid(header, rows, right={1, 2, 3, 4, 5, 6}))


def render_table(plan: MemoryPlan) -> str:
    out = [summary(plan), ""]
    for r in plan.ranks:
        out.append(f"rank {r.rank}: terms (peak phase: {r.peak_phase})")
        rows = [
            (t.name, t.category, t.side, fmt_bytes(t.bytes), t.detail)
            for t in sorted(r.terms, key=lambda t: (CATEGORIES.index(t.category), -t.bytes))
            if t.bytes
        ]
        out += ["  " + s for s in grid(("term", "category", "side", "bytes", "detail"), rows, right={3})]
        out.append("")
    out.append("shards")
    rows = []
    for s in plan.shards:
        big = max((t for t in s.terms if t.bytes), key=lambda t: t.bytes, default=None)
        rows.append((
            s.table, str(s.rank), f"{s.rows}x{s.cols}", s.sharding_type, s.kernel,
            fmt_bytes(s.hbm_bytes), fmt_bytes(s.ddr_bytes), big.name if big else "-",
        ))
    out += ["  " + s for s in grid(("table", "rank", "shard", "sharding", "kernel", "HBM", "DDR", "largest"), rows, right={5, 6})]
    if plan.prefetch:
        out += ["", "multi-pass prefetch (configured passes vs one pass)"]
        rows = [
            (
                str(p.rank), str(p.passes), ",".join(f"{k}:{v}" for k, v in p.passes_effective),
                fmt_bytes(p.scratch_bytes), fmt_bytes(p.scratch_bytes_one_pass), fmt_bytes(p.saved_bytes),
            )
            for p in plan.prefetch
        ]
        header = ("rank", "passes", "passes that happen (TBE:passes)", "scratch", "scratch @1 pass", "HBM saved")
        out += ["  " + s for s in grid(header, rows, right={3, 4, 5})]
    if plan.precision:
        out += ["", "precision (configured vs every precision fp32)"]
        rows = [
            (
                str(p.rank), fmt_bytes(p.table_hbm_bytes), fmt_bytes(p.table_hbm_bytes_fp32), fmt_bytes(p.hbm_bytes),
                fmt_bytes(p.hbm_bytes_fp32), fmt_bytes(p.saved_hbm_bytes), fmt_bytes(p.ddr_bytes_fp32 - p.ddr_bytes),
                fmt_bytes(p.output_a2a_bytes), fmt_bytes(p.output_a2a_bytes_fp32),
            )
            for p in plan.precision
        ]
        header = ("rank", "tables+caches HBM", "@fp32", "HBM", "HBM @fp32", "HBM saved", "DDR saved",
                  "output+bwd a2a/step", "@fp32")
        out += ["  " + s for s in grid(header, rows, right=set(range(1, 9)))]
    if plan.warnings:
        out += ["", "warnings"] + [f"  - {w}" for w in plan.warnings]
    return "\n".join(out)
