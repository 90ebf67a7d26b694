"""Memory planner (recpipe.planner): placement as torchrec does it, multi-pass and
pipeline terms as the formulas say, fit checks, the CLI's table and JSON, the
torchrec adapter and the knob searches. Byte-for-byte TBE checks are in
test_planner_tbe.py."""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path

import pytest
import yaml

from recpipe.cli import main
from recpipe.exit_codes import EXIT_BAD_CONFIG, EXIT_DOES_NOT_FIT
from recpipe.config import load_config
from recpipe.planner import check_fits, estimate_memory, inputs_from_config, plan_from_config
from recpipe.preflight import Machine, check_memory
from recpipe.system import ALLOC_CONF_ENV
from recpipe.planner.memory import ALLOCATOR_FRAGMENTATION, batch_bytes, local_sparse_bytes, phase_items, rank_io
from recpipe.planner.plan import TERM_DOC
from recpipe.planner.spec import shards_from_plan
from recpipe.planner.tbe import group_tbes, prefetch_pass_sizes, prefetch_scratch_bytes
import schedule_variants as variants

GiB = 1 << 30
DOCS = Path(__file__).resolve().parents[1] / "docs" / "planner.md"


def cfg_of(**kv):
    """Config from dotted overrides (``sharding__tables`` style keys use '.')."""
    return load_config(None, copy.deepcopy({k.replace("__", "."): v for k, v in kv.items()}))


def cached_cfg(pipeline="prefetch", passes=4, min_pass=1024, nproc=2, **kv):
    prefetch = pipeline == "prefetch"
    return cfg_of(**{
        "distributed.nproc": nproc, "data.batch_size": 1024, "data.synthetic.mean_pooling_factors": 8.0,
        "model.num_embeddings_per_feature": [200_000] * 4 + [5000] * 4,
        "sharding.default": {"kernel": "fused_uvm_caching", "cache_load_factor": 0.1},
        "sharding.prefetch_passes": passes if prefetch else 1,
        "sharding.prefetch_min_pass_size": min_pass, "pipeline": {"name": pipeline}, "sharding.hbm_gib": 80, **kv,
    })


def fused_cfg(pipeline, **kv):
    return cfg_of(**{"distributed.nproc": 2, "data.batch_size": 1024, "data.synthetic.mean_pooling_factors": 8.0,
                     "model.num_embeddings_per_feature": [200_000] * 4 + [5000] * 4,
                     "pipeline": {"name": pipeline}, **kv})


def pipe_cfg(pipeline, **kv):
    """Cached tables where the pipeline allows them (semi_sync refuses them)."""
    return fused_cfg(pipeline, **kv) if pipeline == "semi_sync" else cached_cfg(pipeline=pipeline, passes=2, **kv)


MIXED = {
    "distributed.nproc": 4,
    "model.num_embeddings_per_feature": [1000, 1003, 4000, 777, 5000, 3000, 2000, 100],
    "sharding.default": {"kernel": "fused_uvm_caching", "cache_load_factor": 0.1},
    "sharding.tables": {
        "t_cat_0": {"kernel": "fused_uvm_caching", "cache_load_factor": 0.3, "rank": 2},
        "t_cat_1": {"type": "row_wise", "kernel": "fused_uvm_caching", "cache_load_factor": 0.2},
        "t_cat_2": {"type": "column_wise"},
        "t_cat_4": {"kernel": "fused"},
        "t_cat_5": {"kernel": "fused_uvm"},
    },
    "sharding.prefetch_passes": 4, "pipeline": {"name": "prefetch"},
}


# ------------------------------------------------------------------ placement as torchrec does it
def test_shards_match_the_real_sharding_plan():
    from recpipe.models.dlrm import build_model
    from recpipe.sharding.build import sharding_plan

    cfg = cfg_of(**MIXED, **{"sharding.tables.t_cat_3": {"type": "data_parallel", "kernel": "dense"}})
    inputs = inputs_from_config(cfg)
    real = shards_from_plan(sharding_plan(build_model(cfg.model), cfg, 4, "cuda"), inputs.tables)
    assert sorted(inputs.shards, key=str) == sorted(real, key=str)
    assert [s.rows for s in inputs.shards if s.table == "t_cat_1"] == [251, 251, 251, 250]


