"""Typed, validated, frozen configuration for every recpipe component.

One YAML file maps onto :class:`RecpipeConfig`. Every section is a pydantic model
with ``extra="forbid"``, so a misspelt key is an error, and defaults live here and
nowhere else. Cross-field rules (prefetch needs a cached table, multi-pass needs
prefetch, ...) are checked once, in :meth:`RecpipeConfig._cross_checks`, before any
process group starts. ``load_config`` applies ``--set key.path=value`` overrides to
the raw YAML before validation, so an override is checked like the file itself.

``ConfigError`` carries every problem with its key path, value and what is allowed;
the CLI prints it and exits with code 2. What depends on more than the config (the
pipeline's and the speed features' rules, the machine, the data, the model's tables) is
checked above it, by ``recpipe.preflight``. This module imports pydantic and PyYAML, not
torch: the ``pipeline`` section's variants come from the registry's light declarations.
"""

from __future__ import annotations

import difflib
import os
import re
import stat
from pathlib import Path
from typing import Annotated, Any, Iterator, Literal, Union

import yaml
from pydantic import (AfterValidator, BaseModel, Field, SerializeAsAny, ValidationError, WrapValidator,
                      field_validator, model_validator)

from recpipe.capabilities import PREFETCH_STEP
from recpipe.errors import ConfigError
from recpipe.lr_schedule import LRSchedule
from recpipe.pipeline_options import PipelineOptions, options_model, options_of
from recpipe.pipelines.registry import PIPELINES
from recpipe.sections import FactorySpec, Section
from recpipe.shipped_configs import missing_hint

__all__ = [
    "ConfigError",
    "ConfigLoader",
    "MAX_CONFIG_BYTES",
    "RecpipeConfig",
    "load_config",
    "parse_overrides",
    "SHARDING_TYPES",
]


# --------------------------------------------------------------------- model
CRITEO_NUM_DENSE = 13
CRITEO_NUM_SPARSE = 26
# torch refuses a tensor of 2^63 bytes or more ("Storage size calculation overflowed"), even on
# the meta device: the built-in model's weights (float32) are checked against it here, so that
# such sizes are a config error naming the key, not a traceback where the model is built.
TENSOR_BYTES_LIMIT = 2**63
FP32_BYTES = 4




class ModelConfig(Section):
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
        for what, rows, cols in self._weights():
            if rows * cols * FP32_BYTES >= TENSOR_BYTES_LIMIT:
                raise ValueError(f"{what}: a weight of {rows} x {cols} float32 values ({rows * cols * FP32_BYTES:.3g} "
                                 "bytes) is larger than a torch tensor can be (2^63 bytes)")
        return self

    def _weights(self) -> Iterator[tuple[str, int, int]]:
        """(the keys that size it, rows, columns) of each weight of the built-in model
        (recpipe.models.dlrm.build_model: torchrec's DLRM / DLRM_DCN): every table, every
        Linear of the dense and over archs, DCNv2's low-rank cross layers."""
        D, F = self.embedding_dim, self.num_sparse_features
        for i, rows in enumerate(self.num_embeddings_per_feature):
            yield f"model.num_embeddings_per_feature[{i}]={rows} x model.embedding_dim={D}", rows, D
        inputs = self.num_dense_features
        for i, size in enumerate(self.dense_arch_layer_sizes):
            yield f"model.dense_arch_layer_sizes[{i}]={size}", size, inputs
            inputs = size
        inputs = D + F * (F + 1) // 2 if self.arch == "dlrm" else (F + 1) * D  # the interaction's output
        if self.arch == "dcnv2":
            yield (f"model.dcn_low_rank_dim={self.dcn_low_rank_dim} x (F + 1) * model.embedding_dim={inputs}",
                   inputs, self.dcn_low_rank_dim)
        for i, size in enumerate(self.over_arch_layer_sizes):
            yield f"model.over_arch_layer_sizes[{i}]={size}", size, inputs
            inputs = size

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
class SyntheticConfig(Section):
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
    # Where batches are made. cpu: by the producers of data.workers_kind on the host.
    # cuda: by producer threads of the training process, each on its own CUDA stream of
    # the rank's GPU, copied into pinned host memory and handed over as host batches
    # (for multi-hot shapes, whose host producers fall behind a GPU's steps). The same
    # laws, but other batches than cpu for a seed (docs/data.md, "Synthetic batches on the GPU").
    device: Literal["cpu", "cuda"] = "cpu"


class CriteoConfig(Section):
    train_files: list[str] = Field(default_factory=list)
    eval_files: list[str] = Field(default_factory=list)


