"""GPU validation of the memory planner: estimate vs measured peak memory.

For each configuration (kernels fused / fused_uvm / fused_uvm_caching, every
pipeline, prefetch passes 1, 2, 4, 12 with recpipe's cache insert and 1, 2, 12 with
FBGEMM's), one process (world size 1, NCCL) builds the real sharded model
(recpipe.sharding.build.shard_model: torchrec DMP over FBGEMM TBEs), runs warm-up
steps through recpipe's pipeline, resets the peak statistics and runs measured steps.
The caching allocator is set per configuration to what the plan assumes: the
config's ``train.cuda_alloc_conf`` (expandable segments unless a row says otherwise),
whatever ``PYTORCH_CUDA_ALLOC_CONF`` an earlier test of the same pytest run left. It compares:

* ``torch.cuda.max_memory_allocated`` with the plan's ``hbm_allocated_bytes``;
* ``torch.cuda.max_memory_reserved`` with the plan's ``hbm_reserved_bytes``;
* device memory in use (``mem_get_info``) with the plan's ``hbm_bytes`` (reported);
* TorchRec's own estimate (``EmbeddingStorageEstimator`` + reservations) for the
  same placement (reported).

The table is printed and written to ``$RECPIPE_REPORT_DIR/planner_gpu.{md,json}``
when that variable is set. Run: ``pytest -m gpu -s tests/test_planner_gpu.py``.
"""

from __future__ import annotations

import copy
import gc
import os
from pathlib import Path

import pytest
import torch

from gpu_report import emit, merged_rows
from recpipe.compat import torch as compat_torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU CI: every test skips cleanly
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

TOLERANCE = 0.10
WARMUP_STEPS, MEASURED_STEPS, DISTINCT_BATCHES = 4, 4, 3

_TABLES = {"model.num_embeddings_per_feature": [500_000] * 8, "model.embedding_dim": 64,
           "model.dense_arch_layer_sizes": [256, 64], "model.over_arch_layer_sizes": [256, 64, 1],
           "data.batch_size": 16384, "data.synthetic.mean_pooling_factors": 32.0, "data.num_workers": 0,
           "sharding.uvm_host_mapped": True}
_CACHED = {"sharding.default": {"kernel": "fused_uvm_caching", "cache_load_factor": 0.2}}


def _prefetch(passes: int, **pipeline) -> dict:
    return {**_CACHED, "sharding.prefetch_passes": passes,
            "sharding.prefetch_min_pass_size": 65536, "pipeline": {"name": "prefetch", **pipeline}}


# FBGEMM's own insert and PyTorch's default segments: the setting the multi-pass segments term
# (prefetch_pass_segments) was measured in
_FBGEMM_DEFAULT_SEGMENTS = {**_prefetch(12, cache_fill=False), "train.cuda_alloc_conf": None}


CONFIGS: dict[str, dict] = {
    "fused_base": {"pipeline": {"name": "base"}},
    "fused_sparse_dist_adam": {"pipeline": {"name": "sparse_dist"}, "optimizer.embedding.name": "adam"},
    "fused_fused_sparse_dist": {"pipeline": {"name": "fused_sparse_dist"}},
    "fused_semi_sync": {"pipeline": {"name": "semi_sync"}},
    "uvm_sparse_dist": {"pipeline": {"name": "sparse_dist"}, "sharding.default": {"kernel": "fused_uvm"}},
    "cached_sparse_dist": {**_CACHED, "pipeline": {"name": "sparse_dist"}},
    "cached_prefetch_p1": _prefetch(1),
    "cached_prefetch_p2": _prefetch(2),
    "cached_prefetch_p4": _prefetch(4),
    "cached_prefetch_p12": _prefetch(12),
    "cached_prefetch_fbgemm_insert_p1": _prefetch(1, cache_fill=False),
    "cached_prefetch_fbgemm_insert_p2": _prefetch(2, cache_fill=False),
    "cached_prefetch_fbgemm_insert_p12": _prefetch(12, cache_fill=False),
    "cached_prefetch_fbgemm_insert_p12_default_segments": _FBGEMM_DEFAULT_SEGMENTS,
}

REPORT: list[dict] = []
# Comma-separated config names whose measured steps are recorded as a CUDA memory
# snapshot ($RECPIPE_REPORT_DIR/snapshot_<name>.pickle, open with pytorch.org/memory_viz).
SNAPSHOT = set(filter(None, os.environ.get("RECPIPE_PLANNER_SNAPSHOT", "").split(",")))