def test_tbe_grouping_and_load_factor_match_torchrec():
    """Per sharding type and rank, the TBEs (tables, local rows, row-weighted load
    factor) torchrec's group_tables builds are the ones the planner predicts."""
    import torch
    from torchrec.distributed.embeddingbag import create_sharding_infos_by_sharding_device_group
    from torchrec.distributed.sharding.cw_sharding import CwPooledEmbeddingSharding
    from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
    from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
    from torchrec.distributed.types import ShardingEnv

    from recpipe.models.dlrm import build_model
    from recpipe.sharding.build import EBC_PATH, sharding_plan
    from recpipe.table_sharding.sharders import make_sharder

    cfg = cfg_of(**MIXED)
    inputs = inputs_from_config(cfg)
    model = build_model(cfg.model)
    plan = sharding_plan(model, cfg, 4, "cuda").plan[EBC_PATH]
    infos = create_sharding_infos_by_sharding_device_group(
        model.get_submodule(EBC_PATH), dict(plan), "embedding_bags.",
        make_sharder(cfg.sharding, cfg.optimizer.embedding).fused_params)
    classes = {"table_wise": TwPooledEmbeddingSharding, "row_wise": RwPooledEmbeddingSharding,
               "column_wise": CwPooledEmbeddingSharding}
    theirs, ours = {}, {}
    for (st, _), info in infos.items():
        sharding = classes[st](info, ShardingEnv(world_size=4, rank=0, pg=None), device=torch.device("meta"))
        for rank, groups in enumerate(sharding._grouped_embedding_configs_per_rank):
            theirs[(st, rank)] = [([t.name for t in g.embedding_tables], [t.local_rows for t in g.embedding_tables],
                                   g.fused_params.get("cache_load_factor")) for g in groups]
    for rank in range(4):
        for g in group_tbes(inputs, rank):
            ours.setdefault((g.sharding_type, rank), []).append(
                ([s.table for s in g.shards], [s.rows for s in g.shards], g.cache_load_factor))
    assert ours == {k: v for k, v in theirs.items() if v}


# ------------------------------------------------------------------ multi-pass prefetch
@pytest.mark.parametrize("n,passes,min_size", [(100, 1, 1), (100, 4, 1), (101, 4, 1), (100, 4, 30), (3, 12, 1),
                                                (1000, 12, 6 * 1024 * 1024), (1000, 12, 50), (999, 7, 1)])
def test_pass_sizes_equal_fbgemm_get_prefetch_passes(n, passes, min_size):
    import torch
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen as TBE
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import MultiPassPrefetchConfig

    x = torch.arange(n)
    real = [len(p[0]) for p in TBE.get_prefetch_passes(MultiPassPrefetchConfig(passes, min_size), x, x)]
    assert prefetch_pass_sizes(n, passes, min_size) == real


def test_prefetch_scratch_follows_the_formula():
    """In units of S = 8 N (planner_memory.md 2.5), plus 0.5 S of locations:
    FBGEMM >= 1.4: 7.02, 4.26, 2.88, 2.50 at 1, 2, 4, 12 passes; before: 0.5 + 5.52/M."""
    n = 12 * 1_000_000
    S = 8 * n
    new = {m: prefetch_scratch_bytes(n, m, 1, (1, 8)) / S + 0.5 for m in (1, 2, 4, 6, 12, 24)}
    assert new[1] == pytest.approx(7.02, abs=0.01)
    assert new[2] == pytest.approx(4.26, abs=0.01)
    assert new[4] == pytest.approx(2.88, abs=0.01)
    assert new[12] == pytest.approx(2.50, abs=0.01)
    assert new[24] == new[12]  # the floor: merged indices, old + new during the last cat
    old = {m: prefetch_scratch_bytes(n, m, 1, (1, 3)) / S + 0.5 for m in (1, 4, 12)}
    assert old[1] == pytest.approx(6.02, abs=0.01)
    assert old[4] == pytest.approx(0.5 + 5.52 / 4, abs=0.01)
    assert old[12] == pytest.approx(0.5 + 5.52 / 12, abs=0.01)
    assert prefetch_scratch_bytes(n, 12, n, (1, 8)) == prefetch_scratch_bytes(n, 1, 1, (1, 8))  # min size: no split