class BinaryConfig(Section):
    # Directories written by ``recpipe data convert`` (recpipe/data/binary_format.py):
    # one set of fixed-width arrays per converted TSV file plus manifest.json.
    train_dir: str | None = None
    eval_dir: str | None = None  # None = no evaluation data


class NpyConfig(Section):
    # Day prefixes of Criteo preprocessed by TorchRec or MLPerf DLRM-DCNv2, rows in list
    # order: PREFIX_dense.npy (float, used as is), PREFIX_labels.npy and PREFIX_sparse.npy
    # (int [rows, features]), or with data.multi_hot_sizes MLPerf's
    # PREFIX_sparse_multi_hot.npz (recpipe/data/criteo_npy.py, docs/data.md).
    train: list[str] = Field(default_factory=list)
    eval: list[str] = Field(default_factory=list)  # empty = no evaluation data
    # modulo: id % model.num_embeddings_per_feature[f] when batches are made (TorchRec's
    # and MLPerf's hashing of raw ids); contiguous: the files hold ids below the table
    # sizes already (TorchRec's sparse_to_contiguous), any other id is an error.
    ids: Literal["modulo", "contiguous"] = "modulo"
    # The sparse file's name after the prefix, ending in .npy ([rows, features], one id
    # each) or .npz (member "f.npy" [rows, h_f] per feature); null = "_sparse.npy", or
    # "_sparse_multi_hot.npz" with data.multi_hot_sizes.
    sparse_suffix: Annotated[Union[str, None], Field(pattern=r"\.np[yz]$")] = None


class DataConfig(Section):
    # User batches instead of a built-in source: "package.module:function", a
    # function(cfg, *, rank, world_size, split, epoch, start_batch) -> Iterable[batch]
    # (batches are torchrec Pipelineables: ``to(device, non_blocking)`` and
    # ``record_stream``). Settings for it go in ``data.options``.
    factory: FactorySpec = None
    options: dict[str, Any] = Field(default_factory=dict)
    # synthetic: generated clicks; criteo_tsv: parse TSV files while training;
    # binary: memory-mapped arrays made once from TSV by ``recpipe data convert``;
    # criteo_npy: TorchRec's / MLPerf's preprocessed Criteo .npy days (data.npy).
    source: Literal["synthetic", "criteo_tsv", "binary", "criteo_npy"] = "synthetic"
    batch_size: int = Field(512, gt=0, description="samples per rank and step")
    # Parallel batch makers per rank (0 = made in the training loop itself).
    # criteo_tsv: forked DataLoader worker processes. synthetic and binary: see
    # workers_kind. auto: sized by the rank's share of the host's cores and the
    # measured time to make a batch (recpipe/data/workers.py), said at start.
    num_workers: Union[Annotated[int, Field(ge=0)], Literal["auto"]] = "auto"
    # synthetic and binary with num_workers > 0. process: forked producer processes
    # that hand batches over through reused shared-memory slots, so making them
    # never holds the training loop's GIL (recpipe/data/stream.py). thread: threads
    # of the training process (no fork; for host-memory tables, train.device=cpu,
    # which a forked producer would make the training process copy page by page as
    # it writes them). Not Linux, or tables in UVM (fused_uvm, fused_uvm_caching: pinned
    # host memory, which a fork copies into every producer): threads.
    workers_kind: Literal["process", "thread"] = "process"
    pin_memory: bool = True
    # binary and criteo_npy: a new row order every epoch, deterministic in (train.seed, epoch):
    # blocks of ``shuffle_block_rows`` consecutive rows are permuted, then the rows
    # inside each batch. The eval split is never shuffled.
    shuffle: bool = False
    shuffle_block_rows: int = Field(1024, gt=0)
    # Ids per sample of each sparse feature (one entry per feature; None = one id each,
    # the Criteo layout). criteo_tsv / binary / criteo_npy: a TSV field holds exactly that many
    # comma-separated hex ids, or is empty (that many id 0). synthetic: every sample has
    # exactly that many ids (fixed shapes, as MLPerf DLRM-DCNv2's multi-hot data).
    multi_hot_sizes: list[Annotated[int, Field(gt=0)]] | None = None
    synthetic: SyntheticConfig = SyntheticConfig()
    criteo: CriteoConfig = CriteoConfig()
    binary: BinaryConfig = BinaryConfig()
    npy: NpyConfig = NpyConfig()

    @model_validator(mode="after")
    def _files(self) -> "DataConfig":
        if self.factory is not None and "source" in self.model_fields_set:
            raise ValueError(f"data.factory={self.factory!r} and data.source={self.source!r} both name the data; set one")
        if self.source == "criteo_tsv" and not self.criteo.train_files:
            raise ValueError("data.criteo.train_files is empty but data.source='criteo_tsv'")
        if self.source == "binary" and self.binary.train_dir is None:
            raise ValueError("data.binary.train_dir is not set but data.source='binary' (a directory made by "
                             "`recpipe data convert`)")
        if self.source == "criteo_npy" and not self.npy.train:
            raise ValueError("data.npy.train is empty but data.source='criteo_npy' (day prefixes such as "
                             "DIR/day_0 for DIR/day_0_dense.npy, ...)")
        if self.shuffle and self.source not in ("binary", "criteo_npy"):
            raise ValueError(f"data.shuffle=true needs data.source='binary' or 'criteo_npy' (got data.source="
                             f"{self.source!r}): only memory-mapped data can be read in a shuffled order; convert "
                             "TSV files with `recpipe data convert`")
        if self.synthetic.device == "cuda" and (self.source != "synthetic" or self.factory is not None):
            made = f"data.factory={self.factory!r}" if self.factory is not None else f"data.source={self.source!r}"
            raise ValueError(f"data.synthetic.device='cuda' makes synthetic batches on the GPU, but {made} makes "
                             "this run's batches: remove data.synthetic.device or use data.source='synthetic'")
        if (self.multi_hot_sizes is not None and self.source == "synthetic" and self.factory is None
                and self.synthetic.mean_pooling_factors != SyntheticConfig.model_fields["mean_pooling_factors"].default):
            raise ValueError("data.multi_hot_sizes (fixed ids per sample) and data.synthetic.mean_pooling_factors "
                             "(drawn ids per sample) both set the synthetic data's lengths; set one")
        return self


