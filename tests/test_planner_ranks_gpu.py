"""GPU validation of the memory planner on several ranks: every rank's estimate vs its
measured peak memory.

``recpipe train`` refuses a plan that does not fit on any rank, so the plan must hold
on every rank of a job, not only on one GPU (tests/test_planner_gpu.py). Here each of
1, 2 and 4 ranks (one GPU each, NCCL) builds the real sharded model with row_wise or
table_wise tables, runs warm-up steps of the ``sparse_dist`` pipeline, resets its peak
statistics and runs measured steps; the test compares each rank's
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` with that rank's
``hbm_allocated_bytes`` / ``hbm_reserved_bytes`` in ``recpipe.planner.plan_from_config``
(the plan ``recpipe train`` checks), within 10 %.

Each rank also reports its allocation after the build (the plan's static terms) and
between steps, so a miss says whether the static or the per-step part is off. With
``RECPIPE_PLANNER_SNAPSHOT=1`` and ``RECPIPE_REPORT_DIR`` set, every rank of every case
records its measured steps as a CUDA memory snapshot (``snapshot_ranks_<case>_<ranks>_rank<r>.pickle``:
``benchmarks/studies/memory_at_peak.py --snapshot`` names what is alive at the peak).
The table is written to ``$RECPIPE_REPORT_DIR/planner_ranks_gpu.{md,json}``.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch

from gpu_report import emit, merged_rows

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU CI: every test skips cleanly
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

TOLERANCE = 0.10
WARMUP_STEPS, MEASURED_STEPS, DISTINCT_BATCHES = 4, 4, 3

_MODEL = {"model.num_embeddings_per_feature": [500_000] * 8, "model.embedding_dim": 64,
          "model.dense_arch_layer_sizes": [256, 64], "model.over_arch_layer_sizes": [256, 64, 1],
          "data.batch_size": 8192, "data.synthetic.mean_pooling_factors": 8.0, "data.num_workers": 0,
          "train.device": "cuda", "pipeline": {"name": "sparse_dist"}}

CASES: dict[str, dict] = {
    "row_wise": {"sharding.default": {"type": "row_wise", "kernel": "fused"}},
    "table_wise": {"sharding.default": {"type": "table_wise", "kernel": "fused"}},
    # the Criteo-sized benchmark's settings on these tables: bf16, the dense part CUDA-graphed
    "row_wise_bf16_graphs": {"sharding.default": {"type": "row_wise", "kernel": "fused"},
                             "train.precision": "bf16", "pipeline": {"name": "sparse_dist", "cuda_graphs": True}},
}
REPORT: list[dict] = []


def _config(case: str, nproc: int):
    from recpipe.config import load_config

    return load_config(None, copy.deepcopy({**_MODEL, **CASES[case], "distributed.nproc": nproc}))


def _measure_rank(cfg, case: str, out: str) -> None:
    """One rank: build, warm up, measure; writes ``out/rank<r>.json``."""
    import gc

    import torch.distributed as dist

    from recpipe.data.synthetic import SyntheticClickLog
    from recpipe.data.spec import DataSpec
    from recpipe.distributed import init_process_group, shutdown_process_group
    from recpipe.models.dlrm import build_model
    from recpipe.builder import make_pipeline
    from recpipe.sharding.build import shard_model

    device = init_process_group(cfg)  # the config's allocator settings, before CUDA starts
    rank = dist.get_rank()
    log = SyntheticClickLog(DataSpec.from_config(cfg))
    batches = [log.batch(rank=rank, split="train", epoch=0, index=i).pin_memory() for i in range(DISTINCT_BATCHES)]
    torch.cuda.reset_peak_memory_stats(device)
    sharded = shard_model(build_model(cfg.model), cfg, device)
    torch.cuda.synchronize(device)
    static = torch.cuda.memory_allocated(device)
    pipeline = make_pipeline(cfg, sharded.model, sharded.optimizer, device)
    steps = (batches[i % DISTINCT_BATCHES] for i in range(10**6))
    for _ in range(WARMUP_STEPS):
        pipeline.progress(steps)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    snapshot = os.environ.get("RECPIPE_PLANNER_SNAPSHOT") and os.environ.get("RECPIPE_REPORT_DIR")
    if snapshot:
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    for _ in range(MEASURED_STEPS):
        pipeline.progress(steps)
    torch.cuda.synchronize(device)
    if snapshot:
        folder = Path(os.environ["RECPIPE_REPORT_DIR"])
        folder.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(folder / f"snapshot_ranks_{case}_{dist.get_world_size()}_rank{rank}.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)
    measured = {"static": static, "between_steps": torch.cuda.memory_allocated(device),
                "allocated": torch.cuda.max_memory_allocated(device),
                "reserved": torch.cuda.max_memory_reserved(device),
                "total": torch.cuda.get_device_properties(device).total_memory}
    Path(out, f"rank{rank}.json").write_text(json.dumps(measured))
    del pipeline, sharded, steps
    gc.collect()
    shutdown_process_group()


def _err(est: float, meas: float) -> float:
    return (est - meas) / meas


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_every_ranks_estimate_matches_its_measured_peak(nproc, case, tmp_path):
    from recpipe.launcher import launch_local
    from recpipe.planner import plan_from_config

    cfg = _config(case, nproc)
    launch_local(_measure_rank, nproc, cfg, case, str(tmp_path))
    measured = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    plan = plan_from_config(cfg, world_size=nproc, hbm_capacity_bytes=measured[0]["total"])
    rows = []
    for r, (rank, meas) in enumerate(zip(plan.ranks, measured)):
        static = sum(t.bytes for t in rank.terms if t.side == "hbm" and t.category == "static")
        rows.append({
            "case": case, "ranks": nproc, "rank": r,
            "est_static": static, "meas_static": meas["static"], "meas_between_steps": meas["between_steps"],
            "est_allocated": rank.hbm_allocated_bytes, "meas_allocated": meas["allocated"],
            "err_allocated": _err(rank.hbm_allocated_bytes, meas["allocated"]),
            "est_reserved": rank.hbm_reserved_bytes, "meas_reserved": meas["reserved"],
            "err_reserved": _err(rank.hbm_reserved_bytes, meas["reserved"]),
            "peak_phase": rank.peak_phase,
            "terms": {t.name: t.bytes for t in rank.terms if t.side == "hbm"},
        })
    REPORT.extend(rows)
    _write_report()
    gib = 2.0**30
    for row in rows:
        print(f"\n{case} x{nproc} rank {row['rank']}: static est {row['est_static'] / gib:.3f} vs "
              f"{row['meas_static'] / gib:.3f} GiB; allocated est {row['est_allocated'] / gib:.3f} vs "
              f"{row['meas_allocated'] / gib:.3f} ({row['err_allocated']:+.1%}); reserved est "
              f"{row['est_reserved'] / gib:.3f} vs {row['meas_reserved'] / gib:.3f} ({row['err_reserved']:+.1%})")
    bad = [row for row in rows if abs(row["err_allocated"]) > TOLERANCE or abs(row["err_reserved"]) > TOLERANCE]
    assert not bad, [(row["rank"], f"{row['err_allocated']:+.1%}", f"{row['err_reserved']:+.1%}") for row in bad]


def _write_report() -> None:
    import fbgemm_gpu
    import torchrec

    gib = 2.0**30
    head = (f"torch {torch.__version__}, fbgemm_gpu {getattr(fbgemm_gpu, '__version__', '?')}, "
            f"torchrec {getattr(torchrec, '__version__', '?')}, CUDA {torch.version.cuda}, "
            f"{torch.cuda.get_device_name(0)}")
    cols = ("case", "ranks", "rank", "est static GiB", "meas static GiB", "meas between steps GiB",
            "est alloc GiB", "meas alloc GiB", "err", "est reserved GiB", "meas reserved GiB", "err")
    with merged_rows("planner_ranks_gpu", REPORT, key=lambda r: (r["case"], r["ranks"], r["rank"])) as rows:
        lines = [f"# planner on several ranks\n\n{head}\n", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in rows:
            lines.append("| " + " | ".join([
                r["case"], str(r["ranks"]), str(r["rank"]), f"{r['est_static'] / gib:.3f}", f"{r['meas_static'] / gib:.3f}",
                f"{r['meas_between_steps'] / gib:.3f}", f"{r['est_allocated'] / gib:.3f}", f"{r['meas_allocated'] / gib:.3f}",
                f"{r['err_allocated']:+.1%}", f"{r['est_reserved'] / gib:.3f}", f"{r['meas_reserved'] / gib:.3f}",
                f"{r['err_reserved']:+.1%}",
            ]) + " |")
        emit("planner_ranks_gpu", "\n".join(lines) + "\n", {"versions": head, "rows": rows})