def test_plan_reports_the_passes_that_really_happen():
    small = estimate_memory(inputs_from_config(cached_cfg(passes=12, min_pass=6 * 1024 * 1024)))
    assert all(eff == 1 for p in small.prefetch for _, eff in p.passes_effective)
    assert all(p.saved_bytes == 0 for p in small.prefetch)
    assert any("only 1 pass(es) happen" in w for w in small.warnings)
    split = estimate_memory(inputs_from_config(cached_cfg(passes=4, min_pass=1024)))
    for p in split.prefetch:
        assert all(eff == 4 for _, eff in p.passes_effective)
        diff = p.scratch_bytes_one_pass - p.scratch_bytes
        assert diff > 0 and diff <= p.saved_bytes <= diff * (1 + ALLOCATOR_FRAGMENTATION) + 2


def test_multi_pass_segments_count_in_reserved_but_not_in_what_must_fit(monkeypatch):
    """With PyTorch's default segments the prefetch stream's cached segments stay near
    one pass's prefetch-stream scratch at several passes (measured: docs/planner.md,
    "Allocator and runtime"): reserved memory counts them, the fit check does not (the
    allocator releases them first). With expandable segments there are none."""
    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    default = {"train.cuda_alloc_conf": None}
    one = estimate_memory(inputs_from_config(cached_cfg(passes=1, **default)))
    inputs = inputs_from_config(cached_cfg(passes=4, **default))
    four = estimate_memory(inputs)
    assert not inputs.expandable_segments
    for r1, r4, info in zip(one.ranks, four.ranks, four.prefetch):
        assert r1.term("prefetch_pass_segments") == 0
        cached = r4.term("prefetch_pass_segments")
        relookup = rank_io(inputs, r4.rank).relookup_scratch  # after the prefetch, on its stream
        assert relookup > 0
        one_pass, passes = max(info.scratch_bytes_one_pass, relookup), max(info.scratch_bytes, relookup)
        want = int((1 + ALLOCATOR_FRAGMENTATION) * (one_pass - passes))
        assert cached == want > 0
        assert all(t.category == "cached" for t in r4.terms if t.name == "prefetch_pass_segments")
        needed = sum(t.bytes for t in r4.terms if t.side == "hbm" and t.category != "cached")
        assert r4.hbm_bytes == needed and r4.hbm_reserved_bytes == r4.hbm_allocated_bytes + cached + sum(
            t.bytes for t in r4.terms if t.side == "hbm" and t.category == "allocator")
        assert r4.hbm_bytes < r1.hbm_bytes  # passes still make a plan fit


@pytest.mark.parametrize("fill,bookkeeping", [(True, "prefetch"), (False, "main")])
def test_prefetch_scratch_is_on_the_prefetch_stream_and_named_prefetch(fill, bookkeeping):
    """The prefetch's scratch is named after the insert that runs (recpipe's needs Triton);
    batch i's cache locations recomputed after prefetch(i+1) are on the same stream, in a
    phase of their own, where the bookkeeping runs there (the prefetch pipeline's, always;
    "main": FBGEMM's backward pre-hook, a fact the planner takes as given)."""
    from recpipe.speedups.cache_fill import available

    inputs = inputs_from_config(cached_cfg(passes=2, **{"pipeline.cache_fill": fill}))
    assert inputs.pipeline.cache_bookkeeping_stream == "prefetch"
    inputs = dataclasses.replace(inputs, pipeline=dataclasses.replace(inputs.pipeline,
                                                                      cache_bookkeeping_stream=bookkeeping))
    plan = estimate_memory(inputs)
    name = "prefetch_scratch_recpipe_insert" if fill and not available() else "prefetch_scratch"
    for r in plan.ranks:
        # every phase's scratch, whichever phase is the peak
        scratch = [(n, stream, phase) for phase, items in phase_items(inputs, rank_io(inputs, r.rank)).items()
                   for n, b, stream in items if b and "scratch" in n and "sparse_backward" not in n]
        want = [(name, "prefetch", "forward_end")]
        if bookkeeping == "prefetch":
            want.append(("cache_bookkeeping_scratch", "prefetch", "cache_bookkeeping"))
        assert sorted(scratch) == sorted(want)
        assert r.term(name) + r.term("cache_bookkeeping_scratch") + r.term("reserve_prefetch_stream") > 0


def _plan_with_schedule(cfg, schedule):
    """The plan of ``cfg`` run with another schedule of its pipeline (a study's variant):
    the memory facts come from the schedule (recpipe.runtime.schedule.memory_facts)."""
    from recpipe.runtime.schedule import memory_facts
    from recpipe.planner.spec import PipelineSpec

    inputs = inputs_from_config(cfg)
    facts = {**dataclasses.asdict(inputs.pipeline), **memory_facts(schedule)}
    return estimate_memory(dataclasses.replace(inputs, pipeline=PipelineSpec(**facts)))


