"""``pipeline.step_graph``: the whole training step as one CUDA graph; the implementation,
its life cycle and what it refuses are in ``recpipe.speedups.step_graph``."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from recpipe.capabilities import ONE_BATCH_PER_STEP
from recpipe.sections import SwitchSection
from recpipe.speedups.definition import SpeedupDef

__all__ = ["FEATURE", "StepGraphOptions", "check"]


class StepGraphOptions(SwitchSection):
    """``pipeline.step_graph``: capture the whole training step as one CUDA graph (CUDA
    only; pipelines that run one batch's whole step in one call: ``base``, ``sparse_dist``).
    ``true`` / ``false`` stand for ``{enabled: ...}``."""

    # Capture the whole step and replay it once a step (CUDA only).
    enabled: bool = False
    # Ids per batch each feature holds in the graph (feature name -> count). Features not
    # listed: measured on the first capacity_batches batches (see capacity_batches).
    capacity: dict[str, int] = Field(default_factory=dict)
    # Batches whose ids set the capacity of unlisted features: the count they all had (fixed
    # shapes: nothing is padded), else their largest count times headroom. They train eagerly,
    # unpadded. With every feature listed in capacity, batches are padded from the first.
    capacity_batches: int = Field(4, ge=1)
    # Room above the largest measured count, for features whose counts vary; a batch over
    # capacity trains eagerly (counted, and named in a warning).
    headroom: float = Field(1.25, ge=1.0)


def check(cfg: Any) -> list[str]:
    """Why ``cfg`` (a ``RecpipeConfig``) cannot run with ``pipeline.step_graph``, besides the
    pipeline's capability (the model's reasons are checked when it is applied)."""
    p = cfg.pipeline
    if not p.step_graph.enabled:
        return []
    problems = []
    key = "pipeline.step_graph"
    if p.cuda_graphs.enabled:
        problems.append(f"{key} replays the whole step, dense part included: set pipeline.cuda_graphs=false")
    cached = [n for n, t in cfg.table_sharding().items() if t.kernel == "fused_uvm_caching"]
    if cached:
        problems.append(f"{key}: UVM-cached tables {cached} move a different number of rows each step (cache "
                        "misses); use kernel 'fused' or 'fused_uvm' for them, or pipeline.step_graph=false")
    if cfg.optimizer.embedding.name == "adam":
        problems.append(f"{key}: FBGEMM's Adam reads its step count on the host each step, which a replay cannot "
                        "advance; use optimizer.embedding.name=rowwise_adagrad or sgd, or pipeline.step_graph=false")
    data_parallel = [n for n, t in cfg.table_sharding().items() if t.type == "data_parallel"]
    if data_parallel:
        problems.append(f"{key}: data_parallel tables {data_parallel} train through torchrec's DistributedDataParallel, "
                        "whose gradient hooks were made on the default stream and cannot be captured; shard them "
                        "table_wise, or pipeline.step_graph=false")
    if cfg.optimizer.dense.name == "adam":
        problems.append(f"{key}: torch's Adam computes its bias corrections on the host from its step count each "
                        "step, which a replay cannot advance; use optimizer.dense.name=adagrad or sgd, or "
                        "pipeline.step_graph=false")
    if cfg.sharding.dense_gradients == "ddp":
        problems.append(f"{key}: DDP's gradient hooks were made on the default stream and cannot be captured; use "
                        "sharding.dense_gradients=all_reduce")
    return problems


FEATURE = SpeedupDef(
    "step_graph", StepGraphOptions,
    "the whole training step as one CUDA graph, for fixed-shape (or padded) batches (recpipe/speedups/step_graph.py)",
    apply="recpipe.speedups.step_graph:apply", needs=frozenset({ONE_BATCH_PER_STEP}), needs_cuda=True, check=check,
    torchrec_note="TorchRec's pipeline runs the dense part eagerly",
)
