"""One timed run of one (pipeline, implementation) on one rank (:func:`run_local`: a fresh
model, then :func:`measure_steps`, the phases a caller with its own model runs too), its
typed :class:`RunResult`, and every rank's results combined into a row (:func:`combine`)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import yaml
from tqdm import tqdm

from recpipe.bench.measure import (MemorySnapshot, StepClock, cache_metrics, cached_tables, counter_delta,
                                   free_device_memory, populate_op, prefetch_unavailable, read_counters,
                                   summarize_ms, synchronize)
from recpipe.bench.report import Row
from recpipe.bench.torchrec_impl import build_torchrec_pipeline, dynamo_config_kept, pipelined_module_count
from recpipe.bench.trace import combine_ranks, profile_progress
from recpipe.config import ConfigError, RecpipeConfig, apply_override, config_from_dict
from recpipe.data import Batch
from recpipe.models import make_model
from recpipe.errors import PipelineError
from recpipe.pipelines.options import PipelineOptions
from recpipe.pipelines.registry import make_pipeline
from recpipe.sharding import shard_model

__all__ = ["DRAIN", "BenchOptions", "Build", "RunResult", "build_run", "combine", "config_for_pipeline",
           "fresh_batches", "gather", "measure_steps", "pipeline_options", "run_local", "split_variant", "untimed_steps"]

DRAIN = 3  # untimed batches after the timed (and traced) ones: TorchRec's SemiSync fetches three ahead


@dataclass(frozen=True)
class BenchOptions:
    """``recpipe bench``'s flags, checked (:func:`options_from_args`; defaults: ``recpipe.cli``)."""

    pipelines: tuple[str, ...]
    with_torchrec: bool
    steps: int
    warmup: int
    trace_steps: int  # profiled steps after the timed ones (trace.py); 0 = none
    out: str
    command: str = ""  # the bench invocation, for the record ('': this process's argv)
    profile: str | None = None  # file for torch.profiler op tables of the traced steps
    plots: bool = True
    rounds: int = 1  # every run repeated, interleaved (compare.round_order)

    @property
    def batches_per_run(self) -> int:
        return self.warmup + self.steps + self.trace_steps + DRAIN


Build = Callable[[RecpipeConfig, Any, Any, torch.device], Any]  # (cfg, model, optimizer, device) -> pipeline


@dataclass
class RunResult:
    """What one rank measured in one run (gathered from every rank, then :func:`combine`)."""

    status: str = "ok"  # ok | skipped | failed
    reason: str = ""
    pipeline_class: str = ""
    options: dict[str, Any] = field(default_factory=dict)  # the pipeline's constructor options
    notes: list[str] = field(default_factory=list)
    build_s: float = 0.0
    first_step_s: float = 0.0  # the first progress() call, to the device's end (compiles, captures)
    times_ms: list[float] = field(default_factory=list)  # per timed step (StepClock)
    host_ms: list[float] = field(default_factory=list)  # host time inside each timed call
    wall_s: float = 0.0  # host wall time of the timed steps
    memory: dict[str, Any] = field(default_factory=dict)  # MemorySnapshot.as_gib()
    pipelined: int | None = None  # TorchRec: sharded modules it pipelined
    cache_counters: list[dict[str, int]] | None = None  # per cached TBE, over the timed steps
    cache_reason: str = ""  # why a prefetch row has no cache metrics
    populate_op: str = ""  # the profiler name of the cache insert the pipeline runs
    trace: dict[str, Any] | None = None  # summarize_trace of the profiled steps, or its failure

    def fail(self, err: BaseException) -> "RunResult":
        first = (str(err).strip().splitlines() or [""])[0]
        self.status, self.reason = "failed", f"{type(err).__name__}: {first[:300]}"
        return self


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (collective)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def fresh_batches(batches: list[Batch]) -> Iterator[Batch]:
    """The same tensors in new Batch/KJT objects: KJT caches (offsets, ...) that one
    pipeline computes on a host batch must not make the next one's copies bigger."""
    return iter([dataclasses.replace(b, sparse_features=copy.copy(b.sparse_features)) for b in batches])