def test_prefetch_early_splits_hold_the_next_input_dist_through_the_backward():
    plain = plan_from_config(cached_cfg()).ranks[0]
    early = _plan_with_schedule(cached_cfg(), variants.PREFETCH_EARLY_SPLITS).ranks[0]
    assert plain.term("input_dist_sent_kjts") == 0 < early.term("input_dist_sent_kjts")
    assert early.hbm_allocated_bytes == plain.hbm_allocated_bytes + early.term("input_dist_sent_kjts")


# ------------------------------------------------------------------ pipelines
# batches in flight, received KJTs alive at the peak, side streams, sent KJTs still held
# (the counts measured on CPU by test_planner_liveness.py; semi_sync: batch i for its TBE
# backward, i+1 looked up, i+2 after its input dist)
PIPES = {
    "base": (2, 1, ("memcpy",), 0),
    "sparse_dist": (3, 2, ("memcpy", "dist"), 1),
    "fused_sparse_dist": (3, 2, ("memcpy", "dist"), 1),
    "semi_sync": (3, 3, ("memcpy", "dist"), 1),
    "prefetch": (3, 2, ("memcpy", "dist", "prefetch"), 0),
}


@pytest.mark.parametrize("name", list(PIPES))
def test_pipeline_terms(name):
    batches, kjts, streams, sent = PIPES[name]
    inputs = inputs_from_config(pipe_cfg(name))
    rank = estimate_memory(inputs).ranks[0]
    # the schedule's batches; the steps the host queues ahead add no allocated bytes (spec.PipelineSpec)
    assert rank.term("input_batches") == batches * batch_bytes(inputs)
    one_kjt = estimate_memory(dataclasses.replace(
        inputs, pipeline=dataclasses.replace(inputs.pipeline, dist_kjts_in_flight=1))).ranks[0].term("input_dist_kjts")
    assert rank.term("input_dist_kjts") == kjts * one_kjt
    assert inputs.world_size == 2 and rank.term("input_dist_sent_kjts") == sent * local_sparse_bytes(inputs)
    reserves = sorted(t.name for t in rank.terms if t.name.startswith("reserve_"))
    assert reserves == sorted(f"reserve_{s}_stream" for s in streams)
    # batch i+1's pooled embeddings: alive through backward(i) in semi_sync only; fused_sparse_dist
    # looks them up after backward(i), in a phase of their own: the TBE outputs and pooled
    # embeddings of forward_lookup, without its dense activations
    assert (rank.term("early_pooled_embeddings") > 0) == (name == "semi_sync")
    phases = dict(rank.phases)
    assert ("lookup_next" in phases) == (name == "fused_sparse_dist")
    if name == "fused_sparse_dist":
        assert phases["lookup_next"] == phases["forward_lookup"] - inputs.batch_size * inputs.dense.dense_arch_bytes > 0
    # once running, fused_sparse_dist and semi_sync run the dense backward before the TBE's
    assert ("backward_emb_after_dense" in phases) == (name in ("fused_sparse_dist", "semi_sync"))
    if "backward_emb_after_dense" in phases:
        dense = inputs.batch_size * (inputs.dense.dense_arch_bytes + inputs.dense.dense_out_grad_bytes)
        held = phases["backward_emb_after_dense"] - (phases["backward_emb"] - dense)  # semi_sync: batch i's TBE outputs
        assert held == (rank.term("early_pooled_embeddings") if name == "semi_sync" else 0)
    cached_n = sum(g.indices_per_batch for g in rank.tbe_groups if g.kernel == "cached")
    if name == "prefetch":
        assert rank.term("prefetch_cache_locations") == int(2 * 4 * cached_n)
        assert rank.term("prefetch_scratch_inline") == 0
    elif cached_n:
        assert rank.term("cache_locations") == int(4 * cached_n)
        assert rank.peak_phase == "inline_prefetch" or dict(rank.phases)["inline_prefetch"] > 0