# ------------------------------------------------------------------ sharding
SHARDING_TYPES = ("table_wise", "row_wise", "table_row_wise", "column_wise", "data_parallel")


class TableSharding(Section):
    # table_wise: the whole table on one rank; row_wise: rows split over every rank;
    # table_row_wise: rows split over the ranks of one host (hosts balanced by rows);
    # column_wise: columns split over every rank; data_parallel: a copy on every rank.
    type: Literal["table_wise", "row_wise", "table_row_wise", "column_wise", "data_parallel"] = "table_wise"
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


class CommPrecision(Section):
    # Precision of the pooled / sequence embeddings on the wire (output all-to-all
    # and reduce-scatter) and of their gradients: torchrec's quantized comms
    # (QCommsConfig + get_qcomm_codecs_registry). Values are sent in this precision
    # and decoded back to fp32. On CPU (Gloo) torchrec sends bf16 as fp16. With both
    # directions in the same half precision on several ranks (and no data_parallel
    # table) the TBEs write their outputs in it and only casts run: two conversions a
    # step instead of four (recpipe.table_sharding.comm.tbe_output_precision).
    forward: Literal["fp32", "fp16", "bf16"] = "fp32"
    backward: Literal["fp32", "fp16", "bf16"] = "fp32"


class ShardingConfig(Section):
    default: TableSharding = TableSharding()
    # Per-table overrides keyed by table name (t_cat_0 ..., or the names of a
    # model.factory model's tables, checked once it is built). An entry overrides the
    # fields it sets; every other field comes from ``default`` (resolved once, here).
    tables: dict[str, TableSharding] = Field(default_factory=dict)
    # FBGEMM multi-pass prefetch (pipeline.name=prefetch with fused_uvm_caching tables): number
    # of passes (1 = no splitting) and min_splitable_pass_size (indices; below it a batch is not
    # split). FBGEMM's cache-line locking (its prefetch_pipeline mode) is on for cached tables
    # exactly when the prefetch pipeline runs them (RecpipeConfig.cache_line_locking).
    prefetch_passes: int = Field(1, ge=1)
    prefetch_min_pass_size: int = Field(6 * 1024 * 1024, gt=0)
    # UVM placements pin host memory instead of managed memory.
    uvm_host_mapped: bool = False
    # GPU memory per rank the plan must fit, in GiB (2**30 bytes, as torch.cuda and
    # nvidia-smi count). None (and no hbm_gb) = the GPU's own, or 80 GiB without one.
    hbm_gib: float | None = Field(None, gt=0)
    # The same in decimal GB (10**9 bytes: hbm_gb: 80 is 74.5 GiB); set hbm_gib or hbm_gb,
    # not both.
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

    @model_validator(mode="after")
    def _one_hbm_unit(self) -> "ShardingConfig":
        if self.hbm_gib is not None and self.hbm_gb is not None:
            raise ValueError(f"sharding.hbm_gib={self.hbm_gib:g} and sharding.hbm_gb={self.hbm_gb:g} both set the GPU "
                             "memory per rank; keep one (hbm_gib: GiB, 2**30 bytes; hbm_gb: GB, 10**9 bytes)")
        return self

    @property
    def hbm_bytes(self) -> int | None:
        """The GPU memory per rank that ``hbm_gib`` or ``hbm_gb`` sets, in bytes; None if neither."""
        if self.hbm_gib is not None:
            return int(self.hbm_gib * 2**30)
        if self.hbm_gb is not None:
            return int(self.hbm_gb * 10**9)
        return None

    def for_table(self, name: str) -> TableSharding:
        return self.tables.get(name, self.default)

    def table_key(self, name: str) -> str:
        """The key path that sets table ``name``'s sharding, for messages."""
        return f"sharding.tables.{name}" if name in self.tables else "sharding.default"