def _is_pipeline_key(key: str) -> bool:
    """A variant's key is a ``pipeline.<key>`` option, nested ones included
    (``cuda_graphs.optimizer``), unless it starts with another config section."""
    return key.split(".")[0] not in RecpipeConfig.model_fields


def split_variant(label: str) -> tuple[str, dict[str, Any]]:
    """``"semi_sync:output_dist_wait=early+start_batch=2"`` -> ``("semi_sync", {"output_dist_wait":
    "early", "start_batch": 2})`` (values read as YAML). A key that does not start with a config
    section is a ``pipeline.<key>`` option (``cuda_graphs.optimizer=false`` sets one key of that
    section); a key that does, any other config key but ``data.*`` (every run has the same batches)."""
    name, _, options = label.partition(":")
    pairs = [item.partition("=") for item in options.split("+") if item]
    bad = [key for key, eq, _ in pairs if not eq or not key]
    if bad or (options and not pairs):
        raise ConfigError(f"pipeline variant {label!r}: write name:key=value+key=value (pipeline.<key> options "
                          "or dotted config keys)")
    refused = [key for key, _, _ in pairs if key.strip().split(".")[0] in ("data", "pipeline")]
    if refused:
        raise ConfigError(f"pipeline variant {label!r}: {', '.join(refused)}: a variant cannot set data.* (all runs "
                          "share the pregenerated batches; use --set) nor pipeline.* by its dotted name (write the "
                          "bare pipeline option)")
    return name, {key.strip(): yaml.safe_load(value) for key, _, value in pairs}


def pipeline_options(options: dict[str, Any]) -> dict[str, Any]:
    """The ``pipeline.<key>`` options of a variant (the other keys are other config keys)."""
    return {k: v for k, v in options.items() if _is_pipeline_key(k)}


def config_for_pipeline(cfg: RecpipeConfig, label: str) -> tuple[RecpipeConfig | None, dict[str, Any], str]:
    """(config to run ``label`` with, its overrides versus ``cfg``, skip reason or ''):
    ``cfg`` with ``pipeline.name`` set (its pipeline options kept only for the pipeline
    it names; the common ones always), a variant's keys, and ``prefetch`` alone locking
    cache lines. ``label``: a pipeline name or a variant (:func:`split_variant`)."""
    name, options = split_variant(label)
    raw = cfg.editable_dump()
    overrides: dict[str, Any] = {}
    for key, value in options.items():
        if not _is_pipeline_key(key):
            apply_override(raw, key, value)
            overrides[key] = value
    probe = config_from_dict(raw, f"bench config for {label}") if overrides else cfg
    if name == "prefetch" and prefetch_unavailable(probe):
        return None, overrides, prefetch_unavailable(probe)
    if name != cfg.pipeline.name:
        common = {k: v for k, v in raw["pipeline"].items() if k in PipelineOptions.model_fields and k != "name"}
        raw["pipeline"] = {"name": name, **common}
        overrides["pipeline.name"] = name
    pipe_opts = pipeline_options(options)
    for key, value in sorted(pipe_opts.items(), key=lambda kv: kv[0].count(".")):  # sections before their keys
        section = key.split(".")[0]
        if "." in key and isinstance(raw["pipeline"].get(section), bool):  # the shorthand true/false
            raw["pipeline"][section] = {"enabled": raw["pipeline"][section]}
        apply_override(raw["pipeline"], key, value)
    overrides.update({f"pipeline.{k}": v for k, v in pipe_opts.items()})
    if name != "prefetch" and probe.cache_line_locking and probe.sharding.prefetch_passes != 1:
        raw["sharding"].update(prefetch_passes=1)  # multi-pass prefetch is the prefetch pipeline's
        overrides["sharding.prefetch_passes"] = 1
    try:
        return config_from_dict(raw, f"bench config for {name}"), overrides, ""
    except ConfigError as err:  # e.g. semi_sync on UVM-cached tables (no cache-line locking)
        return None, overrides, str(err).replace("\n", " ")


