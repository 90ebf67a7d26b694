"""recpipe's estimates inside torchrec's planner, and torchrec's own for comparison.

* :class:`RecpipeStorageEstimator` is a torchrec ``ShardEstimator``: it sets every
  shard's ``storage`` from recpipe's formulas (the shard's static buffers plus its
  share of the per-step terms), so torchrec's partitioner places shards by our
  numbers. Its ``estimate`` accepts both torchrec 1.6 (``sharder_map``) and 1.8
  (``sharder_data_map``) call forms; it needs neither.
* :class:`RecpipeStorageReservation` reserves, on every rank, what is not a shard:
  dense model, batches in flight, phase transients, allocator pools, CUDA context
  and NCCL (the largest rank of recpipe's plan for the config's own placement).
* :func:`torchrec_planner` wires both into ``EmbeddingShardingPlanner``;
  :func:`plan_with_torchrec` returns the placed ``ShardingPlan``.
* :func:`torchrec_estimate` runs torchrec's ``EmbeddingStorageEstimator`` and
  ``HeuristicalStorageReservation`` on the same config and placement (the
  comparison column of the GPU validation).

A per-shard estimate cannot know its TBE: it assumes the shard is alone in its TBE
(cache width = its own dim) and counts its own prefetch scratch (an upper bound:
TBEs prefetch one after the other, so the rank needs only the largest).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import warnings
from typing import TYPE_CHECKING, Any, Iterator

from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.planner.types import (ParameterConstraints, PlannerError, ShardEstimator, Storage,
                                                StorageReservation, Topology)
from torchrec.distributed.types import PipelineType

from recpipe.compat.torchrec import name_reservation_share, reserved_hbm
from recpipe.errors import DoesNotFitError
from recpipe.planner.estimate import estimate_memory
from recpipe.planner.memory import LOCATION_BYTES, module_received_kjt_bytes
from recpipe.planner.spec import PipelineSpec, PlannerInputs, ShardSpec
from recpipe.planner.tbe import (
    Tbe,
    cache_relookup_bytes,
    prefetch_scratch_bytes,
    shard_bags,
    shard_indices,
    shard_output_rows,
    tbe_cache_insert,
    tbe_static,
)
from recpipe.table_sharding.cache import DEFAULT_CACHE_LOAD_FACTOR, cache_params
from recpipe.table_sharding.sharders import make_sharders

if TYPE_CHECKING:
    from torch import nn

    from recpipe.config import EmbeddingOptimizerConfig, ShardingConfig


def shard_storage(inputs: PlannerInputs, table: str, sharding_type: str, kernel: str, size: list[int],
                  cache_load_factor: float | None = None, batch_size: int | None = None,
                  pooling_factor: float | None = None) -> tuple[int, int]:
    """(hbm, ddr) bytes of one shard of ``size`` [rows, cols] as recpipe estimates it
    (``pooling_factor``: ids per sample over all of the table's features, as torchrec
    sums its input lengths)."""
    base = inputs.table(table)
    clf = cache_load_factor if cache_load_factor is not None else (base.cache_load_factor or DEFAULT_CACHE_LOAD_FACTOR)
    pf = pooling_factor / base.num_features if pooling_factor is not None else base.pooling_factor
    t = dataclasses.replace(base, pooling_factor=pf, sharding_type=sharding_type, kernel=kernel,
                            cache_load_factor=clf if kernel == "fused_uvm_caching" else None)
    s = ShardSpec(table, 0, int(size[0]), int(size[1]))
    one = dataclasses.replace(inputs, tables=(t,), shards=(s,), batch_size=batch_size or inputs.batch_size)
    tbe = Tbe(0, sharding_type, "dense" if kernel == "dense" else "fused", t.cached,
              s.cols if t.cached and inputs.prefetch_pipeline else None, (s,), (t,))
    hbm = ddr = 0
    for name, side, b, _ in tbe_static(one, tbe):
        if name == "tbe_metadata":
            continue
        hbm, ddr = (hbm + b, ddr) if side == "hbm" else (hbm, ddr + b)
    pipe = inputs.pipeline
    n, bags = shard_indices(one, s), shard_bags(one, s)
    lookup = int(one.tbe_output_bytes * shard_output_rows(one, s) * s.cols)
    copies = 1 + int(pipe.early_pooled) + int(pipe.keeps_emb_graph)
    hbm += copies * lookup
    if sharding_type != "data_parallel":
        hbm += pipe.dist_kjts_in_flight * module_received_kjt_bytes(t, n, bags, inputs.world_size)
    if t.cached:
        hbm += int((2 if pipe.prefetch else 1) * LOCATION_BYTES * n)
        passes = inputs.prefetch_passes if inputs.prefetch_pipeline else 1
        insert = tbe_cache_insert(pipe.cache_insert, tbe) if inputs.prefetch_pipeline else "fbgemm"
        scratch = prefetch_scratch_bytes(n, passes, inputs.prefetch_min_pass_size, inputs.fbgemm_version, insert)
        if inputs.prefetch_pipeline and pipe.cache_bookkeeping_stream == "prefetch":  # after it, same stream
            scratch = max(scratch, cache_relookup_bytes(n, tbe.cache_slots))
        hbm += scratch
    return hbm, ddr


class RecpipeStorageEstimator(ShardEstimator):
    """torchrec ``ShardEstimator`` with recpipe's per-shard HBM/DDR."""

    def __init__(self, inputs: PlannerInputs) -> None:
        self._inputs = inputs

    def estimate(self, sharding_options: list, *args: Any, **kwargs: Any) -> None:
        for so in sharding_options:
            clf = so.cache_params.load_factor if so.cache_params is not None else None
            pf = float(sum(so.input_lengths)) if so.input_lengths else None
            for shard in so.shards:
                hbm, ddr = shard_storage(self._inputs, so.name, so.sharding_type, so.compute_kernel, shard.size,
                                         cache_load_factor=clf, batch_size=so.batch_size, pooling_factor=pf)
                shard.storage = Storage(hbm=hbm, ddr=ddr)