# ----------------------------------------------------------------- optimizer
class EmbeddingOptimizerConfig(Section):
    name: Literal["sgd", "rowwise_adagrad", "adam"] = "rowwise_adagrad"
    lr: float = Field(0.05, gt=0)
    eps: float = Field(1e-8, gt=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    # The rate at each step: warm-up, polynomial or step decay of lr (recpipe/lr_schedule.py,
    # docs/learning_rates.md); the default keeps lr.
    schedule: LRSchedule = LRSchedule()


class DenseOptimizerConfig(Section):
    name: Literal["sgd", "adagrad", "adam"] = "adagrad"
    lr: float = Field(0.05, gt=0)
    eps: float = Field(1e-8, gt=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    # As optimizer.embedding.schedule, for the dense optimizer.
    schedule: LRSchedule = LRSchedule()


class OptimizerConfig(Section):
    embedding: EmbeddingOptimizerConfig = EmbeddingOptimizerConfig()
    dense: DenseOptimizerConfig = DenseOptimizerConfig()


# ------------------------------------------------------------------ pipeline
# Each pipeline owns its keys of this section (its Options, recpipe/pipelines/defs/<name>.py; the
# common keys: recpipe/runtime/options.py; the speed features' sections are added to both by
# recpipe/pipeline_options.py); the registry
# (recpipe.pipelines.registry.PIPELINES) says which Options class ``pipeline.name`` picks.
def _pipeline_options(value: Any, handler: Any, info: Any) -> PipelineOptions:
    if isinstance(value, PipelineOptions):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping of pipeline options, got {type(value).__name__}")
    allowed = ", ".join(PIPELINES)
    if "name" not in value:
        raise ValueError(f"pipeline.name is missing (required when the pipeline section is given); choose one of: "
                         f"{allowed}")
    definition = PIPELINES.get(value["name"])
    if definition is None:
        raise ValueError(f"pipeline.name={value['name']!r} is not a pipeline; choose one of: {allowed}")
    return options_of(definition).model_validate(value)


PipelineSection = Annotated[SerializeAsAny[PipelineOptions], WrapValidator(_pipeline_options)]


# ------------------------------------------------------------- train & co.
# The shortest train.step_timeout_s: recpipe.train.watchdog polls every min(1 s, timeout / 5),
# publishing a heartbeat to the job's store each time, and takes 3 more polls to say which
# rank stopped; at 1 s that is 5 store writes a second per rank and a verdict 0.6 s later.
MIN_STEP_TIMEOUT_S = 1.0


class TrainConfig(Section):
    steps: int = Field(200, gt=0, description="training steps at most: optimizer steps, each one batch per rank "
                       "(train.accumulate_steps micro-batches with accumulation)")
    epochs: int = Field(1, gt=0)
    # torch.manual_seed takes 64 bits; numpy's generators (data shuffling) take non-negative seeds.
    seed: int = Field(0, ge=0, lt=2**63)
    eval_every: int = Field(100, ge=0, description="steps between evaluations; 0 = only at the end")
    # Evaluate through the pipeline's eval schedule (recpipe/pipelines/evaluation.py): the next
    # batches' copy, input all-to-all and lookup or UVM-cache prefetch overlap the forward, with
    # the plain loop's metrics bit for bit. false: one batch at a time, the plain loop, for a
    # model whose eval forward cannot be pipelined. benchmarks/studies/eval_speed.py times both.
    eval_pipelined: bool = True
    # Steps between log points. Each costs the training loop host time (metrics update and
    # all-reduce, TensorBoard, the bar): at short intervals, a visible share of a host-bound
    # step (benchmarks/results/h100x1/trainer_vs_bench.md).
    log_every: int = Field(100, gt=0)
    # Gradient accumulation (recpipe/pipelines/accumulation.py, docs/pipelines.md): each
    # optimizer step trains this many micro-batches of data.batch_size, the dense gradients
    # summed (backward of loss / N) and the dense optimizer stepped once, so the dense part
    # and data_parallel tables train as one batch of N x data.batch_size (up to float
    # summation order). Fused-optimizer tables update inside each micro-batch's backward.
    # train.steps, eval_every, log_every, checkpoint.every and the learning-rate schedules
    # count optimizer steps; an epoch's data that ends inside a step ends it on the mean
    # gradient of its micro-batches. Not with pipeline.name=semi_sync, pipeline.step_graph,
    # pipeline.cuda_graphs or train.on_nonfinite=skip_step (exit 2).
    accumulate_steps: int = Field(1, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    progress: bool = True
    # Numerics of the dense part (recpipe/models/precision.py). fp32: float32. tf32: float32
    # tensors, TF32 tensor-core matmuls on CUDA (no TF32 on CPU: fp32 there, with a warning).
    # bf16: the dense forward/backward under torch.autocast(bfloat16) with float32 master
    # weights and optimizer state, float32 loss, float32 embedding tables and lookups.
    # `recpipe bench` gives TorchRec's pipelines the same model, so the same numerics.
    precision: Literal["fp32", "tf32", "bf16"] = "fp32"
    # The same bits on every run of the same config (recpipe/deterministic.py): torch's and
    # FBGEMM's deterministic kernels (FBGEMM's embedding backward sums an id that occurs more
    # than 1024 times in a batch in one thread block instead of adding partial sums with
    # float atomics) and fixed cuBLAS workspaces. Off (torch's defaults), those atomics can
    # round differently from run to run in large batches of skewed ids (the Criteo-sized
    # synthetic log at 65536 samples). Its cost: slower steps, the deterministic kernels being
    # slower (recpipe/deterministic.py).
    deterministic: bool = False
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
    # A rank that makes no training step for this long ends the job on every rank, naming
    # the rank that stopped and its last step (exit code 8; recpipe/train/watchdog.py). null:
    # 100 times the median step of the run so far, and at least 60 s; 0: off; else at least
    # MIN_STEP_TIMEOUT_S. The first step (compiles, graph captures), torch.compile's later
    # compiles, evaluation and checkpoint saves are not timed.
    step_timeout_s: float | None = Field(
        None, ge=0,
        description="seconds without a training step before the job ends (exit 8): at least 1; null = 100 x the "
        "median step, at least 60; 0 = off",
    )

    @field_validator("step_timeout_s")
    @classmethod
    def _watchable(cls, value: float | None) -> float | None:
        if value and value < MIN_STEP_TIMEOUT_S:
            raise ValueError(f"must be 0 (off) or at least {MIN_STEP_TIMEOUT_S:g} s (the watchdog polls every "
                             "timeout / 5; a shorter one would end jobs over a pause of a host, not a stall)")
        return value

    # A stop request (SIGTERM, SIGINT, SIGHUP) that comes during an evaluation lets it go on
    # this long, then every rank ends it together (recpipe/train/preemption.py), saves the
    # last trained step and exits 128 + signal: an evaluation of thousands of batches must
    # not outlast a scheduler's grace period (30 s is common) before the checkpoint.
    stop_grace_s: float = Field(
        10.0, ge=0,
        description="seconds an evaluation goes on after a stop request (SIGTERM, SIGINT, SIGHUP) before every "
        "rank ends it, saves the last trained step and exits; 0 = at once",
    )
    cuda_alloc_conf: str | None = Field(
        "expandable_segments:True",
        pattern=r"^[A-Za-z_]+:[^,\s]+(,[A-Za-z_]+:[^,\s]+)*$",
        description="PyTorch CUDA caching-allocator settings (PYTORCH_CUDA_ALLOC_CONF syntax) for every process, "
        "unless PYTORCH_CUDA_ALLOC_CONF is already set; null = PyTorch's defaults. Expandable segments keep "
        "peak reserved close to peak allocated when batch-sized blocks vary",
    )


class DistributedConfig(Section):
    # Processes to start on this machine when not already under torchrun.
    nproc: int = Field(1, gt=0)
    backend: Literal["auto", "gloo", "nccl"] = "auto"


def _own_directory(value: str | None) -> str | None:
    """``checkpoint.dir`` and ``logging.run_dir`` name a directory of the run's own: recpipe
    writes its files there (and deletes its older checkpoints). The empty string (the
    working directory), the filesystem's root, the home directory and the working
    directory itself hold what is not the run's: refused."""
    if value is None:
        return value
    if not value.strip():
        raise ValueError("is empty, which would be the working directory; name a directory of the run's own, "
                         "e.g. runs/NAME")
    try:
        path = Path(value).resolve()
    except (OSError, RuntimeError):  # a symbolic link loop: preflight's check_dir_paths names it (exit 6)
        return value
    shared = {Path(path.anchor): "the filesystem's root", Path.cwd().resolve(): "the working directory"}
    home = Path(os.path.expanduser("~"))  # "~" itself when there is no home to find
    if home.is_absolute():
        shared.setdefault(home.resolve(), "the home directory")
    if path in shared:
        raise ValueError(f"is {shared[path]} ({path}), which holds more than this run's files; name a directory of "
                         "the run's own, e.g. runs/NAME")
    return value


OwnDirectory = Annotated[str, AfterValidator(_own_directory)]


class CheckpointConfig(Section):
    # The run's checkpoints, DIR/step_<step>/ (null = none); a directory of the run's own:
    # '', '/', the home and the working directory are refused.
    dir: OwnDirectory | None = None
    every: int = Field(0, ge=0, description="steps between checkpoints; 0 = only at the end")
    resume: bool = True
    keep: int = Field(2, gt=0)
    # On SIGTERM / SIGINT / SIGHUP (preemption) every rank finishes its step, drains the
    # pipeline and, with this on and a dir set, saves a checkpoint before exiting 143 / 130 / 129.
    on_preempt: bool = True


class WandbConfig(Section):
    # Weights & Biases run of rank 0 (recpipe/train/wandb_logger.py): the TensorBoard
    # scalars, at the same steps. Needs the wandb package (an error before any process
    # starts without it).
    project: str = Field(min_length=1)
    entity: str | None = None  # team or user; null = the wandb login's default
    name: str | None = None  # run name; null = W&B picks one
    # online: sync while training; offline: write logging.run_dir/wandb only (`wandb sync`
    # later); disabled: wandb calls do nothing.
    mode: Literal["online", "offline", "disabled"] = "online"


class LoggingConfig(Section):
    # Rank 0's config.yaml, summary.json and TensorBoard events; a directory of the run's
    # own: '', '/', the home and the working directory are refused.
    run_dir: OwnDirectory = "runs/default"
    tensorboard: bool = True
    wandb: WandbConfig | None = None  # null = no W&B logging


class RecpipeConfig(Section):
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    sharding: ShardingConfig = ShardingConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    pipeline: PipelineSection = Field(default_factory=lambda: options_of(PIPELINES["base"])())
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
        ``--set`` does on the YAML (a full dump would pin them to the old default), and the
        ``data`` and ``pipeline`` sections the keys written (``pipeline``: and its name), which
        rules tell from defaults (``data.source`` beside ``data.factory``; a written speed
        feature's section, ``recpipe.preflight``)."""
        raw = self.model_dump(mode="json")
        raw["sharding"]["tables"] = {name: spec.model_dump(mode="json", exclude_unset=True)
                                     for name, spec in self.sharding.tables.items()}
        raw["data"] = self.data.model_dump(mode="json", exclude_unset=True)
        raw["pipeline"] = {"name": self.pipeline.name, **self.pipeline.model_dump(mode="json", exclude_unset=True)}
        return raw

    def table_sharding(self) -> dict[str, TableSharding]:
        """Resolved sharding of every table, by table name. A ``model.factory`` model's
        tables are known only once it is built: then the configured tables plus
        ``sharding.default`` (under that key), which is what config-time rules can
        check; ``recpipe.table_sharding.checks.validated_tables`` checks the real ones."""
        if self.model.factory is not None:
            return {**self.sharding.tables, "sharding.default": self.sharding.default}
        return {name: self.sharding.for_table(name) for name in self.model.table_names}

    @property
    def cache_line_locking(self) -> bool:
        """FBGEMM's cache-line locking (its ``prefetch_pipeline`` mode) for the UVM-cached
        tables: on exactly when the pipeline has a prefetch step that prefetches batch i+1
        before backward(i) (``recpipe.capabilities.PREFETCH_STEP``: ``prefetch``) and some
        table is ``fused_uvm_caching``."""
        return PREFETCH_STEP in PIPELINES[self.pipeline.name].offers and any(
            t.kernel == "fused_uvm_caching" for t in self.table_sharding().values())

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _accumulation_problems(cfg: RecpipeConfig) -> list[str]:
    """What ``train.accumulate_steps`` > 1 cannot run with (recpipe/pipelines/accumulation.py)."""
    steps = cfg.train.accumulate_steps
    if steps == 1:
        return []
    key = f"train.accumulate_steps={steps}"
    problems = []
    if cfg.pipeline.name == "semi_sync":
        problems.append(f"{key}: pipeline.name='semi_sync' splits a batch's backward and steps the dense optimizer "
                        "on the previous batch's gradient; use sparse_dist, fused_sparse_dist or prefetch")
    if cfg.pipeline.step_graph.enabled:
        problems.append(f"{key}: pipeline.step_graph replays zero_grad, backward and both optimizers of a batch as "
                        "one CUDA graph, which cannot skip the dense step; set pipeline.step_graph=false")
    if cfg.pipeline.cuda_graphs.enabled:
        problems.append(f"{key}: pipeline.cuda_graphs: micro-batches through the captured dense part do not train "
                        "as the large batch on CUDA (the losses differ beyond float rounding, docs/pipelines.md); set "
                        "pipeline.cuda_graphs=false")
    if cfg.train.on_nonfinite == "skip_step":
        problems.append(f"{key}: train.on_nonfinite=skip_step skips one batch's update, not an optimizer step of "
                        "several micro-batches; use train.on_nonfinite=error")
    return problems


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
    problems += _accumulation_problems(cfg)
    cached = [n for n, t in cfg.table_sharding().items() if t.kernel == "fused_uvm_caching"]
    if sh.prefetch_passes > 1 and not cfg.cache_line_locking:
        problems.append(
            f"sharding.prefetch_passes={sh.prefetch_passes} (multi-pass prefetch) needs pipeline.name='prefetch' "
            f"(got {cfg.pipeline.name!r}) and a table with kernel 'fused_uvm_caching' "
            f"({'none is configured' if not cached else 'cached: ' + ', '.join(cached)})"
        )
    if cfg.train.device == "cpu" and any(
        t.kernel in ("fused_uvm", "fused_uvm_caching") for t in cfg.table_sharding().values()
    ):
        problems.append(
            "train.device='cpu' but some tables use a UVM kernel (fused_uvm / "
            "fused_uvm_caching), which needs a CUDA GPU"
        )
    syn = cfg.data.synthetic
    if cfg.train.device == "cpu" and syn.device == "cuda":
        problems.append("data.synthetic.device='cuda' makes the batches on the rank's GPU, but train.device='cpu'")
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


# recpipe.preflight's, and recpipe.sharding's if a run gets past it.
PLANNER_ON_CPU = ("sharding.placement='planner' places shards by their GPU memory (torchrec's partitioner on "
                  "recpipe's HBM estimates); this run is on CPU: use sharding.placement=config, which places them "
                  "as sharding.default / sharding.tables say")


# -------------------------------------------------------------- loading
# The largest config file read. Shipped configs are under 3 KB and a config of a thousand
# tables or features a few hundred KB; PyYAML's pure-Python parser (whose messages are the
# ones quoted) is slow on a busy core, and this limit keeps the largest file to seconds of
# parsing. Checked before the file is read.
MAX_CONFIG_BYTES = 1 << 20
# Deeper nesting than any config needs (pipeline.cuda_graphs.x is 3 levels): a limit, so
# that a file of brackets is a one-line error, not a RecursionError of the parser.
MAX_CONFIG_DEPTH = 64


class _RefusedYAML(yaml.MarkedYAMLError):
    """YAML that parses but is not allowed in a config (aliases, duplicate keys, nesting)."""


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader for configs: no aliases (``*name``: a few lines of them expand
    to billions of nodes when the config is copied or dumped), no key given twice in a
    mapping (YAML keeps the last one silently), at most ``MAX_CONFIG_DEPTH`` levels."""

    def __init__(self, stream: str, root: str = "") -> None:
        super().__init__(stream)
        # The key nodes and list indices down to the node being composed, under ``root``
        # (the key of a --set value).
        self._path: list[Any] = [root] if root else []
        self._under_root = len(self._path)

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            alias = self.peek_event()
            raise _RefusedYAML(problem=f"a YAML alias (*{alias.anchor}) is not allowed in a config: write the value "
                                       "out (sharding.default holds what the tables share)",
                               problem_mark=alias.start_mark)
        if len(self._path) - self._under_root >= MAX_CONFIG_DEPTH:
            raise _RefusedYAML(problem=f"nested more than {MAX_CONFIG_DEPTH} levels deep",
                               problem_mark=self.peek_event().start_mark)
        self._path.append(index)
        try:
            return super().compose_node(parent, index)
        finally:
            self._path.pop()

    def compose_mapping_node(self, anchor: Any) -> Any:
        node = super().compose_mapping_node(anchor)
        first: dict[tuple[str, str], Any] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode):
                continue
            earlier = first.setdefault((key.tag, key.value), key)
            if earlier is not key:
                raise _RefusedYAML(problem=f"{self._key_path(key.value)} is given twice (first on line "
                                           f"{earlier.start_mark.line + 1}); YAML would keep only the last: give "
                                           "each key once", problem_mark=key.start_mark)
        return node

    def _key_path(self, key: str) -> str:
        """``key``'s dotted path in the document (``train.device``, ``a.b[2].c``)."""
        path = ""
        for part in [*self._path, key]:
            if isinstance(part, int):
                path += f"[{part}]"
            elif part is not None:
                value = part.value if isinstance(part, yaml.ScalarNode) else str(part)
                path += f".{value}" if path else value
        return path


# Numbers in exponent form without a dot or an exponent sign (``1e12``, ``1e-3``, ``2.5e5``)
# are floats in YAML 1.2, and in every other config format; PyYAML follows YAML 1.1, which
# reads them as strings, and strings are never numbers here.
ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _load_yaml(text: str, root: str = "") -> Any:
    loader = ConfigLoader(text, root)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``["train.steps=50", ...]`` -> ``{"train.steps": 50}``; values are YAML scalars/lists,
    read as the config file is (:class:`ConfigLoader`)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {pair!r}: expected KEY=VALUE, e.g. --set train.steps=50")
        try:
            out[key.strip()] = _load_yaml(raw, key.strip()) if raw.strip() else None
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


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _config_bytes(p: Path) -> bytes:
    """The bytes of config file ``p``: a regular file of at most ``MAX_CONFIG_BYTES``,
    checked before it is opened (a FIFO would block, /dev/zero never end)."""
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(p)!r} does not exist ({missing_hint(str(p))})") from None
    except OSError as err:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {err.strerror or err}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = next((what for test, what in _FILE_KINDS if test(st.st_mode)), "not a file")
        raise ConfigError(f"config file {str(p)!r} is {kind}, not a regular file: --config names a YAML file")
    too_big = (f"config file {str(p)!r} is larger than {MAX_CONFIG_BYTES / 2**20:g} MiB, the most a config may be "
               "(configs are a few KB: is it the right file?)")
    if st.st_size > MAX_CONFIG_BYTES:
        raise ConfigError(too_big)
    try:
        with open(p, "rb") as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {err.strerror or err}") from None
    if len(data) > MAX_CONFIG_BYTES:  # it grew since
        raise ConfigError(too_big)
    return data


def _read_yaml(p: Path) -> Any:
    """The YAML document in file ``p``; ConfigError naming the file (and the line) when it is
    not a regular file, is too large, is not UTF-8 (what YAML files are), is not valid YAML,
    or holds what a config may not (:class:`ConfigLoader`)."""
    data = _config_bytes(p)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise ConfigError(f"config file {str(p)!r}, line {line}, column {column}: byte 0x{data[err.start]:02x} is "
                          "not UTF-8 text (save the file as UTF-8)") from None
    try:
        return _load_yaml(text)
    except _RefusedYAML as err:
        raise ConfigError(f"config file {str(p)!r}, {_yaml_problem(err)}") from None
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


def _allowed_keys(loc: tuple, raw: dict[str, Any]) -> list[str]:
    """Field names of the section at ``loc`` (a pydantic error location), for messages;
    the ``pipeline`` section's are those of the pipeline ``raw`` names."""
    model: Any = RecpipeConfig
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        if isinstance(part, int) or model is None or part not in model.model_fields:
            return []
        if part == "tables":  # dict of table name -> TableSharding
            model = TableSharding
            parts = parts[1:]
            continue
        if model is RecpipeConfig and part == "pipeline":
            name = (raw.get("pipeline") or {}).get("name") if isinstance(raw.get("pipeline"), dict) else None
            model = options_of(PIPELINES[name]) if name in PIPELINES else options_model()
            continue
        ann = model.model_fields[part].annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return sorted(f.alias or n for n, f in model.model_fields.items()) if model is not None else []


def _unknown_key_message(key: str, allowed: list[str]) -> str:
    """``unknown key; did you mean 'steps'? allowed here: ...``: the closest allowed keys first."""
    if not allowed:
        return "unknown key"
    close = difflib.get_close_matches(key, allowed, n=2)
    hint = f"; did you mean {' or '.join(repr(k) for k in close)}?" if close else ";"
    return f"unknown key{hint} allowed here: {', '.join(allowed)}"


def _format_validation_error(err: ValidationError, source: str, raw: dict[str, Any]) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-"))
        msg = e["msg"].removeprefix("Value error, ")
        if loc == "pipeline" and msg.startswith("pipeline.name"):  # the registry's own message
            lines.append(f"  {msg}")
            continue
        if e["type"] == "extra_forbidden":
            msg = _unknown_key_message(str(e["loc"][-1]), _allowed_keys(e["loc"][:-1], raw))
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
        raise ConfigError(_format_validation_error(err, source, raw)) from None


def load_config(path: str | Path | None, overrides: list[str] | dict[str, Any] | None = None) -> RecpipeConfig:
    """Read YAML at ``path`` (None = all defaults), apply ``--set`` overrides, validate."""
    raw: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
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
