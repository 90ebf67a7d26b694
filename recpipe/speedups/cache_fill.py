"""``pipeline.cache_fill`` (the ``prefetch`` pipeline): FBGEMM's UVM-cache insert, with
the rows moved by a kernel that keeps to a few SMs.

FBGEMM's ``lru_cache_populate`` (fbgemm-gpu 1.6, 1.8) finds the rows of a batch that
are not in the HBM cache, picks an LRU slot for each (with cache-line locking, never a
slot a batch in flight holds), and in ``lru_cache_insert_kernel`` writes each evicted
row back to host memory and reads the new one in: one warp per cache set, one
512-byte PCIe round trip after another, on ``#SMs / 8`` blocks of 1024 threads. Where
most lookups miss, that kernel runs for a large share of the step and holds its SMs all
the while, and the compute stream's GEMMs beside it run slower; this module's insert
keeps to 4 SMs, and the step is shorter at the prefetch bench's high-miss point
(benchmarks/results/h100x1/prefetch_32k_cache_fill.md; docs/pipelines.md).

Here the same insert is three kernels and a sort, all on the prefetch stream, in the
order FBGEMM's populate runs (so FBGEMM's own fences and its ``lxu_cache_lookup``
right after it see the same cache):

1. find (64 unique indices a program): a row already cached gets this step's
   LRU stamp and, once per stamp, a lock; the others are the misses, keyed by set;
2. a stable sort of the misses by set (FBGEMM's radix sort: ids ascending in a set);
3. insert (one program per set with misses): the k-th miss of a set takes the k-th
   eligible slot in ascending LRU time among the first min(misses, 32), skipping
   locked slots and slots stamped this step, exactly as FBGEMM's kernel (ties between
   equal LRU times go to the lower way); a miss without one is a conflict miss, which
   the lookup then reads from host memory, as with FBGEMM;
4. move (``pipeline.cache_fill.sms`` persistent programs): for every taken slot, the evicted
   row to host memory and the new row into the cache, a tile of rows in flight at
   once per program, so a few SMs keep PCIe busy.

The numbers are FBGEMM's: the cache holds exact copies of host rows (the same dtype on
both sides; other TBEs keep FBGEMM's op), so the TBE reads the same values either way
(GPU test: the prefetch pipeline trains bit-identically to the same model in HBM).
:func:`insert_reference` is the same insert in plain torch, one step at a time; the CPU
tests hold it to a line-by-line port of FBGEMM's kernels, and run the Triton kernels
against it in Triton's interpreter; the GPU tests run them on FBGEMM's real TBEs.

Applied from outside (:func:`apply_cache_fill`) to the prefetch step of a pipeline that
has one (``recpipe.capabilities.PREFETCH_STEP``) only (:func:`routing` swaps ``torch.ops.fbgemm.lru_cache_populate`` for the length
of the step): TorchRec's pipelines and FBGEMM's inline prefetch (an eval forward) keep
FBGEMM's op. ``pipeline.cache_fill: false`` keeps FBGEMM's insert everywhere.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from recpipe.compat import torch as compat_torch
from recpipe.errors import job_warning
from recpipe.runtime.sharded import cached_tbes
from recpipe.speedups.defs.cache_fill import CacheFillOptions

try:  # Triton ships with torch's CUDA builds (recpipe's CPU stack installs it for the interpreter tests)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - a stack without Triton
    triton = None
    tl = None

ASSOC = 32  # FBGEMM's cache associativity (DEFAULT_ASSOC, one warp per set)
_INT64_MIN = torch.iinfo(torch.int64).min


def available() -> str:
    """'' when the Triton kernels can run, else why not."""
    return "" if triton is not None else "Triton is not installed (it ships with torch's CUDA builds)"


# ------------------------------------------------------------ the reference, in torch
def _srl(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> n) & ((1 << (64 - n)) - 1)


_M1 = 0xFF51AFD7ED558CCD - (1 << 64)  # MurmurHash3 fmix64 constants as int64 bit patterns
_M2 = 0xC4CEB9FE1A85EC53 - (1 << 64)


def cache_set(idx: torch.Tensor, sets: int) -> torch.Tensor:
    """FBGEMM's ``cache_slot(idx, C)`` (split_embeddings_cache/common.cuh): the
    MurmurHash3 64-bit finalizer of the linear index, as uint64, modulo the number of
    sets. int64 multiplication wraps like uint64's; the modulo of the unsigned value is
    taken in two 32-bit halves."""
    h = idx ^ _srl(idx, 33)
    h = h * _M1
    h = h ^ _srl(h, 33)
    h = h * _M2
    h = h ^ _srl(h, 33)
    hi, lo = _srl(h, 32), h & 0xFFFFFFFF
    return ((hi % sets) * ((1 << 32) % sets) + lo) % sets


@dataclass
class Insert:
    """One populate call's misses in set order: ``ids`` (linear indices; garbage where
    ``slot`` < 0), the cache ``slot`` each took (-1: a conflict miss, or no miss) and
    the linear index it evicted (``old``, -1: none)."""

    ids: torch.Tensor
    slot: torch.Tensor
    old: torch.Tensor


@dataclass
class Cache:
    """The tensors of one FBGEMM TBE that a populate call reads and writes (``.data``:
    written as FBGEMM's ops write them, without an autograd version bump; the TBE's
    autograd function saved the cache rows of the batch in flight, and no slot of that
    batch is written)."""

    weights: torch.Tensor  # the host rows (weights_uvm: host-mapped or managed memory)
    cumsum: torch.Tensor  # cache_hash_size_cumsum [T + 1]
    total: int  # total_cache_hash_size: the linear index of padding / uncached ids
    table_map: torch.Tensor  # cache_index_table_map [total]: linear index -> feature
    offsets: torch.Tensor  # weights_offsets [T]
    d_offsets: torch.Tensor  # D_offsets [T + 1]
    state: torch.Tensor  # lxu_cache_state [C, 32]: linear index per slot, -1 empty
    rows: torch.Tensor  # lxu_cache_weights [C * 32, D_cache]
    lru: torch.Tensor  # lxu_state [C, 32]: last stamp per slot
    lock: torch.Tensor | None  # lxu_cache_locking_counter [C, 32], with cache-line locking
    stats: torch.Tensor | None  # uvm_cache_stats (int32), with gather_cache_stats

    @staticmethod
    def of_populate_args(weights, cache_hash_size_cumsum, total_cache_hash_size, cache_index_table_map,
                         weights_offsets, D_offsets, lxu_cache_state, lxu_cache_weights, lru_state,
                         gather_cache_stats, uvm_cache_stats, lock_cache_line, lxu_cache_locking_counter) -> "Cache":
        return Cache(weights.data, cache_hash_size_cumsum, int(total_cache_hash_size), cache_index_table_map,
                     weights_offsets, D_offsets, lxu_cache_state.data, lxu_cache_weights.data, lru_state.data,
                     lxu_cache_locking_counter.data if lock_cache_line else None,
                     uvm_cache_stats.data if gather_cache_stats else None)


def _unique(linear_cache_indices: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FBGEMM's ``get_unique_indices``: sorted unique ids (padded to N), how many, and
    which positions hold a real id (not padding, not the ``total`` sentinel)."""
    uniq, length, _ = torch.ops.fbgemm.get_unique_indices(linear_cache_indices.reshape(-1).long(), total, False)
    pos = torch.arange(uniq.numel(), device=uniq.device)
    return uniq, length, (pos < length) & (uniq != total)


