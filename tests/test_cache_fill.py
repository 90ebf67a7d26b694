"""``pipeline.cache_fill`` (recpipe's insert) on CPU: the torch reference against a line-by-line
Python port of FBGEMM's LRU kernels (``lru_cache_find_uncached_kernel`` and
``lru_cache_insert_kernel``, fbgemm-gpu 1.6/1.8), rows included, on a hand-built
TBE-shaped module (FBGEMM's CPU TBE has no cache); the Triton kernels against the
reference in Triton's interpreter. The GPU tests run them on FBGEMM's real TBEs
(tests/test_pipelines_gpu.py)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from recpipe.speedups import cache_fill
from recpipe.speedups.cache_fill import ASSOC, Cache, cache_set, insert_reference, populate

U64 = (1 << 64) - 1


def fbgemm_cache_slot(h: int, sets: int) -> int:
    """common.cuh cache_slot, in Python integers."""
    h &= U64
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & U64
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & U64
    h ^= h >> 33
    return h % sets


def test_cache_set_is_fbgemms_hash():
    rng = random.Random(0)
    ids = [0, 1, 2, 31, (1 << 31) - 1, 1 << 31, (1 << 40) + 7, (1 << 62) + 12345] + [rng.randrange(1 << 45) for _ in range(2000)]
    for sets in (1, 7, 1000, 65536, 2_000_003):
        got = cache_set(torch.tensor(ids), sets).tolist()
        assert got == [fbgemm_cache_slot(i, sets) for i in ids], sets


class Reference:
    """FBGEMM's lru_cache_populate, one cache set at a time, moving rows like its kernel
    (evict the slot's row to host memory, then load the new row)."""

    def __init__(self, tbe: "FakeTBE") -> None:
        self.t = tbe

    def populate(self, lin: torch.Tensor, ts: int, lock: bool) -> None:
        t = self.t
        state, lru, counter, stats = t.lxu_cache_state, t.lxu_state, t.lxu_cache_locking_counter, t.uvm_cache_stats
        sets = state.shape[0]
        sentinel = int(t.total_cache_hash_size)
        uniq = sorted(set(lin.tolist()))
        stats[0] += 1
        stats[1] += lin.numel()
        stats[2] += len(uniq)
        missing = []
        for idx in uniq:
            if idx == sentinel:
                continue
            s = fbgemm_cache_slot(idx, sets)
            ways = [w for w in range(ASSOC) if int(state[s, w]) == idx]
            if ways:
                w = ways[0]
                already = int(lru[s, w]) == ts
                lru[s, w] = ts
                if lock and not already:
                    counter[s, w] += 1
            else:
                missing.append((s, idx))
        stats[3] += len(missing)
        missing.sort(key=lambda p: p[0])  # stable: ids ascending within a set
        by_set: dict[int, list[int]] = {}
        for s, idx in missing:
            by_set.setdefault(s, []).append(idx)
        for s, ids in by_set.items():
            costs = [(int(lru[s, w]), w) for w in range(ASSOC)]
            order = sorted(range(ASSOC), key=lambda w: costs[w][0])  # stable: ties by way
            inserted = 0
            for l in range(min(len(ids), ASSOC)):
                w = order[l]
                if lock and int(counter[s, w]) > 0:
                    continue
                if costs[w][0] == ts:
                    break
                idx = ids[inserted]
                old = int(state[s, w])
                if old != -1:
                    t.host_row(old).copy_(t.lxu_cache_weights[s * ASSOC + w, : t.dim_of(old)])
                d = t.dim_of(idx)
                t.lxu_cache_weights[s * ASSOC + w, :d] = t.host_row(idx)
                state[s, w] = idx
                lru[s, w] = ts
                if lock:
                    counter[s, w] += 1
                inserted += 1
            stats[4] += len(ids) - inserted


class FakeTBE(nn.Module):
    """The attributes of an FBGEMM TBE that cache_fill reads, with two cached tables of
    different dims and one table outside the cache in between (host rows of all three
    in ``weights_uvm``, as FBGEMM lays them out)."""

    def __init__(self, sets: int = 6, rows=(300, 200), dims=(8, 4), seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.rows, self.dims = rows, dims
        uncached_rows, uncached_dim = 50, 8
        # features: 0 -> table 0 (cached), 1 -> uncached table, 2 -> table 1 (cached)
        sizes = [rows[0] * dims[0], uncached_rows * uncached_dim, rows[1] * dims[1]]
        self.offsets = [0, sizes[0], sizes[0] + sizes[1]]
        self.register_buffer("weights_uvm", torch.randn(sum(sizes), generator=g))
        self.register_buffer("weights_offsets", torch.tensor(self.offsets))
        self.register_buffer("D_offsets", torch.tensor([0, dims[0], dims[0] + uncached_dim, dims[0] + uncached_dim + dims[1]]))
        self.register_buffer("cache_hash_size_cumsum", torch.tensor([0, -1, rows[0], rows[0] + rows[1]]))
        self.register_buffer("total_cache_hash_size", torch.tensor(rows[0] + rows[1]))
        self.register_buffer("cache_index_table_map", torch.tensor([0] * rows[0] + [2] * rows[1], dtype=torch.int32))
        self.register_buffer("lxu_cache_state", torch.full((sets, ASSOC), -1, dtype=torch.int64))
        self.register_buffer("lxu_state", torch.zeros(sets, ASSOC, dtype=torch.int64))
        self.register_buffer("lxu_cache_weights", torch.zeros(sets * ASSOC, max(dims)))
        self.register_buffer("lxu_cache_locking_counter", torch.zeros(sets, ASSOC, dtype=torch.int32))
        self.register_buffer("uvm_cache_stats", torch.zeros(6, dtype=torch.int32))

    def dim_of(self, idx: int) -> int:
        return self.dims[0] if idx < self.rows[0] else self.dims[1]

    def host_row(self, idx: int) -> torch.Tensor:
        if idx < self.rows[0]:
            return self.weights_uvm[idx * self.dims[0]: (idx + 1) * self.dims[0]]
        base = self.offsets[2] + (idx - self.rows[0]) * self.dims[1]
        return self.weights_uvm[base: base + self.dims[1]]

    def forward(self, x):
        return x

    def args(self, lin: torch.Tensor, ts: int, lock: bool) -> tuple:
        """lru_cache_populate's positional arguments, as FBGEMM's _prefetch passes them."""
        return (self.weights_uvm, self.cache_hash_size_cumsum, int(self.total_cache_hash_size),
                self.cache_index_table_map, self.weights_offsets, self.D_offsets, lin, self.lxu_cache_state,
                self.lxu_cache_weights, ts, self.lxu_state, False, True, self.uvm_cache_stats, lock,
                self.lxu_cache_locking_counter)


def _batches(total: int, steps: int, n: int, seed: int) -> list[torch.Tensor]:
    """Skewed ids (hot rows repeat across steps) with duplicates and the sentinel."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        hot = torch.randint(0, 40, (n // 2,), generator=g)
        cold = torch.randint(0, total, (n - n // 2,), generator=g)
        lin = torch.cat([hot, cold])
        lin[::17] = total  # padding / pruned ids (linearize gives them the sentinel)
        out.append(lin[torch.randperm(n, generator=g)])
    return out


def _same_state(a: FakeTBE, b: FakeTBE, where: str) -> None:
    for name in ("lxu_cache_state", "lxu_state", "lxu_cache_locking_counter", "uvm_cache_stats", "weights_uvm"):
        assert torch.equal(getattr(a, name), getattr(b, name)), f"{where}: {name} differs"
    live = (a.lxu_cache_state.view(-1) >= 0).nonzero().view(-1).tolist()
    for slot in live:  # cache rows past a table's dim are padding nobody reads
        d = a.dim_of(int(a.lxu_cache_state.view(-1)[slot]))
        assert torch.equal(a.lxu_cache_weights[slot, :d], b.lxu_cache_weights[slot, :d]), f"{where}: cache row {slot}"


def _train_cache(tbe: FakeTBE, insert, lock: bool, steps: int = 12) -> None:
    """Prefetch, forward, an update of the batch's cached rows, backward (unlock), as
    the prefetch pipeline orders them: prefetch(i+1) runs while batch i holds its
    slots. ``insert(tbe, lin, ts, lock)`` is the populate under test."""
    held = None  # the slots the previous batch locked (FBGEMM's lxu_cache_locations)
    for step, lin in enumerate(_batches(int(tbe.total_cache_hash_size), steps, 400, seed=1)):
        lin = lin.to(tbe.lxu_cache_state.device)
        insert(tbe, lin, step + 2, lock)
        if held is not None:  # "backward" of the previous batch: update its cached rows, unlock them
            tbe.lxu_cache_weights[held] += 0.5 * (step + 1)
            if lock:
                tbe.lxu_cache_locking_counter.view(-1)[held] -= 1
        held = torch.isin(tbe.lxu_cache_state.view(-1), lin).nonzero().view(-1)


def _fbgemm_port(tbe: FakeTBE, lin: torch.Tensor, ts: int, lock: bool) -> None:
    Reference(tbe).populate(lin, ts, lock)


def _ours(kernels: str):
    def insert(tbe: FakeTBE, lin: torch.Tensor, ts: int, lock: bool) -> None:
        populate(*tbe.args(lin, ts, lock), kernels=kernels)
    return insert


# Cache sizes: one set (a small cache, or a table's share of one on several ranks), two, odd
# counts and the default test cache.
SETS = (1, 2, 6, 7)


@pytest.mark.parametrize("sets", SETS)
@pytest.mark.parametrize("lock", [True, False])
def test_reference_matches_fbgemms_populate(lock, sets):
    """Every step, the cache state, LRU stamps, locks, counters, cache rows and host rows
    equal the port of FBGEMM's kernels, with evictions, conflicts (locked and fully
    stamped sets) and two cached tables of different dims."""
    ours, ref = FakeTBE(sets), FakeTBE(sets)
    _train_cache(ours, _ours("torch"), lock)
    _train_cache(ref, _fbgemm_port, lock)
    _same_state(ours, ref, f"lock={lock}, sets={sets}")
    stats = ours.uvm_cache_stats.tolist()
    assert stats[3] > stats[4] > 0, f"the test needs misses and conflicts: {stats}"
    evicted = not torch.equal(ours.weights_uvm, FakeTBE().weights_uvm)
    # One locked set: its 32 ways fill with the hot ids, which every next batch hits and so keeps
    # locked: FBGEMM's port evicts nothing either (the state equality above is the check).
    assert evicted or (sets == 1 and lock), "no evicted row was written back"


def triton_matches_reference() -> None:
    """The Triton kernels (run where Triton runs them: on CUDA, or on CPU in its
    interpreter) give exactly the reference's cache and host rows, for every cache size
    of ``SETS`` (one set included: Triton makes an int argument equal to 1 a constant)."""
    for sets in SETS:
        for lock in (True, False):
            ours, ref = FakeTBE(sets), FakeTBE(sets)
            _train_cache(ours, _ours("triton"), lock)
            _train_cache(ref, _ours("torch"), lock)
            _same_state(ours, ref, f"triton, lock={lock}, sets={sets}")


def test_triton_kernels_match_the_reference_in_the_interpreter():
    if cache_fill.available():
        pytest.skip(cache_fill.available())
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent),
                                                                               str(Path(__file__).parent)])}
    run = subprocess.run([sys.executable, "-c", "import test_cache_fill; test_cache_fill.triton_matches_reference()"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def _cache(tbe: FakeTBE, lock: bool = True, stats: bool = True) -> Cache:
    return Cache.of_populate_args(tbe.weights_uvm, tbe.cache_hash_size_cumsum, tbe.total_cache_hash_size,
                                  tbe.cache_index_table_map, tbe.weights_offsets, tbe.D_offsets, tbe.lxu_cache_state,
                                  tbe.lxu_cache_weights, tbe.lxu_state, stats, tbe.uvm_cache_stats, lock,
                                  tbe.lxu_cache_locking_counter)


def test_insert_leaves_hits_and_locked_slots_alone():
    """Direct checks of the rules, independent of the port: a hit is stamped and locked
    once per stamp; a locked slot and a slot stamped this step are never taken."""
    tbe = FakeTBE(sets=1)
    state, lru, counter = tbe.lxu_cache_state, tbe.lxu_state, tbe.lxu_cache_locking_counter
    state[0, :] = torch.arange(100, 100 + ASSOC)
    lru[0, :] = torch.arange(ASSOC)  # way 0 is the least recently used
    counter[0, 0] = 1  # ... but locked
    lru[0, 1] = 9  # way 1 stamped with this step's time
    ts = 9
    assert cache_set(torch.tensor([7, 8, 105]), 1).tolist() == [0, 0, 0]
    got = insert_reference(torch.tensor([105, 105, 7, 8]), _cache(tbe), ts)
    assert int(lru[0, 5]) == ts and int(counter[0, 5]) == 1, "hit not stamped / locked once"
    # misses 7, 8 look at the first min(2, 32) ways in LRU order: way 0 (locked: skipped) and way 2
    # (way 1, stamped this step, sorts last): 7 takes way 2, 8 is a conflict miss
    assert state[0].tolist()[:3] == [100, 101, 7] and int(lru[0, 2]) == ts and int(counter[0, 2]) == 1
    assert tbe.uvm_cache_stats.tolist()[:5] == [1, 4, 3, 2, 1]
    taken = got.slot >= 0
    assert got.ids[taken].tolist() == [7] and got.slot[taken].tolist() == [2] and got.old[taken].tolist() == [102]
    # next step: 7 is a hit (stamped, locked again: a new stamp); 8 and 9 miss: way 0 still locked,
    # the next in LRU order is way 3
    got = insert_reference(torch.tensor([7, 8, 9]), _cache(tbe, stats=False), ts + 1)
    assert int(counter[0, 2]) == 2 and int(lru[0, 2]) == ts + 1
    assert int(state[0, 3]) == 8 and not (state == 9).any() and int(state[0, 0]) == 100
    assert got.old[got.slot >= 0].tolist() == [103], "the evicted row"


def test_routing_swaps_fbgemms_populate_inside_the_context_only():
    ours, mixed = FakeTBE(), FakeTBE()
    mixed.lxu_cache_weights = mixed.lxu_cache_weights.half()  # a cache in another precision keeps FBGEMM's op
    calls = []
    original = torch.ops.fbgemm.lru_cache_populate
    try:
        torch.ops.fbgemm.lru_cache_populate = lambda *a, **k: calls.append("fbgemm")
        with cache_fill.routing(sms=2, kernels="torch"):
            with pytest.warns(UserWarning, match="keeps FBGEMM's cache insert: its cache rows"):
                torch.ops.fbgemm.lru_cache_populate(*mixed.args(torch.tensor([1, 2]), 2, True))
            torch.ops.fbgemm.lru_cache_populate(*ours.args(torch.tensor([1, 2]), 2, True))
        assert calls == ["fbgemm"], "only the other-precision TBE keeps FBGEMM's op"
        assert (ours.lxu_cache_state >= 0).sum() == 2, "ours ran recpipe's insert"
        assert torch.ops.fbgemm.lru_cache_populate is not original  # the stand-in, restored below
        torch.ops.fbgemm.lru_cache_populate(*ours.args(torch.tensor([3]), 3, True))
        assert calls == ["fbgemm", "fbgemm"], "outside the context the op is FBGEMM's again"
    finally:
        torch.ops.fbgemm.lru_cache_populate = original


def test_config_names_what_cache_fill_triton_needs():
    """The section's values (the config) and its rule (recpipe.preflight): rows copied as they
    are need cache rows in the weights' precision; a pipeline without a prefetch step ignores
    a written section, with a warning."""
    from recpipe.config import ConfigError, load_config
    from recpipe.preflight import check_rules

    config = Path(__file__).parent.parent / "configs" / "bench" / "uvm_caching.yaml"
    cfg = load_config(config, ["pipeline.cache_fill=true"])
    assert cfg.pipeline.cache_fill.enabled and cfg.pipeline.cache_fill.sms == 4
    # by default a table with its cache in another precision just keeps FBGEMM's insert (a warning at run time)
    assert load_config(config, ["sharding.tables.t_cat_0.cache_precision=fp16"]).pipeline.cache_fill.enabled
    check_rules(load_config(config, ["sharding.tables.t_cat_0.cache_precision=fp16"]))
    with pytest.raises(ConfigError, match="table t_cat_0 has cache_precision='fp16' and weights_precision='fp32'"):
        check_rules(load_config(config, ["pipeline.cache_fill=true", "sharding.tables.t_cat_0.cache_precision=fp16"]))
    off = load_config(config, ["pipeline.cache_fill=false", "sharding.tables.t_cat_0.cache_precision=fp16"])
    check_rules(off)
    assert not off.pipeline.cache_fill.enabled
    with pytest.raises(ConfigError, match="cache_fill.sms"):
        load_config(config, ["pipeline.cache_fill={sms: 0}"])
    with pytest.warns(UserWarning, match="pipeline.cache_fill is ignored: pipeline.name='sparse_dist' offers no "
                                         "prefetch_step"):
        check_rules(load_config(None, ["pipeline.name=sparse_dist", "pipeline.cache_fill={sms: 8}"]))
