"""FBGEMM TBE formulas: how torchrec groups shards into TBEs, what each TBE allocates
statically, and the temporaries of its prefetch and backward.

Source references are to ``fbgemm_gpu/split_table_batched_embeddings_ops_training.py``
(fbgemm-gpu 1.8.0; 1.6.0 has the same logic) and to torchrec 1.8.0 / 1.6.1:

* grouping: ``torchrec/distributed/embedding_sharding.py::group_tables``. Per
  embedding module, one lookup per (sharding type, device) (``embeddingbag.py::create_sharding_infos_by_sharding_device_group``),
  then per rank one TBE per grouping key: fused, fused_uvm and fused_uvm_caching map to
  the same kernel type, but the cache tables carry cache keys in their fused params
  (``utils.py::add_params_from_parameter_sharding``), so cached tables form their own
  TBE; with ``prefetch_pipeline`` cached tables are further bucketed by exact dim.
  The TBE's ``cache_load_factor`` is the row-weighted mean of its tables'
  (``_get_weighted_avg_cache_load_factor``, weights = full-table rows).
* weights / states: ``construct_split_state`` + ``apply_split_helper``: DEVICE tables
  put weights and every state in HBM; MANAGED(_CACHING) tables put weights in UVM,
  row-wise states in HBM ("if optimizer state is rowwise, optimizer is on device")
  and full states in UVM. Weights are in the TBE's ``weights_precision`` (torchrec:
  the tables' ``data_type``, one per TBE); states are fp32 (``momentum1_dtype``:
  ``optimizer_state_dtypes`` exists only for partial row-wise Adam and ensemble
  row-wise Adagrad, which recpipe does not offer).
* cache: ``_apply_cache_state``: ``sets = (int(H * clf) + 31) // 32`` (at least 1),
  ``slots = 32 * sets``; ``lxu_cache_weights`` [slots, max_D_cache] in
  ``cache_precision`` (by default the weights'), ``lxu_cache_state`` and LRU
  ``lxu_state`` int64 [sets, 32], ``cache_index_table_map`` int32 [H]; ``_init_uvm_cache_counter``: ``lxu_cache_locking_counter`` int32 [sets, 32]
  when ``prefetch_pipeline``. The cache shrinks only if it exceeds the GPU's free
  memory at construction (we warn instead).
* prefetch: ``_prefetch`` + ``get_prefetch_passes``; backward:
  ``transpose_embedding_input``; see :func:`prefetch_scratch_bytes`. In recpipe's
  prefetch step the insert may be recpipe's own (``recpipe/speedups/cache_fill.py``,
  :func:`tbe_cache_insert`), and FBGEMM's backward pre-hook work may run on the prefetch
  stream (``recpipe/speedups/cache_bookkeeping.py``, :func:`cache_relookup_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from recpipe.planner.spec import UVM_KERNELS, PlannerInputs, ShardSpec, TableSpec

CACHE_ASSOC = 32  # DEFAULT_ASSOC on CUDA (tbe/cache/cache_config.py); 64 on ROCm
ALLOC_BLOCK = 512  # CUDA caching allocator: every block is a multiple of 512 B
TBE_SMALL_BUFFERS = 32  # O(T) device buffers of a TBE that are non-empty (offsets, placements, counters): 28-37 in fbgemm 1.8

# Bytes per index of the prefetch's largest pass at its peak (lru_cache_populate:
# linearized 8 + unique 8 + cache_sets 4 + sorted sets 4 + sorted unique 8 + CUB
# SortPairs temp 12.18, CUB's temp sizes taken from GPU runs: docs/planner.md, "What is
# approximate"; tests/test_planner_gpu.py's prefetch rows check them).
PREFETCH_BYTES_PER_INDEX = 44.18
# TBE backward, transpose_embedding_input: infos int32 + sorted infos int32 + linear
# indices int64 + sorted int64 (+ a 12.18 B/index radix-sort temp, freed first), then
# run int64 + run lengths int32 + cumulative lengths int32 = 40 B/index at the peak
# (4+4+8+8+8+4+4, fbgemm 1.6; tests/test_planner_gpu.py checks it).
BACKWARD_BYTES_PER_INDEX = 40.0
BACKWARD_CACHED_EXTRA_BYTES_PER_INDEX = 12.18
# recpipe's insert (recpipe/speedups/cache_fill.py: insert_triton, then move_triton) in
# place of lru_cache_populate, per index n of the pass; every tensor is [n] (FBGEMM's
# get_unique_indices pads its output to n). Its peak is in move_triton's second
# _host_offsets (the evicted rows'), at `(ids - cumsum[feature])`: linearized 8 (FBGEMM's
# caller) + the Insert's ids, slot, old 3 x 8 + masks taken, evicting 2 x 1 + the new rows'
# offsets and dims 2 x 8 + where(evicting, old, 0) 8 + feature, dim 2 x 8 + offsets[feature],
# cumsum[feature], their difference 3 x 8 = 98 (its stable torch.sort peaks lower: unique,
# home, sorted sets, order, iota 5 x 8 + CUB pairs temp 16.18 = 56.18, + 8 linearized).
RECPIPE_INSERT_BYTES_PER_INDEX = 98.0
# FBGEMM's backward pre-hook work recomputing a batch's cache locations over all its N
# indices in one go (fbgemm _update_cache_counter_and_locations, or recpipe's
# cache_bookkeeping._relookup): linearized 8 + get_unique_indices' sorted 8 + unique 8 +
# CUB SortKeys temp 8.18 (measured, see PREFETCH_BYTES_PER_INDEX) = 32.18 B/index; the lock
# release before it allocates an int32 count per cache slot (freed first).
CACHE_RELOOKUP_BYTES_PER_INDEX = 32.18
INDEX_BYTES = 8  # TBE indices are int64
LOCATION_BYTES = 4  # lxu_cache_locations int32
STATE_BYTES = 4  # optimizer state fp32


@dataclass(frozen=True)
class Tbe:
    """One TBE on one rank: its shards in torchrec's order."""

    rank: int
    sharding_type: str
    kernel_class: str  # fused | dense
    cached: bool
    dim_bucket: int | None
    shards: tuple[ShardSpec, ...]
    tables: tuple[TableSpec, ...]  # the table of each shard
    module: str = ""  # in the name when the model has several embedding modules

    @property
    def name(self) -> str:
        kind = "cached" if self.cached else ("dense" if self.kernel_class == "dense" else "fused")
        name = f"{self.sharding_type}/{kind}" + (f"/d{self.dim_bucket}" if self.dim_bucket else "")
        return f"{self.module}:{name}" if self.module else name

    @property
    def cache_rows(self) -> int:
        """H_c: rows of the MANAGED_CACHING tables (CacheState.total_cache_hash_size)."""
        return sum(s.rows for s, t in zip(self.shards, self.tables) if t.cached)

    @property
    def cache_load_factor(self) -> float | None:
        """torchrec's row-weighted mean over the cached tables (full-table rows), in
        torchrec's float order so ``int(H * clf)`` matches FBGEMM bit for bit."""
        total, weight = 0.0, 0
        for t in self.tables:
            if t.cached:
                total += t.cache_load_factor * t.rows
                weight += t.rows
        return total / weight if weight else None

    @property
    def cache_sets(self) -> int:
        h = self.cache_rows
        if not h:
            return 0
        sets = (int(h * self.cache_load_factor) + CACHE_ASSOC - 1) // CACHE_ASSOC
        return max(sets, 1)

    @property
    def cache_slots(self) -> int:
        return self.cache_sets * CACHE_ASSOC

    @property
    def cache_dim(self) -> int:
        """max_D_cache: the widest *cached* table of the TBE."""
        return max((s.cols for s, t in zip(self.shards, self.tables) if t.cached), default=0)


