"""Typed, validated, frozen configuration for every recpipe component.

One YAML file maps onto :class:`RecpipeConfig`. Every section is a pydantic model
with ``extra="forbid"``, so a misspelt key is an error, and defaults live here and
nowhere else. Cross-field rules (prefetch needs a cached table, multi-pass needs
prefetch, ...) are checked once, in :meth:`RecpipeConfig._cross_checks`, before any
process group starts. ``load_config`` applies ``--set key.path=value`` overrides to
the raw YAML before validation, so an override is checked like the file itself.

``ConfigError`` carries every problem with its key path, value and what is allowed;
the CLI prints it and exits with code 2.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "ConfigError",
    "RecpipeConfig",
    "load_config",
    "parse_overrides",
    "SHARDING_TYPES",
    "COMPUTE_KERNELS",
]


class ConfigError(ValueError):
    """A config that cannot run. ``str(err)`` lists every problem, one per line."""


class _Section(BaseModel):
    # allow_inf_nan=False: every float of every section must be finite (an lr of .inf or
    # .nan is a config error, exit 2, not a run that diverges at its first step).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# --------------------------------------------------------------------- model
CRITEO_NUM_DENSE = 13
CRITEO_NUM_SPARSE = 26


_FACTORY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


def _factory_spec(value: str | None) -> str | None:
    if value is not None and not _FACTORY_RE.match(value):
        raise ValueError("expected 'package.module:function', e.g. 'my_models.two_tower:build'")
    return value


FactorySpec = Annotated[Union[str, None], AfterValidator(_factory_spec)]


class ModelConfig(_Section):
    # A user model instead of the built-in DLRM/DCNv2: "package.module:function", a
    # function(cfg: RecpipeConfig) -> torch.nn.Module whose forward(batch) returns
    # (loss, output) (docs/models.md). Imported from the working directory or
    # PYTHONPATH. With a factory the DLRM fields below are not used; the factory reads
    # its own settings from ``model.options``.
    factory: FactorySpec = None
    options: dict[str, Any] = Field(default_factory=dict)
    arch: Literal["dlrm", "dcnv2"] = "dlrm"
    embedding_dim: int = Field(16, gt=0)
    num_dense_features: int = Field(CRITEO_NUM_DENSE, gt=0)
    # One table per sparse feature (Criteo layout: 26). Feature i is ``cat_i``,
    # its table ``t_cat_i``.
    num_embeddings_per_feature: list[Annotated[int, Field(gt=0)]] = Field(
        default_factory=lambda: [1000] * CRITEO_NUM_SPARSE, min_length=1
    )
    dense_arch_layer_sizes: list[Annotated[int, Field(gt=0)]] = Field(
        default_factory=lambda: [64, 16], min_length=1
    )
    # The final 1 (the logit) is part of the list, as in torchrec's DLRM.
    over_arch_layer_sizes: list[Annotated[int, Field(gt=0)]] = Field(
        default_factory=lambda: [64, 32, 1], min_length=2
    )
    dcn_num_layers: int = Field(2, gt=0)
    dcn_low_rank_dim: int = Field(16, gt=0)

    @model_validator(mode="after")
    def _shapes(self) -> "ModelConfig":
        if self.factory is not None:  # the DLRM fields are not used
            return self
        if self.dense_arch_layer_sizes[-1] != self.embedding_dim:
            raise ValueError(
                f"model.dense_arch_layer_sizes[-1]={self.dense_arch_layer_sizes[-1]} must equal "
                f"model.embedding_dim={self.embedding_dim} (the dense arch projects into the "
                "embedding space)"
            )
        if self.over_arch_layer_sizes[-1] != 1:
            raise ValueError(
                f"model.over_arch_layer_sizes[-1]={self.over_arch_layer_sizes[-1]} must be 1 "
                "(one click logit per sample)"
            )
        return self

    @property
    def num_sparse_features(self) -> int:
        return len(self.num_embeddings_per_feature)

    @property
    def feature_names(self) -> list[str]:
        return [f"cat_{i}" for i in range(self.num_sparse_features)]

    @property
    def table_names(self) -> list[str]:
        return [f"t_cat_{i}" for i in range(self.num_sparse_features)]


# ---------------------------------------------------------------------- data
class SyntheticConfig(_Section):
    # Mean number of ids per sample and feature (a scalar applies to every feature).
    # Lengths are 1 + Poisson(mean - 1), so every sample has at least one id.
    mean_pooling_factors: Union[Annotated[float, Field(ge=1.0)], list[Annotated[float, Field(ge=1.0)]]] = 1.0
    # Zipf exponent of the ids (0 = uniform). Ids are permuted per table so hot ids
    # are spread over the table.
    zipf_alpha: float = Field(1.05, ge=0.0)
    # Batches per rank and epoch; different per-rank counts are allowed (tests of
    # uneven data use it): ``num_batches_per_rank`` overrides ``num_batches``.
    num_batches: int = Field(1000, gt=0)
    num_batches_per_rank: list[Annotated[int, Field(gt=0)]] | None = None
    num_eval_batches: int = Field(8, gt=0)
    # Strength of the planted ground-truth model; larger = easier to learn.
    signal_scale: float = Field(3.0, gt=0)


class CriteoConfig(_Section):
    train_files: list[str] = Field(default_factory=list)
    eval_files: list[str] = Field(default_factory=list)


class BinaryConfig(_Section):
    # Directories written by ``recpipe data convert`` (recpipe/data/binary_format.py):
    # one set of fixed-width arrays per converted TSV file plus manifest.json.
    train_dir: str | None = None
    eval_dir: str | None = None  # None = no evaluation data


class DataConfig(_Section):
    # User batches instead of a built-in source: "package.module:function", a
    # function(cfg, *, rank, world_size, split, epoch, start_batch) -> Iterable[batch]
    # (batches are torchrec Pipelineables: ``to(device, non_blocking)`` and
    # ``record_stream``). Settings for it go in ``data.options``.
    factory: FactorySpec = None
    options: dict[str, Any] = Field(default_factory=dict)
    # synthetic: generated clicks; criteo_tsv: parse TSV files while training;
    # binary: memory-mapped arrays made once from TSV by ``recpipe data convert``.
    source: Literal["synthetic", "criteo_tsv", "binary"] = "synthetic"
    batch_size: int = Field(512, gt=0, description="samples per rank and step")
    # Parallel batch makers per rank (0 = made in the training loop itself).
    # criteo_tsv: forked DataLoader worker processes. synthetic and binary: see
    # workers_kind.
    num_workers: int = Field(1, ge=0)
    # synthetic and binary with num_workers > 0. process: forked producer processes
    # that hand batches over through reused shared-memory slots, so making them
    # never holds the training loop's GIL (recpipe/data/stream.py). thread: threads
    # of the training process (no fork; for host-memory tables, train.device=cpu,
    # which a forked producer would make the training process copy page by page as
    # it writes them). Not Linux, or tables in UVM (fused_uvm, fused_uvm_caching: pinned
    # host memory, which a fork copies into every producer): threads.
    workers_kind: Literal["process", "thread"] = "process"
    pin_memory: bool = True
    # binary only: a new row order every epoch, deterministic in (train.seed, epoch):
    # blocks of ``shuffle_block_rows`` consecutive rows are permuted, then the rows
    # inside each batch. The eval split is never shuffled.
    shuffle: bool = False
    shuffle_block_rows: int = Field(1024, gt=0)
    # Ids per sample of each sparse feature in criteo_tsv / binary data (one entry
    # per feature; None = one id each, the Criteo layout). A TSV field then holds
    # exactly that many comma-separated hex ids, or is empty (that many id 0).
    multi_hot_sizes: list[Annotated[int, Field(gt=0)]] | None = None
    synthetic: SyntheticConfig = SyntheticConfig()
    criteo: CriteoConfig = CriteoConfig()
    binary: BinaryConfig = BinaryConfig()

    @model_validator(mode="after")
    def _files(self) -> "DataConfig":
        if self.factory is not None and "source" in self.model_fields_set:
            raise ValueError(f"data.factory={self.factory!r} and data.source={self.source!r} both name the data; set one")
        if self.source == "criteo_tsv" and not self.criteo.train_files:
            raise ValueError("data.criteo.train_files is empty but data.source='criteo_tsv'")
        if self.source == "binary" and self.binary.train_dir is None:
            raise ValueError("data.binary.train_dir is not set but data.source='binary' (a directory made by "
                             "`recpipe data convert`)")
        if self.shuffle and self.source != "binary":
            raise ValueError(f"data.shuffle=true needs data.source='binary' (got data.source={self.source!r}): "
                             "only memory-mapped data can be read in a shuffled order; convert TSV files with "
                             "`recpipe data convert`")
        if self.multi_hot_sizes is not None and self.source == "synthetic" and self.factory is None:
            raise ValueError("data.multi_hot_sizes describes criteo_tsv / binary data, but data.source='synthetic' "
                             "(its ids per sample come from data.synthetic.mean_pooling_factors)")
        return self


# ------------------------------------------------------------------ sharding
SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "data_parallel")
COMPUTE_KERNELS = ("fused", "fused_uvm", "fused_uvm_caching", "dense")


class TableSharding(_Section):
    type: Literal["table_wise", "row_wise", "column_wise", "data_parallel"] = "table_wise"
    # fused = FBGEMM TBE with weights in HBM; fused_uvm = weights in UVM (host);
    # fused_uvm_caching = UVM weights with an HBM cache; dense = data-parallel only.
    kernel: Literal["fused", "fused_uvm", "fused_uvm_caching", "dense"] = "fused"
    # Only for fused_uvm_caching: fraction of rows the HBM cache holds.
    cache_load_factor: float | None = Field(None, gt=0.0, le=1.0)
    # table_wise only: which rank holds the table (default: round-robin).
    rank: int | None = Field(None, ge=0)
    # Embedding weights in the TBE: fp32 or fp16 (half the memory; FBGEMM updates
    # fp16 rows with stochastic rounding). null = the table config's own data_type
    # (fp32 in the built-in model). bf16 is refused: FBGEMM's training kernels
    # (fbgemm-gpu 1.6, 1.8) have no bf16 weights, nor int8 ones.
    weights_precision: Literal["fp32", "fp16", "bf16"] | None = None
    # fused_uvm_caching only: precision of the HBM cache rows (fp32 | fp16);
    # null = weights_precision. FBGEMM's caches have no bf16 rows.
    cache_precision: Literal["fp32", "fp16", "bf16"] | None = None
    # Stochastic rounding of fp16 weight updates; null = on (FBGEMM's default).
    # FBGEMM's CPU kernels round to nearest either way.
    stochastic_rounding: bool | None = None


def _applies(field: str, spec: TableSharding) -> bool:
    """Whether ``field`` of ``sharding.default`` means anything for a table shaped like ``spec``."""
    if field == "kernel":  # dense is the data_parallel kernel, and only it
        return (spec.kernel == "dense") == (spec.type == "data_parallel")
    if field in ("cache_load_factor", "cache_precision"):
        return spec.kernel == "fused_uvm_caching"
    if field == "rank":
        return spec.type == "table_wise"
    if field in ("weights_precision", "stochastic_rounding"):  # FBGEMM TBE settings; data_parallel has none
        return spec.type != "data_parallel"
    return True


def _over_default(default: TableSharding, entry: TableSharding) -> TableSharding:
    """``default`` with the fields ``entry`` sets on top (``ShardingConfig.tables``); a
    field left out that does not apply to the entry's type and kernel takes its
    built-in default instead (the kernel: dense for data_parallel, else fused)."""
    own = entry.model_fields_set
    merged = default.model_copy(update={f: getattr(entry, f) for f in own})
    if "kernel" not in own and not _applies("kernel", merged):
        built_in_kernel = TableSharding.model_fields["kernel"].default  # fused
        merged = merged.model_copy(update={"kernel": "dense" if merged.type == "data_parallel" else built_in_kernel})
    built_in = {f: TableSharding.model_fields[f].default for f in TableSharding.model_fields
                if f not in own and f != "kernel" and not _applies(f, merged)}
    values = dict(merged.model_copy(update=built_in) if built_in else merged)
    # Only the entry's own fields count as set, so ``RecpipeConfig.editable_dump`` gives
    # back what was written and a later override of ``default`` reaches the rest.
    return TableSharding.model_construct(_fields_set=set(own), **values)


class CommPrecision(_Section):
    # Precision of the pooled / sequence embeddings on the wire (output all-to-all
    # and reduce-scatter) and of their gradients: torchrec's quantized comms
    # (QCommsConfig + get_qcomm_codecs_registry). Values are sent in this precision
    # and decoded back to fp32. On CPU (Gloo) torchrec sends bf16 as fp16. With both
    # directions in the same half precision on several ranks (and no data_parallel
    # table) the TBEs write their outputs in it and only casts run: two conversions a
    # step instead of four (recpipe.torchrec_args.tbe_output_precision).
    forward: Literal["fp32", "fp16", "bf16"] = "fp32"
    backward: Literal["fp32", "fp16", "bf16"] = "fp32"


class ShardingConfig(_Section):
    default: TableSharding = TableSharding()
    # Per-table overrides keyed by table name (t_cat_0 ..., or the names of a
    # model.factory model's tables, checked once it is built). An entry overrides the
    # fields it sets; every other field comes from ``default`` (resolved once, here).
    tables: dict[str, TableSharding] = Field(default_factory=dict)
    # FBGEMM UVM-cache prefetch pipeline (cache-line locking). Needs a
    # fused_uvm_caching table; the `prefetch` pipeline needs it on.
    prefetch_pipeline: bool = False
    # FBGEMM multi-pass prefetch: number of passes (1 = no splitting) and
    # min_splitable_pass_size (indices; below it a batch is not split).
    prefetch_passes: int = Field(1, ge=1)
    prefetch_min_pass_size: int = Field(6 * 1024 * 1024, gt=0)
    # UVM placements pin host memory instead of managed memory.
    uvm_host_mapped: bool = False
    # GPU memory per rank the plan must fit (GiB); None = the GPU's own, or 80.
    hbm_gb: float | None = Field(None, gt=0)
    # Which rank holds each shard: "config" = as written here (table_wise tables on
    # their `rank`, else the least-loaded rank); "planner" = torchrec's partitioner
    # sized by recpipe's memory estimates (sharding types and kernels still from here).
    placement: Literal["config", "planner"] = "config"
    # Memory planner only: mean ids per sample for each feature of a table, by table
    # name. Unlisted tables take what the data gives for their features cat_i:
    # data.multi_hot_sizes, else one id each for criteo_tsv / binary data, else
    # data.synthetic.mean_pooling_factors (built-in model), else 1.0 (model.factory
    # models; the plan warns which). For an EmbeddingCollection table it is the mean
    # sequence length.
    mean_pooling_factors: dict[str, Annotated[float, Field(gt=0.0)]] = Field(default_factory=dict)
    comm_precision: CommPrecision = CommPrecision()
    # How the replicated (dense) part's gradients are averaged over several ranks
    # (recpipe.sharding.data_parallel): all_reduce = one flat all-reduce per dtype
    # after each backward, no module hooks; ddp = torchrec's DDP wrapper (bucketed
    # all-reduces during the backward). One rank needs neither.
    dense_gradients: Literal["all_reduce", "ddp"] = "all_reduce"

    @model_validator(mode="after")
    def _tables_over_default(self) -> "ShardingConfig":
        """Each ``tables`` entry becomes ``default`` with the entry's own fields on top:
        ``{type: row_wise}`` under a fp16 default is a fp16 row-wise table. A field the
        entry leaves out comes from ``default`` only where it applies to the entry's
        type and kernel (``_applies``: a cache load factor or cache precision to
        ``fused_uvm_caching``, a rank to ``table_wise``, TBE precisions not to
        ``data_parallel``, whose kernel is ``dense``): ``{kernel: fused}`` under a cached
        default is a plain HBM table, ``{type: row_wise}`` under a data_parallel default
        a fused one. Fields written as null count as set (null = the built-in default)."""
        resolved = {name: _over_default(self.default, spec) for name, spec in self.tables.items()}
        if all(resolved[name] == spec for name, spec in self.tables.items()):
            return self
        return self.model_copy(update={"tables": resolved})

    def for_table(self, name: str) -> TableSharding:
        return self.tables.get(name, self.default)


# ----------------------------------------------------------------- optimizer
class EmbeddingOptimizerConfig(_Section):
    name: Literal["sgd", "rowwise_adagrad", "adam"] = "rowwise_adagrad"
    lr: float = Field(0.05, gt=0)
    eps: float = Field(1e-8, gt=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)


class DenseOptimizerConfig(_Section):
    name: Literal["sgd", "adagrad", "adam"] = "adagrad"
    lr: float = Field(0.05, gt=0)
    eps: float = Field(1e-8, gt=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)


class OptimizerConfig(_Section):
    embedding: EmbeddingOptimizerConfig = EmbeddingOptimizerConfig()
    dense: DenseOptimizerConfig = DenseOptimizerConfig()


# ------------------------------------------------------------------ pipeline
class _PipelineCommon(_Section):
    # How far side streams may run ahead in batches (memory rate limiter); None =
    # as far as the schedule allows.
    max_batches_ahead: int | None = Field(None, ge=1)
    # Every rank trains every batch it has: ranks that run out early feed padding
    # batches with zero loss weight until the last rank is done ("pad"), or the
    # run stops with an error naming the ranks and their counts ("error").
    uneven_data: Literal["pad", "error"] = "pad"
    # Sharded modules whose input the model builds inside forward: module path in the
    # model (e.g. "sparse.ebc") -> "package.module:function", a function(batch) ->
    # KeyedJaggedTensor the pipeline runs ahead of forward (docs/models.md).
    inputs: dict[str, Annotated[str, AfterValidator(_factory_spec)]] = Field(default_factory=dict)
    # Replay the model's dense modules (forward and backward) as CUDA graphs, captured
    # at the first batch's shapes, and the dense optimizer's step: cuts the host's launch
    # work (recpipe/pipelines/graphs.py). CUDA only. Which modules: the model's
    # cuda_graph_modules() (recpipe's DLRM/DCNv2: dense arch and interaction+over
    # arch+loss), or the paths in cuda_graph_modules.
    cuda_graphs: bool = False
    cuda_graph_modules: list[str] = Field(default_factory=list)
    # With cuda_graphs: also replay the dense torch.optim step, bit-identical to the eager
    # step (recpipe/pipelines/optimizer_graph.py): SGD, and Adagrad with lr_decay 0. Other
    # optimizers (Adam, ...) step eagerly with a warning; so does a step after its lr or
    # state changed (recaptured once it holds; eager for good after 8 changes, e.g. an lr
    # scheduler). false: the optimizer steps eagerly.
    cuda_graph_optimizer: bool = True
    # Where the splits of each batch's input all-to-all are exchanged (several ranks):
    # "device" (as TorchRec does): copied to the GPU, one all-to-all on the model's
    # process group, read back at input_dist_wait, a host sync that waits for the dist
    # stream to reach it; "host": over a Gloo group of the same ranks, from host memory,
    # so that wait is on the other ranks' hosts only (recpipe/pipelines/sharded.py).
    splits_exchange: Literal["device", "host"] = "device"
    # What a sharded EmbeddingBagCollection with several sharding groups hands the model:
    # "grouped" (the same KeyedTensor, kept as the groups' tensors: to_dict() and kt[key] are
    # views, values() concatenates on first use; recpipe/pipelines/pooled.py) or
    # "concatenated" (torchrec's: one tensor in the groups' key order). Same numbers; "grouped"
    # saves a forward and a backward copy of the pooled output for models that read it by key.
    pooled_output: Literal["grouped", "concatenated"] = "grouped"


class BasePipelineConfig(_PipelineCommon):
    name: Literal["base"] = "base"


class SparseDistPipelineConfig(_PipelineCommon):
    name: Literal["sparse_dist"]


class FusedSparseDistPipelineConfig(_PipelineCommon):
    name: Literal["fused_sparse_dist"]
    # Stream for the early embedding lookup + output dist of batch i+1. Default "current"
    # (the compute stream; TorchRec's default is "data_dist"): on one H100, 65536
    # samples, it stepped 4 % faster than data_dist with 2 % less reserved memory
    # (benchmarks/README.md). The bench gives TorchRec's pipeline the same choice.
    emb_lookup_stream: Literal["data_dist", "new", "current"] = "current"
    # Issue the early lookup before or after the dense optimizer step of batch i.
    emb_lookup: Literal["before_optimizer", "after_optimizer"] = "before_optimizer"


class SemiSyncPipelineConfig(_PipelineCommon):
    name: Literal["semi_sync"]
    # Synchronous (sparse_dist-equivalent) warm-up steps before going semi-sync.
    start_batch: int = Field(0, ge=0)
    # Apply the dense gradient one step late too, so dense and sparse are equally stale.
    stash_gradients: bool = False
    # Where batch i+1's output all-to-all is waited: "in_forward" (in forward(i+1), TorchRec's
    # order: it overlaps backward(i), and both the lookup's output and the all-to-all's are
    # alive during backward(i)) or "early" (right after the lookup: the lookup's output is
    # freed before backward(i), which starts once that all-to-all is done).
    output_dist_wait: Literal["early", "in_forward"] = "in_forward"
    # Where batch i+1's lookup is queued: "before_backward" (after forward(i), TorchRec's
    # order) or "before_update" (inside backward(i): after the dense and output all-to-all
    # backward, before the TBE backward that updates the tables). Same numbers; with
    # before_update batch i+1's embeddings are not alive where backward(i) peaks.
    emb_lookup: Literal["before_backward", "before_update"] = "before_backward"


class PrefetchPipelineConfig(_PipelineCommon):
    name: Literal["prefetch"]
    # Where the host waits for batch i+1's splits: "after_forward" (default: the GPU runs
    # forward(i) while the host waits, as in sparse_dist) or "before_forward" (TorchRec's
    # order: the tensors all-to-all and so the prefetch of i+1 start early, but the GPU
    # has only backward(i-1) queued while the host waits: measured 1.10-1.17x its busy
    # time at 32768 samples on one H100, benchmarks/2026-11-23-h100x1-prefetch_sweep.md).
    # "before_forward_early_splits": TorchRec's wait, with each batch's splits all-to-all
    # launched a step earlier, right after its copy (recpipe/pipelines/prefetch.py).
    input_dist_wait: Literal["before_forward", "after_forward", "before_forward_early_splits"] = "after_forward"
    # Who runs the UVM-cache insert of the prefetch (recpipe/pipelines/cache_fill.py): "triton"
    # (recpipe's kernels: FBGEMM's cache bookkeeping, and the rows moved by cache_fill_sms
    # persistent programs with 64 rows in flight each) or "fbgemm" (its lru_cache_populate,
    # whose kernel moves rows one PCIe round trip after another on #SMs/8 blocks of 1024
    # threads, slowing the compute beside it). Same numbers. One H100, 32768 samples: 17.07
    # vs 19.21 ms at 85 % misses, 16.59 vs 16.93 ms at the config's 20 % cache
    # (benchmarks/README.md, thirteenth session). "triton" falls back to FBGEMM's, with a
    # warning, where Triton is missing (it ships with torch's CUDA builds), and for tables whose
    # cache rows are not in the weights' precision (an error when "triton" is set here).
    cache_fill: Literal["fbgemm", "triton"] = "triton"
    cache_fill_sms: int = Field(4, ge=1)
    # Where FBGEMM's backward pre-hook work for batch i runs (the release of its cache-line locks
    # and the recompute of its cache locations after prefetch(i+1)): "prefetch_stream" (right
    # after prefetch(i+1), beside forward(i): recpipe/pipelines/cache_bookkeeping.py) or
    # "backward" (FBGEMM's hook, on the compute stream inside backward(i)). Same numbers.
    cache_bookkeeping: Literal["prefetch_stream", "backward"] = "prefetch_stream"


PipelineConfig = Annotated[
    Union[
        BasePipelineConfig,
        SparseDistPipelineConfig,
        FusedSparseDistPipelineConfig,
        SemiSyncPipelineConfig,
        PrefetchPipelineConfig,
    ],
    Field(discriminator="name"),
]


# ------------------------------------------------------------- train & co.
class TrainConfig(_Section):
    steps: int = Field(200, gt=0, description="training steps (batches per rank) at most")
    epochs: int = Field(1, gt=0)
    # torch.manual_seed takes 64 bits; numpy's generators (data shuffling) take non-negative seeds.
    seed: int = Field(0, ge=0, lt=2**63)
    eval_every: int = Field(100, ge=0, description="steps between evaluations; 0 = only at the end")
    # Steps between log points. Each costs the training loop about 6 ms of host time (metrics
    # update and all-reduce, TensorBoard, the bar): at 10, 5-6 % of a Criteo-sized 8192-sample
    # step on one H100, at 100 about 0.6 % (benchmarks/2026-11-23-h100x1-trainer_vs_bench_s6.md).
    log_every: int = Field(100, gt=0)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    progress: bool = True
    # Numerics of the dense part (recpipe/models/precision.py). fp32: float32. tf32: float32
    # tensors, TF32 tensor-core matmuls on CUDA (no TF32 on CPU: fp32 there, with a warning).
    # bf16: the dense forward/backward under torch.autocast(bfloat16) with float32 master
    # weights and optimizer state, float32 loss, float32 embedding tables and lookups.
    # `recpipe bench` gives TorchRec's pipelines the same model, so the same numerics.
    precision: Literal["fp32", "tf32", "bf16"] = "fp32"
    # A loss that is NaN or inf (checked at log points and before every evaluation and
    # checkpoint, without a host sync per step): "error" stops the run naming the step
    # (exit code 4; no checkpoint is saved after that step); "skip_step" applies no
    # update of such a step on any rank (exact for SGD and Adagrad without weight
    # decay; Adam's moments still decay) and lists it in summary.json.
    on_nonfinite: Literal["error", "skip_step"] = "error"
    # skip_step is for the rare bad batch, not a diverging model: once more than
    # ``max_skipped_steps`` of any ``skipped_steps_window`` consecutive steps are skipped,
    # the run stops as with "error" (exit code 4, nothing saved after the first of them).
    # The default allows 1 % of a window. With either mode a non-finite eval loss, or a
    # non-finite weight found before a checkpoint is written, stops the run the same way.
    max_skipped_steps: int = Field(1, ge=0, description="skip_step: most skipped steps in any window")
    skipped_steps_window: int = Field(100, gt=0, description="skip_step: the window, in steps")
    cuda_alloc_conf: str | None = Field(
        "expandable_segments:True",
        pattern=r"^[A-Za-z_]+:[^,\s]+(,[A-Za-z_]+:[^,\s]+)*$",
        description="PyTorch CUDA caching-allocator settings (PYTORCH_CUDA_ALLOC_CONF syntax) for every process, "
        "unless PYTORCH_CUDA_ALLOC_CONF is already set; null = PyTorch's defaults. Expandable segments keep "
        "peak reserved close to peak allocated when batch-sized blocks vary",
    )


class DistributedConfig(_Section):
    # Processes to start on this machine when not already under torchrun.
    nproc: int = Field(1, gt=0)
    backend: Literal["auto", "gloo", "nccl"] = "auto"


class CheckpointConfig(_Section):
    dir: str | None = None
    every: int = Field(0, ge=0, description="steps between checkpoints; 0 = only at the end")
    resume: bool = True
    keep: int = Field(2, gt=0)
    # On SIGTERM / SIGINT (preemption) every rank finishes its step, drains the
    # pipeline and, with this on and a dir set, saves a checkpoint before exiting 143 / 130.
    on_preempt: bool = True


class LoggingConfig(_Section):
    run_dir: str = "runs/default"
    tensorboard: bool = True


class RecpipeConfig(_Section):
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    sharding: ShardingConfig = ShardingConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    pipeline: PipelineConfig = BasePipelineConfig()
    train: TrainConfig = TrainConfig()
    distributed: DistributedConfig = DistributedConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> "RecpipeConfig":
        problems = _cross_field_problems(self)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def editable_dump(self) -> dict[str, Any]:
        """The config as a raw dict to apply overrides to and validate again: every value
        resolved, except that each ``sharding.tables`` entry holds only the fields it was
        written with, so an override of ``sharding.default`` reaches the others exactly as
        ``--set`` does on the YAML (a full dump would pin them to the old default)."""
        raw = self.model_dump(mode="json")
        raw["sharding"]["tables"] = {name: spec.model_dump(mode="json", exclude_unset=True)
                                     for name, spec in self.sharding.tables.items()}
        return raw

    def table_sharding(self) -> dict[str, TableSharding]:
        """Resolved sharding of every table, by table name. A ``model.factory`` model's
        tables are known only once it is built: then the configured tables plus
        ``sharding.default`` (under that key), which is what config-time rules can
        check; ``recpipe.embedding_tables.validated_tables`` checks the real ones."""
        if self.model.factory is not None:
            return {**self.sharding.tables, "sharding.default": self.sharding.default}
        return {name: self.sharding.for_table(name) for name in self.model.table_names}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _cross_field_problems(cfg: RecpipeConfig) -> list[str]:
    problems: list[str] = []
    sh = cfg.sharding
    known = set(cfg.model.table_names)
    # A factory model's tables are known once it is built: recpipe.sharding checks them then.
    for key in ("tables", "mean_pooling_factors"):
        for name in getattr(sh, key) if cfg.model.factory is None else ():
            if name not in known:
                problems.append(
                    f"sharding.{key}.{name}: no such table; tables are t_cat_0 .. "
                    f"t_cat_{cfg.model.num_sparse_features - 1}"
                )
    resolved = {"default": sh.default, **{f"tables.{k}": v for k, v in sh.tables.items()}}
    for where, t in resolved.items():
        key = f"sharding.{where}"
        if t.type == "data_parallel" and t.kernel != "dense":
            problems.append(f"{key}.kernel={t.kernel!r}: data_parallel tables need kernel 'dense'")
        if t.type != "data_parallel" and t.kernel == "dense":
            problems.append(
                f"{key}.kernel='dense' is only for type 'data_parallel' (got type={t.type!r}); "
                "use 'fused', 'fused_uvm' or 'fused_uvm_caching'"
            )
        if t.cache_load_factor is not None and t.kernel != "fused_uvm_caching":
            problems.append(
                f"{key}.cache_load_factor={t.cache_load_factor} needs kernel 'fused_uvm_caching' "
                f"(got kernel={t.kernel!r})"
            )
        problems += _precision_problems(key, t)
        if t.rank is not None and t.type != "table_wise":
            problems.append(f"{key}.rank={t.rank} is only for type 'table_wise' (got type={t.type!r})")
        if t.rank is not None and sh.placement == "planner":
            problems.append(f"{key}.rank={t.rank} pins a table, but sharding.placement='planner' places every table")
        if t.rank is not None and t.rank >= cfg.distributed.nproc:
            problems.append(
                f"{key}.rank={t.rank} but distributed.nproc={cfg.distributed.nproc} "
                f"(ranks are 0..{cfg.distributed.nproc - 1})"
            )
        if t.type == "column_wise" and cfg.model.factory is None and cfg.model.embedding_dim % cfg.distributed.nproc:
            problems.append(
                f"{key}.type='column_wise' splits model.embedding_dim={cfg.model.embedding_dim} "
                f"over distributed.nproc={cfg.distributed.nproc} ranks; it must divide evenly"
            )
    cached = [n for n, t in cfg.table_sharding().items() if t.kernel == "fused_uvm_caching"]
    if sh.prefetch_pipeline and not cached:
        problems.append(
            "sharding.prefetch_pipeline=true needs at least one table with kernel "
            "'fused_uvm_caching' (none is configured)"
        )
    if sh.prefetch_passes > 1 and not sh.prefetch_pipeline:
        problems.append(
            f"sharding.prefetch_passes={sh.prefetch_passes} (multi-pass prefetch) needs "
            "sharding.prefetch_pipeline=true"
        )
    if cfg.pipeline.name == "prefetch" and cached and not sh.prefetch_pipeline:
        problems.append(
            f"pipeline.name='prefetch' with cached tables {cached} needs sharding.prefetch_pipeline=true: "
            "without FBGEMM's cache-line locking, the prefetch of batch i+1 can evict rows batch i's "
            "backward still needs"
        )
    if cfg.pipeline.name == "semi_sync" and cached:
        problems.append(
            f"pipeline.name='semi_sync' with UVM-cached tables {cached}: it looks up batch i+1 before the "
            "backward of batch i, and the cache populate of i+1 can evict rows that backward still updates "
            "(cache-line locking only exists with the prefetch pipeline); use kernel 'fused' or 'fused_uvm' "
            "for those tables, or pipeline.name='prefetch'"
        )
    if "cache_fill" in cfg.pipeline.model_fields_set and cfg.pipeline.cache_fill == "triton":  # asked for by name
        for name in cached:
            t = cfg.table_sharding()[name]
            if t.cache_precision is not None and t.cache_precision != (t.weights_precision or "fp32"):
                problems.append(
                    f"pipeline.cache_fill='triton' copies rows as they are, but sharding table {name} has "
                    f"cache_precision={t.cache_precision!r} and weights_precision={t.weights_precision or 'fp32'!r}; "
                    "make them equal or use pipeline.cache_fill='fbgemm'"
                )
    if sh.prefetch_pipeline and cfg.pipeline.name != "prefetch":
        problems.append(
            f"sharding.prefetch_pipeline=true needs pipeline.name='prefetch' (got "
            f"{cfg.pipeline.name!r}): FBGEMM locks prefetched cache lines until the "
            "backward of the same batch, which only the prefetch pipeline schedules"
        )
    if cfg.train.device == "cpu" and any(
        t.kernel in ("fused_uvm", "fused_uvm_caching") for t in cfg.table_sharding().values()
    ):
        problems.append(
            "train.device='cpu' but some tables use a UVM kernel (fused_uvm / "
            "fused_uvm_caching), which needs a CUDA GPU"
        )
    syn = cfg.data.synthetic
    if cfg.model.factory is None and isinstance(syn.mean_pooling_factors, list) and len(syn.mean_pooling_factors) != cfg.model.num_sparse_features:
        problems.append(
            f"data.synthetic.mean_pooling_factors has {len(syn.mean_pooling_factors)} entries but "
            f"model.num_embeddings_per_feature has {cfg.model.num_sparse_features} features"
        )
    hot = cfg.data.multi_hot_sizes
    if cfg.model.factory is None and hot is not None and len(hot) != cfg.model.num_sparse_features:
        problems.append(
            f"data.multi_hot_sizes has {len(hot)} entries but model.num_embeddings_per_feature has "
            f"{cfg.model.num_sparse_features} features"
        )
    if syn.num_batches_per_rank is not None and len(syn.num_batches_per_rank) != cfg.distributed.nproc:
        problems.append(
            f"data.synthetic.num_batches_per_rank has {len(syn.num_batches_per_rank)} entries but "
            f"distributed.nproc={cfg.distributed.nproc}"
        )
    return problems


def _precision_problems(key: str, t: TableSharding) -> list[str]:
    """Precisions FBGEMM cannot train (its dispatch: weights fp32 / fp16 (/ fp8),
    cache rows fp32 / fp16; fbgemm-gpu 1.6 and 1.8, CPU and CUDA)."""
    problems = []
    if t.weights_precision == "bf16":
        problems.append(f"{key}.weights_precision='bf16': FBGEMM's training kernels have no bf16 weights (they "
                        "train fp32 and fp16); use 'fp16'")
    if t.cache_precision == "bf16":
        problems.append(f"{key}.cache_precision='bf16': FBGEMM's UVM caches hold fp32 or fp16 rows; use 'fp16'")
    if t.cache_precision is not None and t.kernel != "fused_uvm_caching":
        problems.append(f"{key}.cache_precision={t.cache_precision!r} needs kernel 'fused_uvm_caching' "
                        f"(got kernel={t.kernel!r})")
    if t.type == "data_parallel" and t.weights_precision not in (None, "fp32"):
        problems.append(f"{key}.weights_precision={t.weights_precision!r} with type 'data_parallel': the dense "
                        "optimizer would update the replicated fp16 weights in place, without stochastic rounding; "
                        "use a sharded type or fp32")
    return problems


def check_device(cfg: RecpipeConfig, cuda_available: bool) -> None:
    """Rules that depend on the machine (checked where the job is launched, before
    any process starts): raises ConfigError naming every problem."""
    on_cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and cuda_available)
    problems = []
    if cfg.train.device == "cuda" and not cuda_available:
        problems.append("train.device='cuda' but this machine has no CUDA GPU")
    if not on_cuda:
        uvm = [n for n, t in cfg.table_sharding().items() if t.kernel in ("fused_uvm", "fused_uvm_caching")]
        if uvm:
            problems.append(f"tables {uvm} use a UVM kernel (fused_uvm / fused_uvm_caching), which needs a CUDA GPU; "
                            "this run is on CPU")
        if cfg.optimizer.embedding.name == "adam":
            problems.append("optimizer.embedding.name='adam': FBGEMM's CPU kernels have no Adam; use 'sgd' or "
                            "'rowwise_adagrad' on CPU")
        if cfg.pipeline.cuda_graphs:
            problems.append("pipeline.cuda_graphs=true needs a CUDA GPU; this run is on CPU")
        if cfg.distributed.backend == "nccl":
            problems.append("distributed.backend='nccl' needs CUDA GPUs; this run is on CPU (use 'gloo' or 'auto')")
    if problems:
        raise ConfigError("invalid config for this machine:\n" + "\n".join(f"  {p}" for p in problems))


# -------------------------------------------------------------- loading
def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``["train.steps=50", ...]`` -> ``{"train.steps": 50}``; values are YAML scalars/lists."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {pair!r}: expected KEY=VALUE, e.g. --set train.steps=50")
        try:
            out[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as err:
            raise ConfigError(f"--set {key.strip()}={raw}: not a YAML value ({_yaml_problem(err)})") from None
    return out


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error in one line: "line L, column C: what is wrong" (PyYAML's own
    message spans several lines, with the context and a caret)."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"


def _read_yaml(p: Path) -> Any:
    """The YAML document in file ``p``; ConfigError naming the file and line when it
    cannot be read, is not UTF-8 (what YAML files are) or is not valid YAML."""
    try:
        data = p.read_bytes()
    except OSError as err:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {err.strerror or err}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise ConfigError(f"config file {str(p)!r}, line {line}, column {column}: byte 0x{data[err.start]:02x} is "
                          "not UTF-8 text (save the file as UTF-8)") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {_yaml_problem(err)}") from None


def apply_override(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``dotted`` (``"sharding.default.weights_precision"``) in the raw config dict ``raw``."""
    node = raw
    parts = dotted.split(".")
    for part in parts[:-1]:
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {dotted}: {part!r} is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def _allowed_keys(loc: tuple) -> list[str]:
    """Field names of the section at ``loc`` (a pydantic error location), for messages."""
    model: Any = RecpipeConfig
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        if part in _PIPELINE_VARIANTS:
            model = _PIPELINE_VARIANTS[part]
            continue
        if isinstance(part, int) or model is None or part not in model.model_fields:
            return []
        if part == "tables":  # dict of table name -> TableSharding
            model = TableSharding
            parts = parts[1:]
            continue
        ann = model.model_fields[part].annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return sorted(model.model_fields) if model is not None else []