def untimed_steps(pipe: Any, it: Iterator[Batch], bar: tqdm, n: int | None = None) -> None:
    """``n`` untimed steps (None: until StopIteration, the drain)."""
    for _ in itertools.count() if n is None else range(n):
        try:
            pipe.progress(it)
        except StopIteration:
            if n is None:
                return
            raise
        bar.update(1)


def build_run(cfg: RecpipeConfig, impl: str, device: torch.device, result: RunResult | None = None,
              build: Build | None = None) -> tuple[Any, Any]:
    """(sharded model, pipeline) on a fresh model from ``train.seed``. ``impl``: recpipe
    (``build``, default ``make_pipeline``), torchrec or torchrec_pt2. (model, None) with
    ``result`` skipped when the recpipe pipeline refuses the config."""
    result = result if result is not None else RunResult()
    torch.manual_seed(cfg.train.seed)
    # FBGEMM's cache counters (fbgemm-gpu 1.6, 1.8): a few atomics in its cache kernels, on every row alike
    stats = {"gather_uvm_cache_stats": True} if cached_tables(cfg) else {}
    sharded = shard_model(make_model(cfg), cfg, device, extra_fused_params=stats)
    if impl == "recpipe":
        try:
            pipe = (build or make_pipeline)(cfg, sharded.model, sharded.optimizer, device)
        except PipelineError as err:
            result.status, result.reason = "skipped", str(err)
            return sharded, None
        result.options = cfg.pipeline.model_dump(exclude={"name"})
    else:
        pipe, result.options, result.notes = build_torchrec_pipeline(
            cfg, sharded.model, sharded.optimizer, device, compiled=impl == "torchrec_pt2")
    result.pipeline_class = f"{type(pipe).__module__}.{type(pipe).__name__}"
    result.populate_op = populate_op(pipe)
    return sharded, pipe


def measure_steps(model: Any, pipe: Any, cfg: RecpipeConfig, batches: list[Batch], opts: BenchOptions,
                  device: torch.device, bar: tqdm, result: RunResult, memory: MemorySnapshot | None = None,
                  label: str = "") -> RunResult:
    """The phases of a run on a built model and pipeline: ``opts.warmup`` untimed steps,
    ``opts.steps`` timed ones (UVM-cache counters read around them), ``opts.trace_steps``
    profiled ones, then the drain; ``memory`` closes a phase after the warm-up and after
    the timed steps. Raises what the pipeline raises."""
    it = fresh_batches(batches)
    synchronize(device)
    started = time.perf_counter()
    untimed_steps(pipe, it, bar, 1)  # the first step: a compile or a capture shows here
    synchronize(device)
    result.first_step_s = time.perf_counter() - started
    untimed_steps(pipe, it, bar, opts.warmup - 1)
    if memory:
        memory.phase_done("warmup")  # synchronizes
    else:
        synchronize(device)  # the timed steps start on an idle device
    if result.pipeline_class.startswith("torchrec."):
        result.pipelined = pipelined_module_count(pipe)
    counters = read_counters(model) if cached_tables(cfg) and device.type == "cuda" else None
    if counters is None and cfg.pipeline.name == "prefetch":
        result.cache_reason = ("n/a: CPU run (no UVM cache)" if cached_tables(cfg)
                               else "n/a: no fused_uvm_caching table (no UVM cache)")
    clock, wall = StepClock(device), time.perf_counter()  # after the warm-up's synchronize
    for _ in range(opts.steps):
        clock.start()
        pipe.progress(it)
        clock.stop()
        bar.update(1)
    result.times_ms, result.host_ms = clock.times_ms(), clock.host_ms()  # synchronizes
    result.wall_s = time.perf_counter() - wall
    if counters is not None:
        result.cache_counters = counter_delta(counters, read_counters(model))
    if memory:
        memory.phase_done("timed")
    if opts.trace_steps:
        tables = (opts.profile, label or cfg.pipeline.name) if opts.profile else None
        try:
            result.trace = {"status": "ok", **profile_progress(pipe, it, opts.trace_steps, device, tables)}
        except Exception as err:  # noqa: BLE001 - the trace's failure, not the run's (a broken pipeline fails below)
            result.trace = {"status": "failed", "reason": f"{type(err).__name__}: {str(err).strip()[:300]}"}
        bar.update(opts.trace_steps)
    untimed_steps(pipe, it, bar)
    return result