def shard_indices(inputs: PlannerInputs, shard: ShardSpec) -> float:
    """Expected indices per batch that reach this shard's TBE (after input dist).

    TW / CW: the table's ids of all W ranks; RW: the share of those ids in the
    shard's row block (ids are spread over the table); DP: the rank's own ids."""
    t = inputs.table(shard.table)
    B, W = inputs.batch_size, inputs.world_size
    if t.sharding_type in ("table_wise", "column_wise"):
        return W * B * t.ids_per_sample
    if t.sharding_type in ("row_wise", "table_row_wise"):
        return W * B * t.ids_per_sample * shard.rows / t.rows
    return B * t.ids_per_sample


def shard_bags(inputs: PlannerInputs, shard: ShardSpec) -> int:
    """Bags (lengths entries; pooled output rows of a pooled table) of this shard
    per batch: one per sample and feature."""
    t = inputs.table(shard.table)
    samples = inputs.batch_size if t.sharding_type == "data_parallel" else inputs.world_size * inputs.batch_size
    return samples * t.num_features


def shard_output_rows(inputs: PlannerInputs, shard: ShardSpec) -> float:
    """Rows of this shard's TBE output per batch: one per bag for a pooled table,
    one per id for a sequence table (EmbeddingCollection)."""
    return shard_bags(inputs, shard) if inputs.table(shard.table).pooled else shard_indices(inputs, shard)