def insert_reference(linear_cache_indices: torch.Tensor, cache: Cache, time_stamp: int) -> Insert:
    """The cache bookkeeping of FBGEMM's populate (find + insert), in torch: updates
    ``cache.state``, ``cache.lru`` and ``cache.lock`` in place and returns what moves."""
    uniq, length, valid = _unique(linear_cache_indices, cache.total)
    n, sets = uniq.numel(), cache.state.shape[0]
    dev = uniq.device
    state, lru = cache.state.view(-1), cache.lru.view(-1)
    ids = torch.where(valid, uniq, 0)

    # find: hits get this step's stamp (and a lock once per stamp)
    home = torch.where(valid, cache_set(ids, sets), 0)
    match = cache.state[home] == ids[:, None]  # [N, 32]
    hit = valid & match.any(1)
    hit_slot = torch.where(hit, home * ASSOC + match.int().argmax(1), 0)
    if cache.lock is not None:
        fresh = hit & (lru[hit_slot] != time_stamp)
        cache.lock.view(-1).scatter_add_(0, hit_slot, fresh.int())
    stamp = torch.full_like(ids, time_stamp)
    lru.scatter_reduce_(0, hit_slot, torch.where(hit, stamp, _INT64_MIN), "amax")

    # misses, grouped by set in index order (FBGEMM's stable radix sort)
    miss = valid & ~hit
    by_set, order = torch.sort(torch.where(miss, home, sets), stable=True)
    miss_ids = ids[order]
    is_miss = by_set < sets
    pos = torch.arange(n, device=dev)
    start = torch.ones(n, dtype=torch.bool, device=dev)
    start[1:] = by_set[1:] != by_set[:-1]
    seg_start = torch.where(start, pos, 0).cummax(0).values
    last = torch.ones(n, dtype=torch.bool, device=dev)
    last[:-1] = start[1:]
    seg_end = torch.where(last, pos, n).flip(0).cummin(0).values.flip(0)
    rank_in_set = pos - seg_start
    considered = (seg_end - seg_start + 1).clamp(max=ASSOC)  # FBGEMM's min(SL, 32)

    # insert: the k-th miss of a set takes the k-th eligible slot in ascending LRU time
    row = by_set.clamp(max=sets - 1)
    cost, way = torch.sort(cache.lru[row], dim=1, stable=True)
    eligible = (torch.arange(ASSOC, device=dev) < considered[:, None]) & (cost < time_stamp)
    if cache.lock is not None:
        eligible &= cache.lock[row].gather(1, way) == 0
    inserted = is_miss & (rank_in_set < eligible.sum(1))
    pick = eligible & (eligible.long().cumsum(1) - 1 == rank_in_set[:, None])
    slot = torch.where(inserted, row * ASSOC + way.gather(1, pick.int().argmax(1, keepdim=True)).squeeze(1), -1)
    old = torch.where(inserted, state[slot.clamp(min=0)], -1)
    taken = slot[inserted]
    state[taken] = miss_ids[inserted]
    lru[taken] = time_stamp
    if cache.lock is not None:
        cache.lock.view(-1)[taken] += 1
    _count(cache, n, length, is_miss, slot)
    return Insert(miss_ids, slot, old)