def non_shard_bytes(inputs: PlannerInputs) -> tuple[int, int]:
    """(hbm, ddr) a rank needs besides its shards: the largest over ranks of the
    rank's total minus its shards' estimates (config's own placement)."""
    plan = estimate_memory(inputs)
    hbm = ddr = 0
    for r in plan.ranks:
        sh_hbm = sh_ddr = 0
        for s in plan.shards:
            if s.rank == r.rank:
                h, d = shard_storage(inputs, s.table, s.sharding_type, s.kernel, [s.rows, s.cols])
                sh_hbm, sh_ddr = sh_hbm + h, sh_ddr + d
        hbm, ddr = max(hbm, r.hbm_bytes - sh_hbm), max(ddr, r.ddr_bytes - sh_ddr)
    return max(hbm, 0), max(ddr, 0)


class RecpipeStorageReservation(StorageReservation):
    """Reserves recpipe's non-shard terms on every device of the topology."""

    def __init__(self, inputs: PlannerInputs) -> None:
        self._inputs = inputs
        self._last: "Topology | None" = None
        name_reservation_share(self, 0.0)

    def reserve(self, topology: "Topology", batch_size: int, module: Any, sharders: list,
                constraints: dict | None = None, **kwargs: Any) -> "Topology":
        hbm, ddr = non_shard_bytes(self._inputs)
        reserved = copy.deepcopy(topology)
        for device in reserved.devices:
            device.storage.hbm = max(device.storage.hbm - hbm, 0)
            device.storage.ddr = max(device.storage.ddr - ddr, 0)
        self._last = reserved
        return reserved

    @property
    def last_reserved_topology(self) -> "Topology | None":  # abstract in torchrec's StorageReservation
        return self._last


def constraints_from_config(sharding: "ShardingConfig", inputs: PlannerInputs) -> dict:
    """torchrec ``ParameterConstraints`` fixing each table's sharding type, kernel,
    pooling factors (one per feature) and cache params as the config says
    (placement left to torchrec)."""
    W = inputs.world_size
    out = {}
    for t in inputs.tables:
        out[t.name] = ParameterConstraints(
            sharding_types=[t.sharding_type], compute_kernels=[t.kernel],
            pooling_factors=[t.pooling_factor] * t.num_features,
            min_partition=t.dim // W if t.sharding_type == "column_wise" else None,
            cache_params=cache_params(sharding.for_table(t.name), sharding, inputs.prefetch_pipeline),
        )
    return out


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torchrec's planner warns about a directly built Topology (1.8) and the
    heuristical reservation; both are deliberate here."""
    names = ("torchrec.distributed.planner.types", "torchrec.distributed.planner.storage_reservations", "root")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _topology(inputs: PlannerInputs) -> "Topology":
    return Topology(world_size=inputs.world_size, compute_device="cuda", hbm_cap=inputs.hbm_capacity_bytes,
                    local_world_size=inputs.world_size)


def torchrec_planner(sharding: "ShardingConfig", inputs: PlannerInputs):
    """torchrec ``EmbeddingShardingPlanner`` that sizes shards with recpipe's numbers."""
    topology = _topology(inputs)
    constraints = constraints_from_config(sharding, inputs)
    enumerator = EmbeddingEnumerator(
        topology=topology, batch_size=inputs.batch_size, constraints=constraints,
        estimator=[EmbeddingPerfEstimator(topology=topology, constraints=constraints), RecpipeStorageEstimator(inputs)],
    )
    return EmbeddingShardingPlanner(
        topology=topology, batch_size=inputs.batch_size, enumerator=enumerator,
        storage_reservation=RecpipeStorageReservation(inputs), constraints=constraints,
    )