def test_semi_sync_lookup_before_update_holds_batch_i1_only_in_the_tbe_backward():
    """emb_lookup=before_update: batch i+1's pooled embeddings are made after the dense and
    output all-to-all backward of i, so they are in the TBE-backward phase only (2 x H200,
    65536 samples, measured over sparse_dist: +0.81 GiB, against +2.53 GiB for semi_sync's
    default order; benchmarks/results/h200x2/semi_sync_memory_65536.md)."""
    default = estimate_memory(inputs_from_config(pipe_cfg("semi_sync"))).ranks[0]
    late_inputs = inputs_from_config(pipe_cfg("semi_sync", **{"pipeline.emb_lookup": "before_update"}))
    late = estimate_memory(late_inputs).ranks[0]
    assert default.term("early_pooled_embeddings") > 0  # alive through the step
    phases, late_phases = dict(default.phases), dict(late.phases)
    early = default.term("early_pooled_embeddings")
    held = default.term("semi_sync_emb_graph")
    assert late_phases["backward_emb_after_dense"] == phases["backward_emb_after_dense"] - held + early
    assert all(late_phases[p] == phases[p] for p in phases if p != "backward_emb_after_dense")
    assert late.hbm_allocated_bytes < default.hbm_allocated_bytes


def test_one_rank_all_to_alls_return_their_input():
    """torchrec's all-to-alls are no-ops at world size 1: no received KJT, no second
    copy of the pooled embeddings; the TBE's int64 offsets remain."""
    one = plan_from_config(fused_cfg("sparse_dist", **{"distributed.nproc": 1})).ranks[0]
    two = plan_from_config(fused_cfg("sparse_dist", **{"distributed.nproc": 2})).ranks[0]
    bags = 1024 * 8
    assert one.term("input_dist_kjts") == 2 * 8 * (bags + 1)
    assert two.term("input_dist_kjts") > 2 * 8 * 1024 * 8 * 8.0 * 2 // 2
    assert dict(one.phases)["forward_lookup"] < dict(two.phases)["forward_lookup"]
    assert one.term("nccl_communicators") == 0 < two.term("nccl_communicators")


def test_dcn_arch_plans():
    plan = plan_from_config(fused_cfg("base", **{"model.arch": "dcnv2"}))
    assert plan.fits and plan.ranks[0].term("dense_params") > plan_from_config(fused_cfg("base")).ranks[0].term("dense_params")


def test_pipelines_order_by_memory():
    """fused_sparse_dist peaks like sparse_dist: its first step has sparse_dist's order, and
    later its lookup of batch i+1 comes after backward(i) (measured on one H100: 24 MiB
    below sparse_dist, the dense activations and the dense output's gradient)."""
    ranks = {n: plan_from_config(fused_cfg(n)).ranks[0] for n in PIPES if n != "prefetch"}
    assert ranks["base"].hbm_allocated_bytes < ranks["sparse_dist"].hbm_allocated_bytes
    assert ranks["sparse_dist"].hbm_allocated_bytes == ranks["fused_sparse_dist"].hbm_allocated_bytes
    assert ranks["fused_sparse_dist"].hbm_allocated_bytes < ranks["semi_sync"].hbm_allocated_bytes


def test_new_lookup_stream_adds_a_pool_and_stash_adds_dense_grads():
    base = plan_from_config(fused_cfg("fused_sparse_dist")).ranks[0]
    new = _plan_with_schedule(fused_cfg("fused_sparse_dist"), variants.FUSED_LOOKUP_ON_OWN_STREAM).ranks[0]
    assert "reserve_lookup_stream" in {t.name for t in new.terms} and "reserve_lookup_stream" not in {t.name for t in base.terms}
    assert new.hbm_allocated_bytes == base.hbm_allocated_bytes
    assert new.hbm_reserved_bytes > base.hbm_reserved_bytes  # the dist pool's staging no longer reuses lookup blocks
    stash = plan_from_config(fused_cfg("semi_sync", **{"pipeline.stash_gradients": True})).ranks[0]
    assert stash.term("stashed_dense_grads") == stash.term("dense_grads") > 0


def test_pipeline_depths_match_schedules():
    schedule = pytest.importorskip("recpipe.pipelines")
    try:
        schedules = schedule.all_schedules()
    except ImportError:
        pytest.skip("pipelines not written yet")
    for name, (batches, _, _, _) in PIPES.items():
        assert schedules[name][0].depth == batches, name


# ------------------------------------------------------------------ totals, fits, messages
def test_totals_are_sums_of_terms_and_plan_is_frozen():
    plan = plan_from_config(cfg_of(**MIXED))
    for r in plan.ranks:
        assert r.hbm_bytes == sum(t.bytes for t in r.terms if t.side == "hbm")
        assert r.hbm_allocated_bytes <= r.hbm_reserved_bytes <= r.hbm_bytes
        assert {t.name for t in r.terms} <= set(TERM_DOC)
        assert r.term("nccl_communicators") > 0  # 4 ranks
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.ranks[0].rank = 3  # type: ignore[misc]