def group_tbes(inputs: PlannerInputs, rank: int) -> list[Tbe]:
    """The TBEs torchrec builds on ``rank``, in torchrec's order."""
    keys: list[tuple] = []
    members: dict[tuple, list[tuple[ShardSpec, TableSpec]]] = {}
    for shard in inputs.shards_on(rank):
        t = inputs.table(shard.table)
        kernel_class = "dense" if t.kernel == "dense" else "fused"
        bucket = shard.cols if (t.cached and inputs.prefetch_pipeline) else None
        # Each embedding module has its own lookups (one per sharding type), so
        # tables of different modules never share a TBE; torchrec's group_tables also
        # keys on the data type and the per-table fused params (cache precision,
        # stochastic rounding).
        key = (t.module, t.sharding_type, kernel_class, t.cached, bucket,
               t.weights_precision, t.cache_precision, t.stochastic_rounding)
        if key not in members:
            keys.append(key)
            members[key] = []
        members[key].append((shard, t))
    several = len({t.module for t in inputs.tables}) > 1
    out = []
    for key in keys:
        module, st, kc, cached, bucket = key[:5]
        shards, tables = zip(*members[key])
        out.append(Tbe(rank, st, kc, cached, bucket, tuple(shards), tuple(tables), module if several else ""))
    return out


# ------------------------------------------------------------------ static
_OPT_STATES = {  # optimizer -> (rowwise states, full states) per row
    "sgd": (0, 0),
    "rowwise_adagrad": (1, 0),  # momentum1 [R]
    "adam": (0, 2),  # momentum1, momentum2 [R*D]
}
_DENSE_OPT_STATES = {"sgd": 0, "adagrad": 1, "adam": 2}  # torch.optim state tensors per parameter