_PIPELINE_VARIANTS: dict[str, type[BaseModel]] = {
    "base": BasePipelineConfig,
    "sparse_dist": SparseDistPipelineConfig,
    "fused_sparse_dist": FusedSparseDistPipelineConfig,
    "semi_sync": SemiSyncPipelineConfig,
    "prefetch": PrefetchPipelineConfig,
}


def _discriminator_problem(loc: str, error: dict) -> str:
    """pydantic says "Input tag 'x' found using 'name' does not match any of the
    expected tags"; say which key, which value, and what is allowed instead."""
    name = error["ctx"]["discriminator"].strip("'")
    key = f"{loc}.{name}"
    allowed = ", ".join(_PIPELINE_VARIANTS)
    if error["type"] == "union_tag_invalid":
        return f"  {key}={error['ctx']['tag']!r} is not a pipeline; choose one of: {allowed}"
    return f"  {key} is missing (required when the {loc} section is given); choose one of: {allowed}"


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-"))
        # Discriminated unions put the variant name in the path: drop it.
        loc = loc.replace("pipeline.base.", "pipeline.").replace("pipeline.sparse_dist.", "pipeline.")
        for name in ("fused_sparse_dist", "semi_sync", "prefetch"):
            loc = loc.replace(f"pipeline.{name}.", "pipeline.")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] in ("union_tag_invalid", "union_tag_not_found"):  # pipeline.name (the discriminator)
            lines.append(_discriminator_problem(loc, e))
            continue
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(e["loc"][:-1])
            msg = "unknown key" + (f"; allowed here: {', '.join(allowed)}" if allowed else "")
        value = e.get("input")
        shown = "" if e["type"] in ("missing",) or isinstance(value, dict) else f" (got {value!r})"
        if loc:
            lines.append(f"  {loc}: {msg}{shown}")
        else:
            lines.extend(f"  {m}" for m in msg.split("\n"))
    if len(lines) == 2:  # one problem: one line
        return f"{lines[0]} {lines[1].strip()}"
    return "\n".join(lines)


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> RecpipeConfig:
    try:
        return RecpipeConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def load_config(path: str | Path | None, overrides: list[str] | dict[str, Any] | None = None) -> RecpipeConfig:
    """Read YAML at ``path`` (None = all defaults), apply ``--set`` overrides, validate."""
    raw: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        loaded = _read_yaml(p)
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections, got {type(loaded).__name__}")
        raw = loaded or {}
        source = str(p)
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    for key, value in (overrides or {}).items():
        apply_override(raw, key, value)
    return config_from_dict(raw, source)