def test_does_not_fit_names_rank_capacity_and_largest_terms():
    plan = plan_from_config(cached_cfg(**{"sharding.hbm_gib": 0.25}))
    assert not plan.fits
    msg = check_fits(plan)
    assert "rank 0" in msg and "256.0 MiB" in msg
    assert plan.ranks[0].largest(1)[0].name in msg
    assert check_fits(plan_from_config(cached_cfg())) is None


@pytest.mark.parametrize("key, value, capacity", [
    ("sharding.hbm_gib", 80, 80 * 2**30),  # GiB, as torch.cuda and nvidia-smi count
    ("sharding.hbm_gb", 80, 80 * 10**9),  # GB: 74.5 GiB
    ("sharding.hbm_gib", 0.25, 2**28),
    ("sharding.hbm_gb", 0.5, 5 * 10**8),
])
def test_hbm_keys_give_the_planner_their_bytes(key, value, capacity):
    cfg = cfg_of(**{key: value})
    assert cfg.sharding.hbm_bytes == capacity
    assert inputs_from_config(cfg).hbm_capacity_bytes == capacity
    assert {r.capacity_bytes for r in plan_from_config(cfg).ranks} == {capacity}


def test_hbm_gib_and_hbm_gb_together_are_refused(tmp_path, capsys):
    assert main(["plan", "--config", _write(tmp_path, {}), "--set", "sharding.hbm_gib=80", "--set", "sharding.hbm_gb=80"]) == EXIT_BAD_CONFIG
    assert "sharding.hbm_gib=80 and sharding.hbm_gb=80 both set" in capsys.readouterr().err


def test_preflight_for_the_trainer():
    lines: list[str] = []
    gpu = Machine(cuda=True)
    assert check_memory(cached_cfg(), gpu, log=lines.append, refusal=lines.append) is None and "fits" in lines[0]
    lines.clear()
    assert check_memory(cached_cfg(**{"sharding.hbm_gib": 0.25}), gpu, log=lines.append,
                        refusal=lines.append) == EXIT_DOES_NOT_FIT
    assert "refusing to start" in lines[-1] and "rank 0" in lines[-1]
    assert check_memory(cached_cfg(**{"sharding.hbm_gib": 0.25}), Machine(cuda=False)) is None  # host memory


def test_estimate_is_fast_without_gpu():
    inputs = inputs_from_config(cfg_of(**{"distributed.nproc": 8, "sharding.default": {"type": "row_wise"}}))
    start = time.perf_counter()
    plan = estimate_memory(inputs)
    assert time.perf_counter() - start < 0.5 and len(plan.ranks) == 8


# ------------------------------------------------------------------ CLI
def _write(tmp_path, data) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_cli_table(tmp_path, capsys):
    path = _write(tmp_path, {"model": {"num_embeddings_per_feature": [100_000] * 4},
                             "data": {"batch_size": 2048, "synthetic": {"mean_pooling_factors": 4.0}},
                             "sharding": {"default": {"kernel": "fused_uvm_caching"},
                                          "prefetch_passes": 4, "prefetch_min_pass_size": 256, "hbm_gib": 40},
                             "pipeline": {"name": "prefetch"}, "distributed": {"nproc": 2}})
    assert main(["plan", "--config", path]) == 0
    out = capsys.readouterr().out
    assert "rank" in out and "40.00 GiB" in out and "fits" in out
    assert "uvm_cache_weights" in out and "multi-pass prefetch" in out and "HBM saved" in out


