"""What the planner is asked about: frozen input dataclasses (built from a config by
:mod:`recpipe.planner.inputs`; the model's side: :mod:`recpipe.planner.model_spec`).

``PlannerInputs`` holds everything :func:`recpipe.planner.estimate.estimate_memory`
reads: tables, their shards (where each shard lives), the dense model, the
optimizers, the pipeline, the prefetch options, the batch, the topology and the
FBGEMM version. It is plain data: building it from a config touches no process group
and no GPU (the dense model is built on the meta device to count its parameters).

Shards follow torchrec's own rules so that the estimate is of the run that really
happens (``tests/test_planner.py`` checks them against
``construct_module_sharding_plan``):

* table_wise: one shard, on ``recpipe.table_sharding.placement.table_wise_ranks``'s rank;
* row_wise: ``ceil(rows / W)`` rows per rank, the last non-empty shard takes the
  rest, later ranks get 0 rows (torchrec ``_calculate_rw_shard_sizes_and_offsets``);
* column_wise: blocks of the smallest multiple of 4 columns that is at least
  ``dim / W`` and divides ``dim`` (else all of ``dim``), on ranks 0, 1, ...
  (``sharding_plan.column_wise(ranks=...)`` and ``_find_base_dim``): dim 16 over 8
  ranks is 4 shards of 4 columns, dim 12 over 2 ranks one shard of 12;
* data_parallel: the whole table on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from recpipe.pipeline_options import PipelineOptions, options_of
from recpipe.pipelines.registry import PIPELINES
from recpipe.speedups.registry import SPEEDUPS
from recpipe.table_sharding.precision import PRECISION_BYTES

if TYPE_CHECKING:
    from recpipe.config import ModelConfig, RecpipeConfig

GiB = 1 << 30

CACHED = "fused_uvm_caching"
UVM_KERNELS = ("fused_uvm", "fused_uvm_caching")


@dataclass(frozen=True)
class TableSpec:
    """One embedding table, model-agnostic: what its module looks up per sample.

    ``pooling_factor`` is the mean ids per sample of *each* of its ``num_features``
    features. A pooled table (EmbeddingBagCollection) outputs one row per bag
    (sample and feature); a sequence table (EmbeddingCollection, ``pooled=False``)
    one row per id. ``weighted``: its input KJT carries an fp32 weight per id;
    ``feature_processed``: a feature processor creates those weights after the
    input all-to-all. ``module``: the embedding module's path; torchrec builds
    TBEs per module, so tables of different modules never share one."""

    name: str
    rows: int
    dim: int
    pooling_factor: float  # mean ids per sample of each of its features
    sharding_type: str  # table_wise | row_wise | column_wise | data_parallel
    kernel: str  # fused | fused_uvm | fused_uvm_caching | dense
    cache_load_factor: float | None = None  # fused_uvm_caching only
    module: str = ""
    num_features: int = 1
    pooled: bool = True
    weighted: bool = False
    feature_processed: bool = False
    weights_precision: str = "fp32"  # fp32 | fp16: the TBE's weights (and its UVM rows)
    cache_precision: str | None = None  # HBM cache rows of a cached table; None = weights_precision
    stochastic_rounding: bool | None = None  # what recpipe passes to FBGEMM (a TBE grouping key)

    @property
    def cached(self) -> bool:
        return self.kernel == CACHED

    @property
    def weight_bytes(self) -> int:
        return PRECISION_BYTES[self.weights_precision]

    @property
    def cache_bytes(self) -> int:
        return PRECISION_BYTES[self.cache_precision or self.weights_precision]

    @property
    def ids_per_sample(self) -> float:
        return self.pooling_factor * self.num_features


@dataclass(frozen=True)
class ShardSpec:
    """One shard of a table on one rank (``rows`` x ``cols`` of the table)."""

    table: str
    rank: int
    rows: int
    cols: int
    row_offset: int = 0
    col_offset: int = 0


@dataclass(frozen=True)
class DenseSpec:
    """The dense (data-parallel) part of the model.

    ``dense_arch_bytes`` and ``top_bytes`` are the bytes of the activations autograd
    saves per sample in the dense arch and in the interaction + over arch, at the
    model's precision (``train.precision``; :func:`activation_bytes`);
    ``dense_out_grad_bytes`` the bytes per sample of the gradient that waits for the
    dense arch's backward (:func:`dense_output_grad_bytes`); see
    :func:`recpipe.planner.model_spec.dense_spec`."""

    num_params: int
    buffer_bytes: int = 0
    dense_arch_bytes: int = 0
    top_bytes: int = 0
    dense_out_grad_bytes: int = 0


@dataclass(frozen=True)
class PipelineSpec:
    """Memory-relevant facts of one training pipeline (design numbers of recpipe's
    schedules, ``recpipe/runtime/schedule.py``).

    * ``batches_in_flight``: device copies of input batches of the schedule alive at the
      peak (its depth). The steps the host queues ahead of the device
      (``pipeline.steps_ahead``) add none to the allocated bytes: a finished step frees
      its batch in the caching allocator's count at once, and the allocator keeps the
      block from reuse until the device has passed the streams that read it
      (``record_stream``); ``tests/test_planner_gpu.py`` measures this with the
      default ``steps_ahead``;
    * ``dist_kjts_in_flight``: of those, how many already went through the input
      all-to-all (their received KJTs are alive too);
    * ``pending_input_dists``: batches whose input all-to-all is launched but not yet
      waited by their consumer (forward, lookup) during the backward: torchrec's
      tensors awaitable still holds what it sent, the rank's permuted local KJT
      (W > 1). sparse_dist and fused_sparse_dist: batch i+1 (waited in its forward /
      lookup, after backward(i)); semi_sync: batch i+2; prefetch: none (prefetch(i+1)
      waits it before backward(i), and the input dist of i+2 comes after the optimizer),
      but batch i+2 with ``input_dist_wait: before_forward_early_splits`` (launched at
      the start of step i);
      base: none (input dist inside forward);
    * ``early_pooled``: pooled embeddings of batch i+1 computed before batch i's
      backward and alive through it (semi_sync);
    * ``lookup_after_backward``: batch i+1's lookup runs after backward(i) (it is fenced
      on it: fused_sparse_dist), so its pooled embeddings are not alive at the
      backward peak; they are the ``lookup_next`` phase;
    * ``dense_backward_first``: once running, batch i's lookup was made before its
      forward (fused_sparse_dist: in step i-1, so its autograd nodes are older than
      the dense arch's; semi_sync: its backward is split at the pooled embeddings),
      so the dense backward runs before the TBE backward: the
      ``backward_emb_after_dense`` phase. The first batch of the pipeline's life is
      looked up inside its own forward, so its step has sparse_dist's order
      (``backward_emb``) once;
    * ``keeps_emb_graph``: batch i's TBE outputs kept until its delayed embedding
      backward (semi_sync, once running);
    * ``early_pooled_at_update``: batch i+1's pooled embeddings made inside backward(i),
      after its output all-to-all backward and before its TBE backward (semi_sync
      ``emb_lookup: before_update``): alive only in the ``backward_emb_after_dense``
      phase, not through the whole step;
    * ``side_streams``: streams besides the default one; each keeps its own pool in
      the caching allocator;
    * ``lookup_stream``: where the embedding lookup runs ("main", or fused_sparse_dist's
      "dist" / "lookup"); autograd runs its backward on the same stream;
    * ``cache_insert``: who inserts a prefetch's missed rows into the UVM cache in the
      prefetch step ("recpipe": ``recpipe.speedups.cache_fill``, for the TBEs whose cache
      rows are in the weights' precision; "fbgemm": FBGEMM's ``lru_cache_populate``);
      FBGEMM's inline prefetch inside a forward always uses FBGEMM's;
    * ``cache_bookkeeping_stream``: where FBGEMM's backward pre-hook work for batch i (lock
      release, cache locations recomputed) runs with ``prefetch_pipeline``: "prefetch"
      (right after prefetch(i+1), ``recpipe.speedups.cache_bookkeeping``) or "main" (in
      the backward, FBGEMM's hook);
    * ``graphed_parts``: the dense parts ``pipeline.cuda_graphs`` captures (0: off); each
      keeps its own warm-up stream and graph pool for the model's life
      (``recpipe.speedups.cuda_graphs``).

    The pipeline's registry entry gives the facts of its schedule (``PipelineDef.memory``),
    the speed features it runs with give theirs (``SpeedupDef.plan_facts``): ``cache_insert``,
    ``cache_bookkeeping_stream``, ``graphed_parts``.
    """

    name: str
    batches_in_flight: int
    dist_kjts_in_flight: int
    side_streams: tuple[str, ...]
    pending_input_dists: int = 0
    early_pooled: bool = False
    lookup_after_backward: bool = False
    dense_backward_first: bool = False
    keeps_emb_graph: bool = False
    early_pooled_at_update: bool = False
    prefetch: bool = False
    stash_dense_grads: bool = False
    lookup_stream: str = "main"
    cache_insert: str = "fbgemm"  # recpipe | fbgemm
    cache_bookkeeping_stream: str = "main"  # prefetch | main
    graphed_parts: int = 0


def pipeline_spec(options: "PipelineOptions | str") -> PipelineSpec:
    """The :class:`PipelineSpec` of a recpipe pipeline's options (``cfg.pipeline``; a name:
    that pipeline's defaults): read off its schedule by the pipeline's registry entry
    (``PipelineDef.memory``), with the facts of the speed features it runs with."""
    if isinstance(options, str):
        options = options_of(PIPELINES[options])(name=options)
    definition = PIPELINES[options.name]
    return PipelineSpec(**definition.memory(options), **speedup_facts(options, definition.offers))


def speedup_facts(options: "PipelineOptions", offers: frozenset[str]) -> dict[str, object]:
    """What the speed features ``options`` turns on tell the planner (``SpeedupDef.plan_facts``),
    on a pipeline that offers ``offers``: those it lacks capabilities for do not run."""
    facts: dict[str, object] = {}
    for feature in SPEEDUPS.values():
        if feature.plan_facts is not None and feature.enabled(options) and not feature.lacking(offers):
            facts.update(feature.plan_facts(feature.section(options)))
    return facts


@dataclass(frozen=True)
class PlannerInputs:
    """Everything the memory estimate depends on. Sizes in bytes, counts per rank."""

    tables: tuple[TableSpec, ...]
    shards: tuple[ShardSpec, ...]
    world_size: int
    batch_size: int  # samples per rank and step
    num_dense_features: int
    dense: DenseSpec
    embedding_optimizer: str  # sgd | rowwise_adagrad | adam
    dense_optimizer: str  # sgd | adagrad | adam
    pipeline: PipelineSpec
    hbm_capacity_bytes: int
    prefetch_pipeline: bool = False
    prefetch_passes: int = 1
    prefetch_min_pass_size: int = 6 * 1024 * 1024
    uvm_host_mapped: bool = False
    fbgemm_version: tuple[int, int] = (1, 8)
    tw_ranks: tuple[tuple[str, int], ...] = field(default=())
    # False for a model.factory model: its batch's dense part is unknown, only the
    # KJTs are counted (num_dense_features is then unused).
    dense_batch: bool = True
    notes: tuple[str, ...] = ()  # what the estimate could not know about the model (shown as warnings)
    comm_precision: tuple[str, str] = ("fp32", "fp32")  # sharding.comm_precision (forward, backward)
    # The caching allocator maps each stream's blocks into one growing segment
    # (PYTORCH_CUDA_ALLOC_CONF expandable_segments:True, recpipe train's default:
    # train.cuda_alloc_conf), so freed blocks coalesce; False: PyTorch's default segments.
    expandable_segments: bool = False

    @property
    def comm_bytes(self) -> tuple[int, int]:
        """Bytes per value of the output dist (forward) and of its gradient (backward)."""
        return PRECISION_BYTES[self.comm_precision[0]], PRECISION_BYTES[self.comm_precision[1]]

    @property
    def tbe_output_bytes(self) -> int:
        """Bytes per value of the TBEs' pooled outputs: the wire precision where the TBEs
        write it themselves (``recpipe.table_sharding.comm.tbe_output_precision``: several ranks,
        both directions the same half precision, no data_parallel table), else fp32."""
        fwd, bwd = self.comm_precision
        data_parallel = any(t.sharding_type == "data_parallel" for t in self.tables)
        return PRECISION_BYTES[fwd] if self.world_size > 1 and fwd == bwd and fwd != "fp32" and not data_parallel else 4

    def table(self, name: str) -> TableSpec:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(name)

    def shards_on(self, rank: int) -> list[ShardSpec]:
        return [s for s in self.shards if s.rank == rank]


# ------------------------------------------------------------------ shards
def rw_shard_rows(rows: int, world_size: int) -> list[int]:
    """torchrec ``_calculate_rw_shard_sizes_and_offsets``: ceil blocks, the rest last."""
    block = math.ceil(rows / world_size)
    last_rank = rows // block
    return [block if r < last_rank else (rows - block * last_rank if r == last_rank else 0) for r in range(world_size)]


def cw_block_cols(dim: int, world_size: int) -> int:
    """Columns per column_wise shard, as torchrec's ``column_wise(ranks=range(W))``
    computes them (``_find_base_dim(dim // W, dim)``: FBGEMM wants multiples of 4)."""
    lower = dim // world_size
    return next((i for i in range(lower, dim) if dim % i == 0 and i % 4 == 0), dim)


def shards_for_tables(tables: tuple[TableSpec, ...], world_size: int, tw_ranks: dict[str, int]) -> tuple[ShardSpec, ...]:
    """Shards of every table, as ``recpipe.sharding.sharding_plan`` places them."""
    out: list[ShardSpec] = []
    for t in tables:
        if t.sharding_type == "table_wise":
            out.append(ShardSpec(t.name, tw_ranks[t.name], t.rows, t.dim))
        elif t.sharding_type in ("row_wise", "table_row_wise"):  # one host: every rank is its host's
            offset = 0
            for rank, n in enumerate(rw_shard_rows(t.rows, world_size)):
                out.append(ShardSpec(t.name, rank, n, t.dim, row_offset=offset))
                offset += n
        elif t.sharding_type == "column_wise":
            if t.dim % world_size:
                raise ValueError(f"{t.name}: dim {t.dim} does not split over {world_size} ranks")
            cols = cw_block_cols(t.dim, world_size)
            out += [ShardSpec(t.name, r, t.rows, cols, col_offset=r * cols) for r in range(t.dim // cols)]
        elif t.sharding_type == "data_parallel":
            out += [ShardSpec(t.name, r, t.rows, t.dim) for r in range(world_size)]
        else:
            raise ValueError(f"{t.name}: unknown sharding type {t.sharding_type!r}")
    return tuple(out)


def shards_from_plan(plan, tables: tuple[TableSpec, ...]) -> tuple[ShardSpec, ...]:
    """Shards of a torchrec ``ShardingPlan`` (e.g. one made by torchrec's planner with
    :mod:`recpipe.planner.torchrec_planner`), for the tables named in ``tables``."""
    by_name = {t.name: t for t in tables}
    out: list[ShardSpec] = []
    for module_plan in plan.plan.values():
        for name, ps in module_plan.items():
            if name not in by_name:
                continue
            if ps.sharding_spec is None:  # data parallel: replicated on ps.ranks
                t = by_name[name]
                out += [ShardSpec(name, r, t.rows, t.dim) for r in ps.ranks]
                continue
            for sh in ps.sharding_spec.shards:
                rank = sh.placement.rank()
                out.append(ShardSpec(name, rank, sh.shard_sizes[0], sh.shard_sizes[1], sh.shard_offsets[0], sh.shard_offsets[1]))
    return tuple(out)


# ------------------------------------------------------------------ config
def activation_bytes(m: "ModelConfig", precision: str = "fp32") -> tuple[int, int]:
    """Bytes autograd saves per sample: (dense arch, interaction + over arch).

    fp32 / tf32 (4 bytes per float; approximate for DCNv2, see docs/planner.md): each
    Linear saves its input and each ReLU its output, which is the next Linear's
    input: one activation per layer (the first input is the batch's dense features).
    DLRM's interaction keeps the cat of dense + F pooled embeddings (saved by bmm)
    and the [dense, pairs] concat (the over arch's input); bmm output and gather are
    freed. DCNv2: x0, and per layer V x, U(V x), x0 * (...).

    bf16 (autocast; measured with saved-tensor hooks in tests/test_planner_precision.py):
    autocast saves a bf16 copy of every Linear/bmm input, also of the batch's dense
    features. The interaction casts the pooled embeddings to bf16
    (``recpipe.models.dlrm.DenseHead``). DLRM: bmm saves the bf16 cat of dense and pooled
    (its transpose is a view of it), the over arch the bf16 [dense, pairs]. DCNv2 (recpipe's cross network keeps its activations bf16,
    ``recpipe.models.dlrm.DenseHead.cross``): x0 in bf16, and per layer its input x_l
    (x0 itself for the first), V x_l and U(V x_l) + bias, all bf16; the over arch's input
    is the last layer's output. The bf16 weight copies autocast
    keeps for backward (2 bytes per dense parameter, not per sample) are left out:
    well under 0.1 % of a plan at GPU batch sizes."""
    F, D = m.num_sparse_features, m.embedding_dim
    dense, over = sum(m.dense_arch_layer_sizes), sum(m.over_arch_layer_sizes)
    width, rank, layers = (F + 1) * D, m.dcn_low_rank_dim, m.dcn_num_layers
    pairs = (F + 1) * F // 2
    if precision != "bf16":
        inter = width + (D + pairs) if m.arch == "dlrm" else width + layers * (3 * width + rank)
        return 4 * dense, 4 * (inter + over)
    dense_bytes = 2 * (m.num_dense_features + dense)
    if m.arch == "dlrm":
        return dense_bytes, 2 * width + 2 * (D + pairs) + 2 * over
    return dense_bytes, 2 * width + layers * (4 * width + 2 * rank) + 2 * over


def dense_output_grad_bytes(m: "ModelConfig", precision: str = "fp32") -> int:
    """Bytes per sample of the dense arch output's gradient, alive from the
    interaction's backward until the dense arch's backward, which autograd runs after
    the embeddings' (its nodes are older): through the TBE backward.

    DLRM uses the dense output twice (the interaction's cat and the [dense, pairs]
    cat): autograd sums the two gradients into a new [B, D] tensor, in the dense
    output's dtype (fp32; bf16 under autocast). DCNv2 uses it once, in the cat that
    makes x0: its gradient is a view of x0's [B, (F+1) * D] fp32 gradient and keeps all
    of it; under bf16 autocast the cast back to the bf16 dense output copies the
    [B, D] slice and x0's gradient goes. Measured with the CPU allocator's profiler
    events at the TBE backward (tests/test_planner_liveness.py)."""
    D, F = m.embedding_dim, m.num_sparse_features
    if precision == "bf16":
        return 2 * D
    return 4 * D if m.arch == "dlrm" else 4 * (F + 1) * D
