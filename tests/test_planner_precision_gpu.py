"""GPU validation of the planner's precision terms: estimate vs measured peak memory
for fp16 tables, bf16 comms and both, beside fp32, on 1 and 2 GPUs.

The tables of ``tests/test_planner_gpu.py`` (8 x 500k rows x 64, 16384 samples per
rank, 32 ids per sample and feature). Each world size is one ``launch_local`` job
(NCCL); every rank builds each configuration's sharded model, runs warm-up steps
with recpipe's pipeline, resets the peak statistics, runs measured steps and
records ``max_memory_allocated`` / ``max_memory_reserved``; the test compares them
with the plan's ``hbm_allocated_bytes`` / ``hbm_reserved_bytes`` of that rank
(10 %) and prints the table, also written to
``$RECPIPE_REPORT_DIR/planner_precision_gpu_w{W}.{md,json}``.

    RECPIPE_REPORT_DIR=$OUT python -m pytest -m gpu -s tests/test_planner_precision_gpu.py
"""

from __future__ import annotations

import copy
import gc
import json
from pathlib import Path

import pytest
import torch

from gpu_report import emit

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOLERANCE = 0.10
WARMUP_STEPS, MEASURED_STEPS, DISTINCT_BATCHES = 4, 4, 3

_TABLES = {"model.num_embeddings_per_feature": [500_000] * 8, "model.embedding_dim": 64,
           "model.dense_arch_layer_sizes": [256, 64], "model.over_arch_layer_sizes": [256, 64, 1],
           "data.batch_size": 16384, "data.synthetic.mean_pooling_factors": 32.0, "data.num_workers": 0,
           "sharding.uvm_host_mapped": True, "train.device": "cuda"}
_FP16 = {"sharding.default": {"weights_precision": "fp16"}}
_BF16_COMMS = {"sharding.comm_precision": {"forward": "bf16", "backward": "bf16"}}
CONFIGS: dict[str, dict] = {
    "fp32": {"pipeline": {"name": "sparse_dist"}},
    "fp16_tables": {"pipeline": {"name": "sparse_dist"}, **_FP16},
    "fp16_tables_cached": {"pipeline": {"name": "sparse_dist"}, "sharding.default": {
        "kernel": "fused_uvm_caching", "cache_load_factor": 0.2, "weights_precision": "fp16"}},
    "bf16_comms": {"pipeline": {"name": "sparse_dist"}, **_BF16_COMMS},
    "fp16_tables_bf16_comms": {"pipeline": {"name": "sparse_dist"}, **_FP16, **_BF16_COMMS},
    "fp16_tables_bf16_comms_fused_sparse_dist": {"pipeline": {"name": "fused_sparse_dist"}, **_FP16, **_BF16_COMMS},
}


def _config(name: str, world_size: int):
    from recpipe.config import load_config

    return load_config(None, copy.deepcopy({**_TABLES, **CONFIGS[name], "distributed.nproc": world_size}))


def _measure(cfg, device: torch.device, rank: int) -> dict:
    from recpipe.data.synthetic import SyntheticClickLog
    from recpipe.data.spec import DataSpec
    from recpipe.models import build_model
    from recpipe.builder import make_pipeline
    from recpipe.sharding import shard_model

    log = SyntheticClickLog(DataSpec.from_config(cfg))
    batches = [log.batch(rank=rank, split="train", epoch=0, index=i).pin_memory() for i in range(DISTINCT_BATCHES)]
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    # The static figure is what the build allocates: above what is already allocated, which for
    # every configuration after the first includes about 60 MiB that the first one's steps
    # allocated once for the process (2 x H200, measured). The peaks stay absolute: a run of
    # its own allocates those bytes during its first steps too.
    before = torch.cuda.memory_allocated(device)
    torch.manual_seed(cfg.train.seed)
    sharded = shard_model(build_model(cfg.model), cfg, device)
    torch.cuda.synchronize()
    static = torch.cuda.memory_allocated(device) - before
    pipeline = make_pipeline(cfg, sharded.model, sharded.optimizer, device)
    steps = (batches[i % DISTINCT_BATCHES] for i in range(10**6))
    for _ in range(WARMUP_STEPS):
        pipeline.progress(steps)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(MEASURED_STEPS):
        pipeline.progress(steps)
    torch.cuda.synchronize()
    out = {"static": static, "allocated": torch.cuda.max_memory_allocated(device),
           "reserved": torch.cuda.max_memory_reserved(device)}
    del pipeline, sharded, steps
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return out