def test_cli_json(tmp_path, capsys):
    path = _write(tmp_path, {"sharding": {"default": {"kernel": "fused_uvm_caching"},
                                          "prefetch_passes": 2}, "pipeline": {"name": "prefetch"}})
    assert main(["plan", "--config", path, "--format", "json", "--set", "distributed.nproc=2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"ranks", "shards", "fits"} <= set(doc) and doc["fits"] is True
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    for r in doc["ranks"]:
        assert {"rank", "hbm_bytes", "ddr_bytes", "terms"} <= set(r)
        assert r["hbm_bytes"] == sum(t["bytes"] for t in r["terms"] if t["side"] == "hbm")
        scratch = [t["name"] for t in r["terms"] if "scratch" in t["name"] and t["name"] != "sparse_backward_scratch"]
        assert scratch and all("prefetch" in n for n in scratch)
    assert len(doc["shards"]) == 26 and doc["prefetch"]


def test_cli_does_not_fit_exits_3(tmp_path, capsys):
    path = _write(tmp_path, {"sharding": {"default": {"kernel": "fused_uvm_caching"}, "hbm_gib": 0.5}})
    assert main(["plan", "--config", path, "--format", "json"]) == EXIT_DOES_NOT_FIT
    captured = capsys.readouterr()
    assert json.loads(captured.out)["fits"] is False
    assert "rank 0" in captured.err and "512.0 MiB" in captured.err and "largest terms" in captured.err
    assert main(["plan", "--config", path, "--set", "sharding.hbm_gib=-1"]) == EXIT_BAD_CONFIG


@pytest.mark.parametrize("placement", ["planner", "config"])
def test_plan_and_train_print_the_same_plan(placement, tmp_path, capsys):
    """``recpipe plan`` and ``recpipe train``'s pre-flight plan with one function: the
    plan's table opens with the per-rank summary the pre-flight prints, byte for byte.
    With placement 'planner' torchrec's partitioner puts t_cat_2 and t_cat_3 on other
    ranks than the config's rules would, which moves 0.2 GiB between the ranks."""
    path = _write(tmp_path, {"model": {"num_embeddings_per_feature": [1_000_000, 900_000, 800_000, 10],
                                       "embedding_dim": 64, "dense_arch_layer_sizes": [64, 64]},
                             "data": {"batch_size": 512}, "distributed": {"nproc": 2},
                             "sharding": {"placement": placement, "hbm_gib": 80}})
    assert main(["plan", "--config", path]) == 0
    table = capsys.readouterr().out
    cfg = load_config(path)
    assert check_memory(cfg, Machine(cuda=True), world_size=cfg.distributed.nproc) is None
    preflight_summary = capsys.readouterr().out.strip()
    assert "rank" in preflight_summary and table.startswith(preflight_summary + "\n")
    by_rules = estimate_memory(inputs_from_config(cfg))
    moved = [r.hbm_allocated_bytes for r in by_rules.ranks] != [r.hbm_allocated_bytes
                                                                 for r in plan_from_config(cfg).ranks]
    assert moved == (placement == "planner")


# ------------------------------------------------------------------ torchrec adapter, searches
def test_torchrec_planner_places_shards_by_our_estimates():
    from recpipe.embedding_tables import model_on_meta
    from recpipe.planner.torchrec_planner import RecpipeStorageEstimator, plan_with_torchrec, shard_storage

    cfg = cfg_of(**MIXED)
    inputs = inputs_from_config(cfg)
    plan = plan_with_torchrec(cfg.sharding, cfg.optimizer.embedding, inputs, model_on_meta(cfg))
    shards = shards_from_plan(plan, inputs.tables)
    assert {s.table for s in shards} == {t.name for t in inputs.tables}
    placed = estimate_memory(dataclasses.replace(inputs, shards=shards))
    assert placed.fits

    class _Option:  # the ShardingOption fields the estimator reads
        name, sharding_type, compute_kernel, cache_params, input_lengths, batch_size = (
            "t_cat_0", "table_wise", "fused_uvm_caching", None, [1.0], 512)
        shards = [type("S", (), {"size": [1000, 16], "storage": None})()]

    RecpipeStorageEstimator(inputs).estimate([_Option()], {})
    hbm, ddr = shard_storage(inputs, "t_cat_0", "table_wise", "fused_uvm_caching", [1000, 16])
    assert (_Option.shards[0].storage.hbm, _Option.shards[0].storage.ddr) == (hbm, ddr) and ddr == 1000 * 16 * 4


def test_torchrec_estimate_for_comparison():
    from recpipe.embedding_tables import model_on_meta
    from recpipe.planner.torchrec_planner import torchrec_estimate

    cfg = cached_cfg(pipeline="prefetch", passes=4)
    inputs = inputs_from_config(cfg)
    theirs = torchrec_estimate(cfg.sharding, cfg.optimizer.embedding, inputs, model_on_meta(cfg))
    ours = estimate_memory(inputs)
    assert [t["rank"] for t in theirs] == [0, 1]
    for t, r in zip(theirs, ours.ranks):
        assert t["shards_ddr"] == r.ddr_bytes - r.term("pinned_host_batches")  # both count UVM weights
        assert t["hbm"] == t["shards_hbm"] + t["dense_reservation"] + t["kjt_reservation"] > 0


def test_fit_cache_load_factor_and_min_passes():
    from recpipe.planner.search import fit_cache_load_factor, min_prefetch_passes

    inputs = inputs_from_config(cached_cfg(passes=1, **{"data.batch_size": 16384}))
    plan = estimate_memory(inputs)
    budget = plan.ranks[0].hbm_bytes - 10 * (1 << 20)
    res = min_prefetch_passes(inputs, budget)
    assert res.value is not None and res.value > 1 and res.plan.ranks[0].hbm_bytes <= budget
    worse = estimate_memory(dataclasses.replace(inputs, prefetch_passes=res.value - 1))
    assert max(r.hbm_bytes for r in worse.ranks) > budget
    clf = fit_cache_load_factor(inputs, plan.ranks[0].hbm_bytes)
    assert clf.value is not None and 0.09 <= clf.value < 0.12 and clf.hint().startswith("cache_load_factor=")
    assert fit_cache_load_factor(inputs, 1).value is None


# ------------------------------------------------------------------ docs
def test_docs_name_every_term():
    text = DOCS.read_text()
    missing = [name for name in TERM_DOC if f"`{name}`" not in text]
    assert not missing, missing
    assert "## GPU validation" in text


def test_placement_planner_places_every_table_by_our_estimates(capsys):
    import json

    from recpipe.config import ConfigError, load_config

    path = str(Path(__file__).parent.parent / "configs" / "quickstart.yaml")
    assert main(["plan", "--config", path, "--format", "json", "--set", "sharding.placement=planner"]) == 0
    shards = json.loads(capsys.readouterr().out)["shards"]
    names = {f"t_cat_{i}" for i in range(26)}
    assert {s["table"] for s in shards} == names
    with pytest.raises(ConfigError, match="placement='planner' places every table"):
        load_config(path, ["sharding.placement=planner", "sharding.tables.t_cat_5={rank: 1}"])



def test_placement_planner_without_room_exits_3_in_one_line(capsys):
    """torchrec's planner finds no placement within the HBM given: one line naming the HBM and
    what would help, exit 3 (not torchrec's AttributeError on recpipe's storage reservation)."""
    path = str(Path(__file__).parent.parent / "configs" / "quickstart.yaml")
    code = main(["plan", "--config", path, "--set", "sharding.placement=planner", "--set", "sharding.hbm_gib=0.001"])
    err = capsys.readouterr().err
    assert code == EXIT_DOES_NOT_FIT, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "sharding.placement=planner: torchrec's planner found no placement" in err
    assert "0.001 GiB of HBM per GPU" in err and "insufficient storage" in err

@pytest.mark.parametrize("overrides", [[], ["model.arch=dcnv2"], ["model.arch=dcnv2", "train.precision=bf16"],
                                       ["model.num_embeddings_per_feature=[10,20,30]", "model.embedding_dim=8",
                                        "model.dense_arch_layer_sizes=[32,8]", "model.over_arch_layer_sizes=[16,1]"],
                                       ["model.arch=dcnv2", "model.num_embeddings_per_feature=[7,9]",
                                        "model.dcn_num_layers=3", "model.dcn_low_rank_dim=4"]])
def test_the_builtin_model_read_off_its_config_is_the_model_built_on_meta(overrides):
    """``recpipe plan`` reads the built-in model's tables and dense part off its config
    (no torchrec): exactly what building it on meta gives."""
    from recpipe.embedding_tables import model_on_meta, model_tables
    from recpipe.planner.model_spec import builtin_dense_spec, builtin_tables, dense_spec

    cfg = load_config(None, overrides)
    model = model_on_meta(cfg)
    tables = model_tables(model)
    assert builtin_tables(cfg.model) == tables
    assert builtin_dense_spec(cfg.model, cfg.train.precision) == dense_spec(cfg.model, cfg.train.precision, model,
                                                                            tables)


def test_the_sharding_types_stated_are_torchrecs():
    """``recpipe.table_sharding.sharders.SHARDER_TYPES`` (what the planner checks the built-in model
    against without torchrec) is what torchrec's sharders offer, on CUDA and on CPU."""
    from recpipe.table_sharding.sharders import SHARDER_TYPES, sharders_offer

    cfg = load_config(None, [])
    for device in ("cuda", "cpu"):
        assert sharders_offer(cfg.sharding, cfg.optimizer.embedding, device) == SHARDER_TYPES, device