def run_local(cfg: RecpipeConfig, impl: str, batches: list[Batch], opts: BenchOptions, device: torch.device,
              bar: tqdm, label: str | None = None, build: Build | None = None) -> RunResult:
    """This rank's run on a fresh model; never raises (the error goes into the result).
    ``label``: the row's name in ``--profile``'s tables (default the pipeline's)."""
    result = RunResult()
    pipe = sharded = None
    bar_end = bar.n + len(batches)  # every batch of the run ticks the bar once, whatever happens
    free_device_memory(device)
    memory = MemorySnapshot.begin(device)
    try:
        with dynamo_config_kept() if impl == "torchrec_pt2" else contextlib.nullcontext():
            built = time.perf_counter()
            sharded, pipe = build_run(cfg, impl, device, result, build)
            if pipe is None:
                return result
            memory.built()
            result.build_s = time.perf_counter() - built
            measure_steps(sharded.model, pipe, cfg, batches, opts, device, bar, result, memory,
                          f"{label or cfg.pipeline.name}/{impl}")
    except Exception as err:  # noqa: BLE001 - recorded on the row; recpipe failures also fail the exit code
        result.fail(err)
        if impl == "recpipe":
            traceback.print_exc()
    finally:
        result.memory = memory.as_gib()
        bar.update(max(bar_end - bar.n, 0))
        del pipe, sharded
        free_device_memory(device)
    return result


def combine(row: Row, per_rank: list[RunResult], global_batch: int, steps: int) -> Row:
    """Fill ``row`` from every rank's result: a step's time is the slowest rank's."""
    first = per_rank[0]
    row.pipeline_class, row.options, row.notes = first.pipeline_class, first.options, list(first.notes)
    bad = [(i, r) for i, r in enumerate(per_rank) if r.status != "ok"]
    if bad:
        row.status = "failed" if any(r.status == "failed" for _, r in bad) else "skipped"
        reasons = dict.fromkeys(r.reason for _, r in bad)
        row.reason = " | ".join(reasons) + ("" if len(bad) == len(per_rank) else f" (ranks {[i for i, _ in bad]})")
        return row
    row.step_ms_per_step = [max(ts) for ts in zip(*(r.times_ms for r in per_rank))]
    row.host_ms_per_step = [max(ts) for ts in zip(*(r.host_ms for r in per_rank))]
    row.step_ms_p50_per_rank = [summarize_ms(r.times_ms)["p50"] for r in per_rank]
    row.wall_s, row.build_s = max(r.wall_s for r in per_rank), max(r.build_s for r in per_rank)
    row.first_step_s = max(r.first_step_s for r in per_rank)
    mems = [r.memory for r in per_rank]
    if mems[0]:
        row.memory = {k: max(m[k] for m in mems) if mems[0][k] is not None else None for k in mems[0]}
        row.memory["per_rank"] = mems
    if first.trace is not None:
        row.trace = combine_ranks([r.trace for r in per_rank])
    row.fill_rates(global_batch)
    if first.cache_counters is not None:
        row.cache = cache_metrics([r.cache_counters for r in per_rank], steps,
                                  [(r.trace or {}).get("cache") for r in per_rank], first.populate_op)
    elif first.cache_reason:
        row.cache = {"reason": first.cache_reason}
    if first.pipelined is not None:
        row.torchrec_pipelined_modules = first.pipelined
        if first.pipelined == 0:
            row.notes.append("TorchRec pipelined no sharded module (FX trace found no usable inputs): no overlap")
    return row
