"""The planner's inputs of a config: :func:`inputs_from_config` builds the
:class:`~recpipe.planner.spec.PlannerInputs` of a :class:`~recpipe.config.RecpipeConfig`
(a ``model.factory`` model built on meta, the built-in one read off its config; its tables
checked against the config), with the machine facts it needs (FBGEMM's version, the GPU's
memory, the allocator's segments). For the built-in model nothing here loads torchrec or
FBGEMM.
"""

from __future__ import annotations

import os
from importlib import metadata
from typing import TYPE_CHECKING

from recpipe.embedding_tables import model_on_meta
from recpipe.planner.model_spec import (builtin_dense_spec, builtin_tables, data_ids_per_sample, dense_spec,
                                        model_notes, pooling_factors, table_specs)
from recpipe.planner.spec import GiB, PlannerInputs, ShardSpec, pipeline_spec, shards_for_tables
from recpipe.system import ALLOC_CONF_ENV, may_have_gpu
from recpipe.table_sharding.checks import check_tables, validated_tables
from recpipe.table_sharding.placement import table_wise_ranks

if TYPE_CHECKING:
    from recpipe.config import RecpipeConfig

DEFAULT_HBM_GB_WITHOUT_GPU = 80.0

__all__ = ["DEFAULT_HBM_GB_WITHOUT_GPU", "default_hbm_bytes", "expandable_segments", "fbgemm_version",
           "inputs_from_config"]


# fbgemm-gpu's distributions (its version is read from their metadata: nothing imported).
FBGEMM_DISTRIBUTIONS = ("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-nightly", "fbgemm-gpu-genai")


def fbgemm_version() -> tuple[int, int]:
    """(major, minor) of the installed fbgemm_gpu (1.8 when none is found)."""
    version = "1.8.0"
    for name in FBGEMM_DISTRIBUTIONS:
        try:
            version = metadata.version(name)
            break
        except metadata.PackageNotFoundError:
            continue
    parts = version.split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def default_hbm_bytes() -> int:
    """The GPU's own memory, or 80 GiB when planning without one (then without importing torch)."""
    if not may_have_gpu():
        return int(DEFAULT_HBM_GB_WITHOUT_GPU * GiB)
    import torch  # here: `recpipe plan` on a machine without a GPU imports no torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return int(DEFAULT_HBM_GB_WITHOUT_GPU * GiB)


def expandable_segments(cuda_alloc_conf: str | None) -> bool:
    """Whether the run's CUDA caching allocator uses expandable segments, with the
    settings recpipe gives its processes (``recpipe.distributed.apply_cuda_alloc_conf``:
    ``PYTORCH_CUDA_ALLOC_CONF`` when it is set, else ``train.cuda_alloc_conf``)."""
    settings = os.environ[ALLOC_CONF_ENV] if ALLOC_CONF_ENV in os.environ else cuda_alloc_conf
    pairs = dict(part.split(":", 1) for part in (settings or "").split(",") if ":" in part)
    return {k.strip(): v.strip() for k, v in pairs.items()}.get("expandable_segments", "").lower() == "true"


def inputs_from_config(
    cfg: "RecpipeConfig",
    *,
    world_size: int | None = None,
    hbm_capacity_bytes: int | None = None,
    fbgemm: tuple[int, int] | None = None,
    shards: tuple[ShardSpec, ...] | None = None,
) -> PlannerInputs:
    """The :class:`PlannerInputs` of a config (world size = ``distributed.nproc``): a
    ``model.factory`` model is built on meta (``recpipe.models.make_model``), the built-in
    one read off its config, and its tables checked against the config (``ConfigError``)."""

    W = world_size or cfg.distributed.nproc
    m = cfg.model
    if m.factory is None:
        infos = check_tables(cfg.sharding, cfg.distributed.nproc, builtin_tables(m))
        dense = builtin_dense_spec(m, cfg.train.precision)
    else:
        model = model_on_meta(cfg)
        infos = validated_tables(cfg, model)
        dense = dense_spec(m, cfg.train.precision, model, infos)
    pfs, assumed = pooling_factors(infos, cfg.sharding.mean_pooling_factors, data_ids_per_sample(cfg.data, m))
    tables_t = table_specs(cfg.sharding, infos, pfs, W)
    tw = table_wise_ranks(cfg.sharding, W, infos)
    if shards is None:
        shards = shards_for_tables(tables_t, W, tw)
    if hbm_capacity_bytes is None:
        hbm_capacity_bytes = cfg.sharding.hbm_bytes or default_hbm_bytes()
    pipe = pipeline_spec(cfg.pipeline)
    return PlannerInputs(
        tables=tables_t,
        shards=tuple(shards),
        world_size=W,
        batch_size=cfg.data.batch_size,
        num_dense_features=m.num_dense_features,
        dense=dense,
        embedding_optimizer=cfg.optimizer.embedding.name,
        dense_optimizer=cfg.optimizer.dense.name,
        pipeline=pipe,
        hbm_capacity_bytes=int(hbm_capacity_bytes),
        prefetch_pipeline=cfg.cache_line_locking,
        prefetch_passes=cfg.sharding.prefetch_passes,
        prefetch_min_pass_size=cfg.sharding.prefetch_min_pass_size,
        uvm_host_mapped=cfg.sharding.uvm_host_mapped,
        fbgemm_version=fbgemm or fbgemm_version(),
        tw_ranks=tuple(sorted(tw.items())),
        dense_batch=m.factory is None,
        notes=model_notes(m, assumed),
        comm_precision=(cfg.sharding.comm_precision.forward, cfg.sharding.comm_precision.backward),
        expandable_segments=expandable_segments(cfg.train.cuda_alloc_conf),
    )