def tbe_static(inputs: PlannerInputs, tbe: Tbe) -> list[tuple[str, str, int, str]]:
    """(name, side, bytes, detail) of every static buffer of ``tbe`` that scales with
    the tables, plus ``tbe_metadata``. Equal byte for byte to the TBE's buffers."""
    wb = tbe.tables[0].weight_bytes  # one data type per TBE (a grouping key)
    out: list[tuple[str, str, int, str]] = []
    if tbe.kernel_class == "dense":
        numel = sum(s.rows * s.cols for s in tbe.shards)
        k = _DENSE_OPT_STATES[inputs.dense_optimizer]
        out.append(("dp_emb_weights", "hbm", numel * wb, f"{numel} x {wb} B"))
        out.append(("dp_emb_grads", "hbm", numel * wb, "zeros_like(weights) in backward"))
        out.append(("dp_emb_optimizer", "hbm", k * numel * STATE_BYTES, f"{inputs.dense_optimizer}: {k} x weights"))
        return out
    rw, full = _OPT_STATES[inputs.embedding_optimizer]
    dev = [(s, t) for s, t in zip(tbe.shards, tbe.tables) if t.kernel not in UVM_KERNELS]
    uvm = [(s, t) for s, t in zip(tbe.shards, tbe.tables) if t.kernel in UVM_KERNELS]
    dev_numel = sum(s.rows * s.cols for s, _ in dev)
    uvm_numel = sum(s.rows * s.cols for s, _ in uvm)
    rows = sum(s.rows for s in tbe.shards)
    out.append(("emb_weights", "hbm", dev_numel * wb, f"{dev_numel} x {wb} B"))
    out.append(("emb_weights_uvm", "ddr", uvm_numel * wb, f"{uvm_numel} x {wb} B"))
    out.append(("emb_optimizer_rowwise", "hbm", rw * rows * STATE_BYTES, f"{rows} rows x fp32"))
    out.append(("emb_optimizer", "hbm", full * dev_numel * STATE_BYTES, f"{full} x {dev_numel} x fp32"))
    out.append(("emb_optimizer_uvm", "ddr", full * uvm_numel * STATE_BYTES, f"{full} x {uvm_numel} x fp32"))
    if tbe.cached:
        slots, d, h = tbe.cache_slots, tbe.cache_dim, tbe.cache_rows
        detail = f"{slots} slots (H={h}, clf={tbe.cache_load_factor:.4g})"
        cb = next(t.cache_bytes for t in tbe.tables if t.cached)  # cache precision: a grouping key too
        out.append(("uvm_cache_weights", "hbm", slots * d * cb, f"{detail} x {d} x {cb} B"))
        out.append(("uvm_cache_state", "hbm", slots * 8, detail))
        out.append(("uvm_cache_lru_state", "hbm", slots * 8, detail))
        out.append(("uvm_cache_index_map", "hbm", h * 4, f"{h} rows x int32"))
        lock = slots * 4 if inputs.prefetch_pipeline else 0
        out.append(("uvm_cache_locking_counter", "hbm", lock, detail if lock else "no prefetch_pipeline"))
    out.append(("tbe_metadata", "hbm", TBE_SMALL_BUFFERS * ALLOC_BLOCK, f"~{TBE_SMALL_BUFFERS} small buffers"))
    return out