def _worker(cfg, out_dir: str) -> None:
    """One rank: every configuration in turn; writes rank{r}.json."""
    import torch.distributed as dist

    from recpipe.distributed import init_process_group

    device = init_process_group(cfg)
    rank = dist.get_rank()
    results = {}
    for name in CONFIGS:
        results[name] = _measure(_config(name, dist.get_world_size()), device, rank)
        dist.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def _err(est: float, meas: float) -> float:
    return (est - meas) / meas


@pytest.mark.parametrize("world_size", [1, 2])
def test_precision_estimates_match_measured(world_size, tmp_path):
    from recpipe.launcher import launch_local
    from recpipe.planner import plan_from_config

    launch_local(_worker, world_size, _config("fp32", world_size), str(tmp_path))
    total = torch.cuda.get_device_properties(0).total_memory
    rows = []
    for rank in range(world_size):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name in CONFIGS:
            plan = plan_from_config(_config(name, world_size), world_size=world_size, hbm_capacity_bytes=total)
            est, meas = plan.ranks[rank], measured[name]
            rows.append({
                "config": name, "world_size": world_size, "rank": rank,
                "est_allocated": est.hbm_allocated_bytes, "meas_allocated": meas["allocated"],
                "err_allocated": _err(est.hbm_allocated_bytes, meas["allocated"]),
                "est_reserved": est.hbm_reserved_bytes, "meas_reserved": meas["reserved"],
                "err_reserved": _err(est.hbm_reserved_bytes, meas["reserved"]),
                "est_static": sum(t.bytes for t in est.terms if t.side == "hbm" and t.category == "static"),
                "meas_static": meas["static"], "peak_phase": est.peak_phase,
                "terms": {t.name: t.bytes for t in est.terms if t.side == "hbm"},
            })
    _report(rows, world_size)
    bad = [r for r in rows if abs(r["err_allocated"]) > TOLERANCE or abs(r["err_reserved"]) > TOLERANCE]
    assert not bad, "outside 10 %: " + ", ".join(
        f"{r['config']} rank {r['rank']} alloc {r['err_allocated']:+.1%} reserved {r['err_reserved']:+.1%}" for r in bad)
    # what the precisions must show: fp16 tables hold half the fp32 tables' weights
    fp32 = next(r for r in rows if r["config"] == "fp32" and r["rank"] == 0)
    fp16 = next(r for r in rows if r["config"] == "fp16_tables" and r["rank"] == 0)
    assert fp16["meas_static"] < fp32["meas_static"] - 0.4 * fp32["terms"]["emb_weights"]


def _report(rows: list[dict], world_size: int) -> None:
    import fbgemm_gpu
    import torchrec

    gib = 2.0**30
    head = (f"torch {torch.__version__}, fbgemm_gpu {getattr(fbgemm_gpu, '__version__', '?')}, torchrec "
            f"{getattr(torchrec, '__version__', '?')}, CUDA {torch.version.cuda}, {world_size} x "
            f"{torch.cuda.get_device_name(0)}")
    cols = ("config", "rank", "est alloc GiB", "meas alloc GiB", "err", "est reserved GiB", "meas reserved GiB", "err",
            "est static GiB", "meas static GiB", "peak phase")
    lines = [f"# planner precision validation, {world_size} GPU(s)\n\n{head}\n",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["config"], str(r["rank"]), f"{r['est_allocated'] / gib:.3f}", f"{r['meas_allocated'] / gib:.3f}",
            f"{r['err_allocated']:+.1%}", f"{r['est_reserved'] / gib:.3f}", f"{r['meas_reserved'] / gib:.3f}",
            f"{r['err_reserved']:+.1%}", f"{r['est_static'] / gib:.3f}", f"{r['meas_static'] / gib:.3f}", r["peak_phase"],
        ]) + " |")
    emit(f"planner_precision_gpu_w{world_size}", "\n".join(lines) + "\n", {"versions": head, "rows": rows})