def _config(name: str):
    from recpipe.config import load_config

    return load_config(None, copy.deepcopy({**_TABLES, **CONFIGS[name]}))


@pytest.fixture(scope="module")
def process_group():
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    _write_report()
    from recpipe.distributed import shutdown_process_group

    shutdown_process_group()


def _allocator(expandable: bool) -> None:
    """Set the caching allocator's segments for the allocations that follow (the setting
    is read when a segment is made; the caller empties the cache around a measurement)."""
    torch.cuda.memory._set_allocator_settings(f"expandable_segments:{expandable}")


LEFT_BYTES = 16 * 2**20  # what this process may hold before a measurement, its caches freed


def _nothing_left(device: torch.device) -> None:
    """The measurement is of one model in a process with nothing else on the GPU, as in
    ``recpipe train``: the tests that ran before in this pytest process (the gate runs many
    per process) must have left nothing allocated. torch.compile's frame caches of earlier
    compiled runs are dropped first (they can keep an earlier run's tensors), and the cuBLAS
    workspaces of every stream that ran a matmul (32 MiB each on sm90; the run measured
    takes its own again, and the plan counts them); anything else still allocated is a leak
    of an earlier test or of recpipe, named here rather than counted as the planner's error."""
    torch.compiler.reset()
    gc.collect()
    torch.cuda.synchronize(device)
    compat_torch.clear_cublas_workspaces()
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated(device)
    assert left <= LEFT_BYTES, (f"{left / 2**30:.3f} GiB of CUDA memory is still allocated by what ran before in this "
                                "process; the planner's estimate is of one model in a fresh process")