def _count(cache: Cache, n: int, length: torch.Tensor, is_miss: torch.Tensor, slot: torch.Tensor) -> None:
    """FBGEMM's counters: calls, requested, unique, unique misses, conflict unique misses."""
    if cache.stats is None:
        return
    one = torch.ones((), dtype=torch.long, device=slot.device)
    counts = torch.stack([one, one * n, length.reshape(()).long(), is_miss.sum(), (is_miss & (slot < 0)).sum()])
    cache.stats[:5] += counts.to(cache.stats.dtype)


def _host_offsets(cache: Cache, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where linear indices ``ids`` live in ``cache.weights``: element offset and dim."""
    feature = cache.table_map[ids].long()
    dim = (cache.d_offsets[feature + 1] - cache.d_offsets[feature]).long()
    return cache.offsets[feature] + (ids - cache.cumsum[feature]) * dim, dim


def move_reference(cache: Cache, insert: Insert) -> None:
    """The rows of ``insert``, in torch: each evicted row back to host memory, then each
    new row into its slot (FBGEMM's insert kernel, same dtype on both sides)."""
    taken = insert.slot >= 0
    cols = torch.arange(cache.rows.shape[1], device=cache.rows.device)
    flat = cache.weights.view(-1)
    out = taken & (insert.old >= 0)
    off, dim = _host_offsets(cache, insert.old[out])
    keep = cols[None, :] < dim[:, None]
    flat[(off[:, None] + cols[None, :])[keep]] = cache.rows[insert.slot[out]][keep]
    off, dim = _host_offsets(cache, insert.ids[taken])
    keep = cols[None, :] < dim[:, None]
    slots = insert.slot[taken][:, None].expand(-1, cols.numel())
    cache.rows[slots[keep], cols[None, :].expand_as(slots)[keep]] = flat[(off[:, None] + cols[None, :])[keep]]


# ------------------------------------------------------------ the Triton kernels
if triton is not None:
    # Triton compiles a kernel again for an int argument that is 1 or a multiple of 16
    # the first time it sees one: the step stamp and the row counts change every call,
    # so such a compile (a fraction of a second) would land inside a training step (at
    # stamp 16, say). They are passed unspecialized. So is the cache's set
    # count: a cache of one set (a small cache, or a table's share on several ranks)
    # would make it the constant 1, a Python int without the tensor methods the hash uses.

    @triton.jit(do_not_specialize=["n", "time_stamp", "sets"])
    def _find_kernel(uniq_ptr, length_ptr, n, total, state_ptr, lru_ptr, lock_ptr, sets_ptr, time_stamp, sets,
                     LOCK: tl.constexpr, BLOCK: tl.constexpr):
        p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = p < n
        idx = tl.load(uniq_ptr + p, mask=inside, other=0)
        valid = inside & (p < tl.load(length_ptr)) & (idx != total)
        h = idx.to(tl.uint64)
        h = h ^ (h >> 33)
        h = h * 0xFF51AFD7ED558CCD
        h = h ^ (h >> 33)
        h = h * 0xC4CEB9FE1A85EC53
        h = h ^ (h >> 33)
        home = (h % sets.to(tl.uint64)).to(tl.int64)
        ways = tl.arange(0, 32)
        held = tl.load(state_ptr + home[:, None] * 32 + ways[None, :], mask=valid[:, None], other=-1)
        match = (held == idx[:, None]).to(tl.int32)
        hit = valid & (tl.max(match, 1) > 0)
        slot = home * 32 + tl.argmax(match, 1)
        if LOCK:
            fresh = hit & (tl.load(lru_ptr + slot, mask=hit, other=0) != time_stamp)
            tl.store(lock_ptr + slot, tl.load(lock_ptr + slot, mask=fresh, other=0) + 1, mask=fresh)
        tl.store(lru_ptr + slot, tl.full([BLOCK], 0, tl.int64) + time_stamp, mask=hit)
        tl.store(sets_ptr + p, tl.where(valid & ~hit, home, sets), mask=inside)

    @triton.jit(do_not_specialize=["n", "time_stamp", "sets"])
    def _insert_kernel(by_set_ptr, ids_ptr, n, sets, state_ptr, lru_ptr, lock_ptr, slot_ptr, old_ptr, time_stamp,
                       LOCK: tl.constexpr):
        p = tl.program_id(0)
        s = tl.load(by_set_ptr + p)
        before = tl.load(by_set_ptr + p - 1, mask=p > 0, other=-1)
        if (before != s) & (s < sets):  # the first miss of its set
            lanes = tl.arange(0, 32)
            q = p + lanes
            considered = tl.sum(((q < n) & (tl.load(by_set_ptr + q, mask=q < n, other=-1) == s)).to(tl.int32), 0)
            lru = tl.load(lru_ptr + s * 32 + lanes)
            order = tl.sort(lru * 32 + lanes)  # ascending LRU time, ties to the lower way
            cost = order >> 5
            way = order & 31
            slot = s * 32 + way
            eligible = (lanes < considered) & (cost < time_stamp)
            if LOCK:
                eligible = eligible & (tl.load(lock_ptr + slot) == 0)
            target = p + tl.cumsum(eligible.to(tl.int32), 0) - 1
            new = tl.load(ids_ptr + target, mask=eligible, other=0)
            tl.store(old_ptr + target, tl.load(state_ptr + slot), mask=eligible)
            tl.store(slot_ptr + target, slot, mask=eligible)
            tl.store(state_ptr + slot, new, mask=eligible)
            tl.store(lru_ptr + slot, tl.full([32], 0, tl.int64) + time_stamp, mask=eligible)
            if LOCK:
                tl.store(lock_ptr + slot, tl.full([32], 1, tl.int32), mask=eligible)

    @triton.jit(do_not_specialize=["n"])
    def _move_kernel(slot_ptr, new_ptr, new_dim_ptr, old_ptr, old_dim_ptr, n, weights_ptr, rows_ptr, row_width,
                     ROWS: tl.constexpr, COLS: tl.constexpr):
        cols = tl.arange(0, COLS)
        for start in range(tl.program_id(0) * ROWS, n, tl.num_programs(0) * ROWS):
            p = start + tl.arange(0, ROWS)
            inside = p < n
            slot = tl.load(slot_ptr + p, mask=inside, other=-1)
            # the new rows first: their host reads are the long wait, the eviction runs under it
            new = tl.load(new_ptr + p, mask=inside, other=0)
            keep_new = (slot >= 0)[:, None] & (cols[None, :] < tl.load(new_dim_ptr + p, mask=inside, other=0)[:, None])
            incoming = tl.load(weights_ptr + new[:, None] + cols[None, :], mask=keep_new)
            old = tl.load(old_ptr + p, mask=inside, other=0)
            keep = (cols[None, :] < tl.load(old_dim_ptr + p, mask=inside, other=0)[:, None]) & (slot >= 0)[:, None]
            outgoing = tl.load(rows_ptr + slot[:, None] * row_width + cols[None, :], mask=keep)
            tl.store(weights_ptr + old[:, None] + cols[None, :], outgoing, mask=keep)
            tl.debug_barrier()  # every slot's old row is read before its new row lands
            tl.store(rows_ptr + slot[:, None] * row_width + cols[None, :], incoming, mask=keep_new)


def insert_triton(linear_cache_indices: torch.Tensor, cache: Cache, time_stamp: int) -> Insert:
    """:func:`insert_reference` as two Triton kernels around a sort, no host sync."""
    uniq, length, _ = torch.ops.fbgemm.get_unique_indices(linear_cache_indices.reshape(-1).long(), cache.total, False)
    n, sets = uniq.numel(), cache.state.shape[0]
    lock = cache.lock if cache.lock is not None else cache.state  # unused without LOCK
    home = torch.empty_like(uniq)
    block = 64
    _find_kernel[(triton.cdiv(n, block),)](uniq, length, n, cache.total, cache.state, cache.lru, lock, home,
                                            time_stamp, sets, LOCK=cache.lock is not None, BLOCK=block)
    by_set, order = torch.sort(home, stable=True)
    ids = uniq[order]
    slot = torch.full_like(ids, -1)
    old = torch.full_like(ids, -1)
    _insert_kernel[(n,)](by_set, ids, n, sets, cache.state, cache.lru, lock, slot, old, time_stamp,
                         LOCK=cache.lock is not None)
    _count(cache, n, length, by_set < sets, slot)
    return Insert(ids, slot, old)


ROWS_PER_TILE = 64  # rows each program has in flight
WARPS = 16


def move_triton(cache: Cache, insert: Insert, sms: int) -> None:
    """:func:`move_reference` as ``sms`` persistent programs of ``WARPS`` warps, each with
    ``ROWS_PER_TILE`` rows in flight. Host offsets and dims of every row (new and evicted;
    dim 0: nothing to move) are computed first, in torch."""
    taken = insert.slot >= 0
    new_off, new_dim = _host_offsets(cache, torch.where(taken, insert.ids, 0))
    evicting = taken & (insert.old >= 0)
    old_off, old_dim = _host_offsets(cache, torch.where(evicting, insert.old, 0))
    zero = torch.zeros_like(new_dim)
    n, width = insert.slot.numel(), cache.rows.shape[1]
    _move_kernel[(max(1, sms),)](insert.slot, new_off, torch.where(taken, new_dim, zero).int(), old_off,
                                 torch.where(evicting, old_dim, zero).int(), n, cache.weights, cache.rows, width,
                                 ROWS=ROWS_PER_TILE, COLS=triton.next_power_of_2(width), num_warps=WARPS)


def populate(weights, cache_hash_size_cumsum, total_cache_hash_size, cache_index_table_map, weights_offsets,
             D_offsets, linear_cache_indices, lxu_cache_state, lxu_cache_weights, time_stamp, lru_state,
             stochastic_rounding, gather_cache_stats=False, uvm_cache_stats=None, lock_cache_line=False,
             lxu_cache_locking_counter=None, *, sms: int = 4, kernels: str = "triton") -> None:
    """``torch.ops.fbgemm.lru_cache_populate`` (same arguments, same effect on the
    cache), with the rows moved by :func:`move_triton` (``kernels="torch"``: the
    reference implementation, for CPU tests)."""
    if linear_cache_indices.numel() == 0:
        return
    ranged = compat_torch.profiler_enabled()  # a named range for the bench's cache-work accounting
    if ranged:
        scope = torch.profiler.record_function("recpipe::lru_cache_populate")
        scope.__enter__()
    try:
        _populate(weights, cache_hash_size_cumsum, total_cache_hash_size, cache_index_table_map, weights_offsets,
                  D_offsets, linear_cache_indices, lxu_cache_state, lxu_cache_weights, time_stamp, lru_state,
                  gather_cache_stats, uvm_cache_stats, lock_cache_line, lxu_cache_locking_counter, sms, kernels)
    finally:
        if ranged:
            scope.__exit__(None, None, None)


def _populate(weights, cache_hash_size_cumsum, total_cache_hash_size, cache_index_table_map, weights_offsets,
              D_offsets, linear_cache_indices, lxu_cache_state, lxu_cache_weights, time_stamp, lru_state,
              gather_cache_stats, uvm_cache_stats, lock_cache_line, lxu_cache_locking_counter, sms, kernels) -> None:
    cache = Cache.of_populate_args(weights, cache_hash_size_cumsum, total_cache_hash_size, cache_index_table_map,
                                   weights_offsets, D_offsets, lxu_cache_state, lxu_cache_weights, lru_state,
                                   gather_cache_stats, uvm_cache_stats, lock_cache_line, lxu_cache_locking_counter)
    if kernels == "triton":
        move_triton(cache, insert_triton(linear_cache_indices, cache, time_stamp), sms)
    else:
        move_reference(cache, insert_reference(linear_cache_indices, cache, time_stamp))


def unsupported(weights: torch.Tensor, lxu_cache_weights: torch.Tensor) -> str:
    """Why a TBE keeps FBGEMM's populate ('' if this one can take it)."""
    if weights.dtype != lxu_cache_weights.dtype:
        return f"its cache rows ({lxu_cache_weights.dtype}) are not in the weights' precision ({weights.dtype})"
    if weights.dtype not in (torch.float32, torch.float16):
        return f"its weights are {weights.dtype}"
    return ""


@contextlib.contextmanager
def routing(sms: int, kernels: str = "triton") -> Iterator[None]:
    """While open, ``torch.ops.fbgemm.lru_cache_populate`` runs :func:`populate`, for
    every TBE whose cache rows have the weights' dtype (others keep FBGEMM's op, with a
    warning naming why)."""
    namespace = torch.ops.fbgemm
    original = namespace.lru_cache_populate

    def route(*args: Any, **kwargs: Any) -> None:
        weights = args[0] if args else kwargs["weights"]
        rows = args[8] if len(args) > 8 else kwargs["lxu_cache_weights"]
        why = unsupported(weights, rows)
        if why:
            warnings.warn(f"pipeline.cache_fill: a TBE keeps FBGEMM's cache insert: {why}")
            return original(*args, **kwargs)
        return populate(*args, **kwargs, sms=sms, kernels=kernels)

    namespace.lru_cache_populate = route
    try:
        yield
    finally:
        namespace.lru_cache_populate = original


@dataclass(frozen=True)
class CacheFill:
    """What :func:`apply_cache_fill` installed: the prefetch step's insert on ``sms`` SMs."""

    sms: int

    def __repr__(self) -> str:
        return f"cache fill: recpipe's UVM-cache insert on {self.sms} SMs (recpipe.speedups.cache_fill)"


def apply_cache_fill(pipeline: Any, tbes: list, options: CacheFillOptions) -> CacheFill | None:
    """Route the UVM-cache insert of ``pipeline``'s prefetch step through recpipe's
    kernels on ``options.sms`` SMs (``pipeline.wrap_step``; ``pipeline``: a pipeline or its
    step context); None when FBGEMM's insert
    stays (disabled, no cached table, or no Triton: then with a warning)."""
    if not (options.enabled and tbes):
        return None
    if available():
        job_warning(f"pipeline.cache_fill falls back to FBGEMM's cache insert: {available()}; set "
                    "pipeline.cache_fill=false to silence this", stacklevel=2)
        return None
    sms = options.sms

    def with_recpipe_insert(step: Any) -> Any:
        def prefetch(ctx: Any, batch: Any) -> None:
            with routing(sms):
                step(ctx, batch)

        return prefetch

    pipeline.wrap_step("prefetch", with_recpipe_insert)
    return CacheFill(sms)


def apply(ctx: Any, options: CacheFillOptions) -> CacheFill | None:
    """The speed feature's entry point (``recpipe.speedups.defs.cache_fill``): the model's
    locked UVM caches, through the pipeline's prefetch step."""
    return apply_cache_fill(ctx, cached_tbes(ctx.model), options)