def shard_static(inputs: PlannerInputs, tbe: Tbe, index: int) -> list[tuple[str, str, int, str]]:
    """Static bytes of the ``index``-th shard of ``tbe``: its own weights, state and
    index map, and its share of the TBE's cache (by cached rows; the last cached
    shard takes the rounding), so shard sums equal the TBE's totals."""
    one = Tbe(tbe.rank, tbe.sharding_type, tbe.kernel_class, tbe.cached, tbe.dim_bucket,
              (tbe.shards[index],), (tbe.tables[index],), tbe.module)
    own = [x for x in tbe_static(inputs, one) if not x[0].startswith("uvm_cache_") and x[0] != "tbe_metadata"]
    shard, table = tbe.shards[index], tbe.tables[index]
    if not (tbe.cached and table.cached):
        return own
    totals = {n: b for n, _, b, _ in tbe_static(inputs, tbe) if n.startswith("uvm_cache_")}
    cached_idx = [i for i, t in enumerate(tbe.tables) if t.cached]
    h = tbe.cache_rows
    for name, total in totals.items():
        if name == "uvm_cache_index_map":
            b = shard.rows * 4
        else:
            shares = [total * tbe.shards[i].rows // h if h else 0 for i in cached_idx]
            shares[-1] += total - sum(shares)
            b = shares[cached_idx.index(index)]
        own.append((name, "hbm", b, f"share {shard.rows}/{h} of the TBE's cache"))
    return own


# ------------------------------------------------------------------ prefetch
def prefetch_pass_sizes(num_indices: int, passes: int, min_pass_size: int) -> list[int]:
    """``get_prefetch_passes``: one pass if ``N <= passes`` or ``passes == 1``, else
    passes of ``max(ceil(N / passes), min_splitable_pass_size)`` indices."""
    n = int(num_indices)
    if n <= 0:
        return []
    if passes <= 1 or n <= passes:
        return [n]
    size = max(math.ceil(n / passes), min_pass_size)
    return [min(size, n - start) for start in range(0, n, size)]


def tbe_cache_insert(insert: str, tbe: Tbe) -> str:
    """The insert a cached TBE's prefetch really runs, given the pipeline's
    (``PipelineSpec.cache_insert``): recpipe's copies rows as they are, so a TBE whose
    cache rows are not in its weights' precision keeps FBGEMM's
    (``recpipe.speedups.cache_fill.unsupported``; weights are fp32 or fp16 here)."""
    same = all(t.cache_bytes == t.weight_bytes for t in tbe.tables if t.cached)
    return "recpipe" if insert == "recpipe" and same else "fbgemm"


def merges_linear_indices(fbgemm_version: tuple[int, int]) -> bool:
    """FBGEMM >= 1.4 (#4741) concatenates every pass's linearized indices into
    ``linear_cache_indices_merged`` (kept for raw embedding streaming)."""
    return tuple(fbgemm_version) >= (1, 4)


def prefetch_scratch_bytes(num_indices: float, passes: int, min_pass_size: int, fbgemm_version: tuple[int, int],
                           insert: str = "fbgemm") -> int:
    """Peak temporaries of one TBE's ``_prefetch`` besides its output locations.

    Per pass of n indices the insert peaks at p n bytes, the pass's linearized
    indices included: FBGEMM's ``lru_cache_populate`` p = 44.18 (CUB sort temps
    included), recpipe's (``insert="recpipe"``) p = 98. FBGEMM >= 1.4 also keeps the
    merged int64 indices of the passes so far (8 * cum) and briefly holds old + new
    merged during each ``torch.cat`` (16 * cum). With S = 8 N and FBGEMM's insert: one
    pass 6.52 S; M passes max(2 S, S + 5.52 S / M) (floor 2 S: passes beyond ~6 stop
    helping); before 1.4: 5.52 S / M. With recpipe's: one pass 13.25 S; M passes
    max(2 S, S + 12.25 S / M).
    """
    sizes = prefetch_pass_sizes(int(round(num_indices)), passes, min_pass_size)
    merged = merges_linear_indices(fbgemm_version)
    per_index = RECPIPE_INSERT_BYTES_PER_INDEX if insert == "recpipe" else PREFETCH_BYTES_PER_INDEX
    peak, cum = 0.0, 0
    for n in sizes:
        cum += n
        populate = per_index * n + (INDEX_BYTES * cum if merged else 0)
        cat = 2 * INDEX_BYTES * cum if merged else 0
        peak = max(peak, populate, cat)
    return int(math.ceil(peak))


def cache_relookup_bytes(num_indices: float, cache_slots: int) -> int:
    """FBGEMM's backward pre-hook work for one batch of a cached TBE with
    ``prefetch_pipeline``: the lock release (an int32 count per cache slot, freed),
    then its cache locations recomputed over all N indices at once, whatever the
    prefetch passes: 32.18 N (:data:`CACHE_RELOOKUP_BYTES_PER_INDEX`)."""
    return max(int(math.ceil(CACHE_RELOOKUP_BYTES_PER_INDEX * num_indices)), LOCATION_BYTES * cache_slots)


def backward_scratch_bytes(num_indices: float, cached_without_prefetch: bool) -> int:
    """TBE backward temporaries of one TBE: 40 B/index; a cached TBE without the
    prefetch pipeline's unique cache locations also sorts its cache locations
    (``embedding_backward_split_template.cu``) while the run tensors are alive:
    +12.18 B/index (int32 sorted locations + CUB sort temp; measured, fbgemm 1.6)."""
    extra = BACKWARD_CACHED_EXTRA_BYTES_PER_INDEX if cached_without_prefetch else 0.0
    return int(math.ceil((BACKWARD_BYTES_PER_INDEX + extra) * num_indices))