def _measure(cfg, name: str = "", expandable: bool = True) -> dict:
    from recpipe.data.synthetic import SyntheticClickLog
    from recpipe.data.spec import DataSpec
    from recpipe.models.dlrm import build_model
    from recpipe.builder import make_pipeline
    from recpipe.sharding.build import shard_model

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    _nothing_left(device)
    log = SyntheticClickLog(DataSpec.from_config(cfg))
    batches = [log.batch(rank=0, split="train", epoch=0, index=i).pin_memory() for i in range(DISTINCT_BATCHES)]
    torch.cuda.empty_cache()
    _allocator(expandable)
    torch.cuda.reset_peak_memory_stats()
    sharded = shard_model(build_model(cfg.model), cfg, device)
    torch.cuda.synchronize()
    static = torch.cuda.memory_allocated(device)
    pipeline = make_pipeline(cfg, sharded.model, sharded.optimizer, device)  # recpipe's own pipelines
    steps = (batches[i % DISTINCT_BATCHES] for i in range(10**6))
    for _ in range(WARMUP_STEPS):
        pipeline.progress(steps)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    snapshot = name in SNAPSHOT and os.environ.get("RECPIPE_REPORT_DIR")
    if snapshot:
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    for _ in range(MEASURED_STEPS):
        pipeline.progress(steps)
    torch.cuda.synchronize()
    if snapshot:
        torch.cuda.memory._dump_snapshot(str(Path(os.environ["RECPIPE_REPORT_DIR"]) / f"snapshot_{name}.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)
    free, total = torch.cuda.mem_get_info(device)
    out = {"static": static, "between_steps": torch.cuda.memory_allocated(device),
           "allocated": torch.cuda.max_memory_allocated(device), "reserved": torch.cuda.max_memory_reserved(device),
           "used": total - free, "total": total}
    del pipeline, sharded, steps
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return out


def _err(est: float, meas: float) -> float:
    return (est - meas) / meas if meas else float("nan")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_estimate_matches_measured(name, process_group, monkeypatch):
    from recpipe.system import ALLOC_CONF_ENV
    from recpipe.planner import plan_from_config
    from recpipe.embedding_tables import model_on_meta
    from recpipe.planner.torchrec_planner import torchrec_estimate
    from recpipe.planner.inputs import inputs_from_config

    cfg = _config(name)
    expandable = "expandable_segments:True" in os.environ.get(ALLOC_CONF_ENV, "").replace(" ", "")  # restored after
    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)  # the row's train.cuda_alloc_conf decides, as in recpipe train
    total = torch.cuda.get_device_properties(0).total_memory
    inputs = inputs_from_config(cfg, world_size=1, hbm_capacity_bytes=total)
    plan = plan_from_config(cfg, world_size=1, hbm_capacity_bytes=total)
    rank = plan.ranks[0]
    theirs = torchrec_estimate(cfg.sharding, cfg.optimizer.embedding, inputs, model_on_meta(cfg))[0]
    try:
        meas = _measure(cfg, name, inputs.expandable_segments)
    finally:
        _allocator(expandable)
    row = {
        "config": name, "pipeline": cfg.pipeline.name, "kernel": cfg.sharding.default.kernel,
        "cache_insert": inputs.pipeline.cache_insert, "cache_bookkeeping": inputs.pipeline.cache_bookkeeping_stream,
        "expandable_segments": inputs.expandable_segments,
        "passes": cfg.sharding.prefetch_passes if cfg.cache_line_locking else 0,
        "est_allocated": rank.hbm_allocated_bytes, "meas_allocated": meas["allocated"],
        "err_allocated": _err(rank.hbm_allocated_bytes, meas["allocated"]),
        "est_reserved": rank.hbm_reserved_bytes, "meas_reserved": meas["reserved"],
        "err_reserved": _err(rank.hbm_reserved_bytes, meas["reserved"]),
        "est_total": rank.hbm_bytes, "meas_used": meas["used"], "err_total": _err(rank.hbm_bytes, meas["used"]),
        "torchrec_hbm": theirs["hbm"], "torchrec_shards_hbm": theirs["shards_hbm"],
        "err_torchrec_vs_reserved": _err(theirs["hbm"], meas["reserved"]),
        "est_static": sum(t.bytes for t in rank.terms if t.side == "hbm" and t.category == "static"),
        "meas_static": meas["static"], "meas_between_steps": meas["between_steps"],
        "peak_phase": rank.peak_phase, "phases": dict(rank.phases), "terms": {t.name: t.bytes for t in rank.terms if t.side == "hbm"},
    }
    REPORT.append(row)
    print(f"\n{name}: allocated est {row['est_allocated'] / 2**30:.3f} GiB vs {row['meas_allocated'] / 2**30:.3f} "
          f"({row['err_allocated']:+.1%}); reserved est {row['est_reserved'] / 2**30:.3f} vs "
          f"{row['meas_reserved'] / 2**30:.3f} ({row['err_reserved']:+.1%}); torchrec {theirs['hbm'] / 2**30:.3f}")
    assert abs(row["err_allocated"]) <= TOLERANCE, row
    assert abs(row["err_reserved"]) <= TOLERANCE, row


def _write_report() -> None:
    if not REPORT:
        return
    import fbgemm_gpu
    import torchrec

    gib = 2.0**30
    head = (f"torch {torch.__version__}, fbgemm_gpu {getattr(fbgemm_gpu, '__version__', '?')}, "
            f"torchrec {getattr(torchrec, '__version__', '?')}, CUDA {torch.version.cuda}, "
            f"{torch.cuda.get_device_name(0)}")
    cols = ("config", "pipeline", "passes", "insert", "segments", "est alloc GiB", "meas alloc GiB", "err", "est reserved GiB",
            "meas reserved GiB", "err", "est total GiB", "meas used GiB", "torchrec GiB", "torchrec err vs reserved")
    with merged_rows("planner_gpu", REPORT, key=lambda r: (r["config"],)) as rows:
        lines = [f"# planner GPU validation\n\n{head}\n", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in rows:
            lines.append("| " + " | ".join([
                r["config"], r["pipeline"], str(r["passes"]), r["cache_insert"] if r["passes"] else "",
                "expandable" if r["expandable_segments"] else "default", f"{r['est_allocated'] / gib:.3f}",
                f"{r['meas_allocated'] / gib:.3f}", f"{r['err_allocated']:+.1%}", f"{r['est_reserved'] / gib:.3f}",
                f"{r['meas_reserved'] / gib:.3f}", f"{r['err_reserved']:+.1%}", f"{r['est_total'] / gib:.3f}",
                f"{r['meas_used'] / gib:.3f}", f"{r['torchrec_hbm'] / gib:.3f}", f"{r['err_torchrec_vs_reserved']:+.1%}",
            ]) + " |")
        emit("planner_gpu", "\n".join(lines) + "\n", {"versions": head, "rows": rows})