def plan_with_torchrec(sharding: "ShardingConfig", embedding: "EmbeddingOptimizerConfig", inputs: PlannerInputs,
                       model: "nn.Module"):
    """A ``ShardingPlan`` placed by torchrec's partitioner on recpipe's estimates
    (``model``: the unsharded model, e.g. built on meta)."""
    with _quiet():
        planner = torchrec_planner(sharding, inputs)
        try:
            return planner.plan(model, list(make_sharders(sharding, embedding).values()))
        except PlannerError as err:
            gib = inputs.hbm_capacity_bytes / 2**30
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise DoesNotFitError(
                f"sharding.placement=planner: torchrec's planner found no placement of the tables within "
                f"{gib:.3g} GiB of HBM per GPU on {inputs.world_size} GPU(s) ({first}); make the tables smaller "
                "(sharding.default.weights_precision: fp16, a UVM cache: kernel fused_uvm_caching), use more GPUs, or "
                "place them yourself (sharding.placement: config; `recpipe plan` shows what fits)") from err


def torchrec_pipeline_type(pipeline: PipelineSpec) -> str:
    """TorchRec's planner ``PipelineType`` of the same memory shape: the prefetch pipeline's,
    the SparseDist family's (an input dist ahead on its own stream), or the plain loop's."""
    if pipeline.prefetch:
        return "TRAIN_PREFETCH_SPARSE_DIST"
    return "TRAIN_SPARSE_DIST" if "dist" in pipeline.side_streams else "TRAIN_BASE"


def torchrec_estimate(sharding: "ShardingConfig", embedding: "EmbeddingOptimizerConfig", inputs: PlannerInputs,
                      model: "nn.Module", *, pipeline_aware: bool = False) -> list[dict[str, int]]:
    """TorchRec's own per-rank numbers for ``inputs`` at recpipe's placement.

    ``EmbeddingStorageEstimator`` as torchrec's planner builds it (pipeline type
    NONE, unless ``pipeline_aware``) summed over the shards each rank holds, plus
    ``HeuristicalStorageReservation(0.15)``'s dense and KJT reservations."""
    with _quiet():
        return _torchrec_estimate(sharding, embedding, inputs, model, pipeline_aware)


def _torchrec_estimate(sharding: "ShardingConfig", embedding: "EmbeddingOptimizerConfig", inputs: PlannerInputs,
                       model: "nn.Module", pipeline_aware: bool) -> list[dict[str, int]]:
    topology = _topology(inputs)
    constraints = constraints_from_config(sharding, inputs)
    ptype = getattr(PipelineType, torchrec_pipeline_type(inputs.pipeline)) if pipeline_aware else PipelineType.NONE
    estimator = EmbeddingStorageEstimator(topology=topology, constraints=constraints, pipeline_type=ptype)
    enumerator = EmbeddingEnumerator(topology=topology, batch_size=inputs.batch_size, constraints=constraints,
                                     estimator=[estimator])
    sharders = list(make_sharders(sharding, embedding).values())
    options = {so.name: so for so in enumerator.enumerate(model, sharders)}
    reservation = HeuristicalStorageReservation(percentage=0.15)
    reservation.reserve(topology, inputs.batch_size, model, sharders, constraints)
    dense, kjt = reserved_hbm(reservation)
    tw = dict(inputs.tw_ranks)
    out = [{"rank": r, "shards_hbm": 0, "shards_ddr": 0, "dense_reservation": dense, "kjt_reservation": kjt}
           for r in range(inputs.world_size)]
    for name, so in options.items():
        for i, shard in enumerate(so.shards):
            ranks = [tw[name]] if so.sharding_type == "table_wise" else (
                list(range(inputs.world_size)) if so.sharding_type == "data_parallel" and len(so.shards) == 1 else [i])
            for r in ranks:
                out[r]["shards_hbm"] += shard.storage.hbm
                out[r]["shards_ddr"] += shard.storage.ddr
    for o in out:
        o["hbm"] = o["shards_hbm"] + dense + kjt
    return out
