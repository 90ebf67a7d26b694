"""One timed run of one (pipeline, implementation) on one rank (:func:`run_local`: a fresh model,
then :func:`measure_steps`), its :class:`RunResult`, and every rank's combined into a row."""

from __future__ import annotations

import contextlib
import copy
import itertools
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import yaml
from torchrec.distributed.train_pipeline import train_pipelines
from tqdm import tqdm

from recpipe.bench.measure import (MemorySnapshot, StepClock, cache_metrics, cached_tables, counter_delta,
                                   free_device_memory, populate_op, prefetch_unavailable, read_counters,
                                   summarize_ms, synchronize)
from recpipe.bench.report import Row
from recpipe.bench.trace import combine_ranks, profile_progress
from recpipe.builder import make_pipeline
from recpipe.compat import torch as compat_torch
from recpipe.compat import torchrec as compat_torchrec
from recpipe.config import ConfigError, RecpipeConfig, apply_override, config_from_dict
from recpipe.data import Batch
from recpipe.deterministic import apply_deterministic
from recpipe.data.loader import with_sized_workers, workers_kind_of
from recpipe.data.stream import BatchStream
from recpipe.errors import PipelineError
from recpipe.models import make_model
from recpipe.pipeline_options import options_model
from recpipe.pipelines.registry import PIPELINES
from recpipe.preflight import check_rules
from recpipe.sharding import shard_model
from recpipe.speedups.registry import SPEEDUPS

__all__ = ["DRAIN", "BenchOptions", "RunResult", "build_run", "build_torchrec_pipeline", "combine",
           "config_for_pipeline", "fed_as_trained", "fresh_batches", "gather", "measure_steps", "pipeline_options",
           "run_local", "split_variant", "Steps", "untimed_steps"]

DRAIN = 3  # untimed batches after the timed (and traced) ones: TorchRec's SemiSync fetches three ahead


@dataclass(frozen=True)
class BenchOptions:
    """``recpipe bench``'s flags, checked (``runner.options_from_args``; defaults: ``recpipe.cli``)."""

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
    check: bool = True  # each recpipe row against the same run in lockstep (runner.check_row)

    @property
    def batches_per_run(self) -> int:
        return self.warmup + self.steps + self.trace_steps + DRAIN


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
    losses: list[float] = field(default_factory=list)  # every step's loss (recpipe's pipelines), in order

    def fail(self, err: BaseException) -> "RunResult":
        self.status, self.reason = "failed", f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:300]}"
        return self


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (collective)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def fresh_batches(batches: list[Batch], device: torch.device | None = None) -> Iterator[Batch]:
    """The same tensors in new Batch/KJT objects: KJT caches (offsets, ...) that one
    pipeline computes on a host batch must not make the next one's copies bigger. On a
    CUDA ``device``, pinned copies (made now, for studies that hand a pipeline all of them)."""
    if device is not None and device.type == "cuda":
        return iter([b.pin_memory() for b in batches])
    return iter([replace(b, sparse_features=copy.copy(b.sparse_features)) for b in batches])


def fed_as_trained(cfg: RecpipeConfig, batches: list[Batch], device: torch.device) -> Iterator[Batch]:
    """``batches`` (made before the run, in pageable memory) handed to the pipeline the way the
    trainer's loader hands its batches: made by ``data.num_workers`` producers (at least one;
    processes, or threads where the loader uses threads: ``workers_kind_of``), each batch copied
    into a buffer of its own, pinned on CUDA, from torch's caching host allocator, which gives it
    back to the next batches once the copies made from it are done. So a run reuses host memory
    as training does, and a pipeline that reads a batch's memory after it was reused trains on
    other data here too (the row's check then says so). Each batch's objects are new: KJT caches
    one run computes on a host batch do not reach the next."""
    pin = device if device.type == "cuda" else None
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    workers = with_sized_workers(cfg, rank=rank, world_size=world)[0].data.num_workers  # auto: as the trainer sizes it
    return iter(BatchStream(batches.__getitem__, 0, len(batches), max(workers, 1), pin, workers_kind_of(cfg)))


def split_variant(label: str) -> tuple[str, dict[str, Any]]:
    """``"semi_sync:output_dist_wait=early+start_batch=2"`` -> ``("semi_sync", {"output_dist_wait":
    "early", "start_batch": 2})``, values read as YAML (docs/benchmarking.md, ``--pipelines``)."""
    name, _, options = label.partition(":")
    pairs = [item.partition("=") for item in options.split("+") if item]
    if any(not eq or not key for key, eq, _ in pairs) or (options and not pairs):
        raise ConfigError(f"pipeline variant {label!r}: write name:key=value+key=value (pipeline.<key> options "
                          "or dotted config keys)")
    if refused := [key for key, _, _ in pairs if key.strip().split(".")[0] in ("data", "pipeline")]:
        raise ConfigError(f"pipeline variant {label!r}: {', '.join(refused)}: a variant cannot set data.* (all runs "
                          "share the pregenerated batches; use --set) nor pipeline.* by its dotted name (write the "
                          "bare pipeline option)")
    return name, {key.strip(): yaml.safe_load(value) for key, _, value in pairs}


def pipeline_options(options: dict[str, Any]) -> dict[str, Any]:
    """A variant's ``pipeline.<key>`` options (``cuda_graphs.optimizer`` too): keys not naming a config section."""
    return {k: v for k, v in options.items() if k.split(".")[0] not in RecpipeConfig.model_fields}


def config_for_pipeline(cfg: RecpipeConfig, label: str) -> tuple[RecpipeConfig | None, dict[str, Any], str]:
    """(config to run ``label``, a pipeline or a variant, with; its overrides versus ``cfg``; skip
    reason or ''): ``cfg`` with ``pipeline.name`` set (its pipeline options kept only for the pipeline
    it names, the common ones always), the variant's keys, and ``prefetch`` alone locking cache lines."""
    name, options = split_variant(label)
    pipe_opts = pipeline_options(options)
    raw = cfg.editable_dump()
    overrides = {key: value for key, value in options.items() if key not in pipe_opts}
    for key, value in overrides.items():
        apply_override(raw, key, value)
    probe = config_from_dict(raw, f"bench config for {label}") if overrides else cfg
    if name == "prefetch" and prefetch_unavailable(probe):
        return None, overrides, prefetch_unavailable(probe)
    if name != cfg.pipeline.name:
        common = {k: v for k, v in raw["pipeline"].items()
                  if k in options_model().model_fields and k not in ("name", "class")}
        raw["pipeline"] = {"name": name, **common}
        overrides["pipeline.name"] = name
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
        run = config_from_dict(raw, f"bench config for {name}")
        check_rules(run)
        return run, overrides, ""
    except ConfigError as err:  # e.g. semi_sync on UVM-cached tables (no cache-line locking)
        return None, overrides, str(err).replace("\n", " ")


def build_torchrec_pipeline(cfg: RecpipeConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            device: torch.device, compiled: bool = False) -> tuple[Any, dict[str, Any], list[str]]:
    """TorchRec's pipeline of the role of ``cfg.pipeline.name`` (``PipelineDef.torchrec``) on the same model:
    (pipeline, its options, notes on what has no TorchRec counterpart: never silently dropped). ``compiled``:
    ``TrainPipelinePT2`` with ``TorchCompileConfig()`` defaults (for ``base``). TorchRec 1.6 and 1.8 take these
    arguments; some versions do not export ``TrainPipelineSemiSync`` from the package, hence the module."""
    p = cfg.pipeline
    notes: list[str] = []
    if p.max_batches_ahead is not None:
        notes.append(f"pipeline.max_batches_ahead={p.max_batches_ahead} has no TorchRec counterpart")
    notes += [f"pipeline.{f.name} is recpipe's: {f.torchrec_note}"
              for f in SPEEDUPS.values() if f.torchrec_note is not None and f.enabled(p)]
    if p.inputs:
        notes.append(f"pipeline.inputs {sorted(p.inputs)} has no TorchRec counterpart here")
    kwargs, own_notes = PIPELINES[p.name].torchrec_options(p)
    notes += own_notes
    if compiled:
        assert p.name == "base", p.name
        config = train_pipelines.TorchCompileConfig()
        pipe = train_pipelines.TrainPipelinePT2(model, optimizer, device, compile_configs=config)
        return pipe, {"compile_configs": asdict(config)}, notes
    name = PIPELINES[p.name].torchrec
    if name is None:
        raise PipelineError(f"pipeline {p.name!r} has no TorchRec counterpart")
    return getattr(train_pipelines, name)(model, optimizer, device, **kwargs), kwargs, notes


class Steps:
    """``pipe.progress(it)``, keeping every step's loss (recpipe's pipelines: ``last_loss``, a device
    tensor read after the run); in ``lockstep`` the host then waits for the device, so that no step
    runs ahead of the one before (a row's reference run)."""

    def __init__(self, pipe: Any, it: Iterator[Batch], device: torch.device, lockstep: bool = False) -> None:
        self.pipe, self.it, self.device, self.lockstep = pipe, it, device, lockstep
        self.losses: list[torch.Tensor] = []

    def __call__(self) -> None:
        self.pipe.progress(self.it)
        loss = getattr(self.pipe, "last_loss", None)
        if loss is not None:
            self.losses.append(loss)
        if self.lockstep:
            synchronize(self.device)

    def loss_values(self) -> list[float]:
        """Host sync: every kept loss."""
        return torch.stack([t.detach().reshape(()).float() for t in self.losses]).tolist() if self.losses else []


def untimed_steps(step: Steps, bar: tqdm, n: int | None = None) -> None:
    """``n`` untimed steps (None: until StopIteration, the drain)."""
    try:
        for _ in itertools.count() if n is None else range(n):
            step()
            bar.update(1)
    except StopIteration:
        if n is not None:
            raise


def build_run(cfg: RecpipeConfig, impl: str, device: torch.device, result: RunResult | None = None,
              build: Callable[..., Any] | None = None) -> tuple[Any, Any]:
    """(sharded model, pipeline or None if recpipe's refuses the config) on a fresh model from ``train.seed``;
    ``impl``: recpipe (``build(cfg, model, optimizer, device)``, default ``make_pipeline``) or torchrec(_pt2)."""
    result = RunResult() if result is None else result
    apply_deterministic(cfg.train.deterministic)  # a variant may set it (train.deterministic=false)
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
                  label: str = "", lockstep: bool = False) -> RunResult:
    """The phases of a run on a built pipeline: warm-up, timed steps (UVM-cache counters read around them),
    profiled steps, the drain; ``memory`` closes a phase after the warm-up and the timed steps. Every
    step's loss goes into ``result.losses``; ``lockstep``: the host waits for the device after each step."""
    memory = memory or MemorySnapshot(cuda=False)  # None: no allocator snapshots
    step = Steps(pipe, fed_as_trained(cfg, batches, device), device, lockstep)
    synchronize(device)
    started = time.perf_counter()
    untimed_steps(step, bar, 1)  # the first step: a compile or a capture shows here
    synchronize(device)
    result.first_step_s = time.perf_counter() - started
    untimed_steps(step, bar, opts.warmup - 1)
    synchronize(device)  # the timed steps start on an idle device
    memory.phase_done("warmup")
    if result.pipeline_class.startswith("torchrec."):
        # The sharded modules TorchRec's FX trace of the first batch could pipeline (it only logs one it
        # cannot; 0: no overlap); None: it rewrites none.
        modules = compat_torchrec.pipelined_modules(pipe)
        result.pipelined = None if modules is None else len(modules)
    counters = read_counters(model) if cached_tables(cfg) and device.type == "cuda" else None
    if counters is None and cfg.pipeline.name == "prefetch":
        result.cache_reason = ("n/a: CPU run (no UVM cache)" if cached_tables(cfg)
                               else "n/a: no fused_uvm_caching table (no UVM cache)")
    clock, wall = StepClock(device, lambda: getattr(pipe, "host_wait_s", 0.0)), time.perf_counter()
    for _ in range(opts.steps):
        clock.start()
        step()
        clock.stop()
        bar.update(1)
    result.times_ms, result.host_ms = clock.times_ms(), clock.host_ms()  # synchronizes
    result.wall_s = time.perf_counter() - wall
    if counters is not None:
        result.cache_counters = counter_delta(counters, read_counters(model))
    memory.phase_done("timed")
    if opts.trace_steps:
        tables = (opts.profile, label or cfg.pipeline.name) if opts.profile else None
        try:
            result.trace = {"status": "ok", **profile_progress(step, opts.trace_steps, device, tables)}
        except Exception as err:  # noqa: BLE001 - the trace's failure, not the run's (a broken pipeline fails below)
            result.trace = {"status": "failed", "reason": f"{type(err).__name__}: {str(err).strip()[:300]}"}
        bar.update(opts.trace_steps)
    untimed_steps(step, bar)
    result.losses = step.loss_values()
    return result


def run_local(cfg: RecpipeConfig, impl: str, batches: list[Batch], opts: BenchOptions, device: torch.device,
              bar: tqdm, label: str | None = None, build: Callable[..., Any] | None = None,
              lockstep: bool = False) -> RunResult:
    """This rank's run of ``label`` (default: the pipeline) on a fresh model; errors go into the result.
    ``lockstep``: the host waits for the device after every step (a row's reference run)."""
    result = RunResult()
    pipe = sharded = None
    bar_end = bar.n + len(batches)  # every batch of the run ticks the bar once, whatever happens
    free_device_memory(device)
    memory = MemorySnapshot.begin(device)
    try:
        with compat_torch.dynamo_config_kept() if impl == "torchrec_pt2" else contextlib.nullcontext():
            built = time.perf_counter()
            sharded, pipe = build_run(cfg, impl, device, result, build)
            if pipe is None:
                return result
            memory.built()
            result.build_s = time.perf_counter() - built
            measure_steps(sharded.model, pipe, cfg, batches, opts, device, bar, result, memory,
                          f"{label or cfg.pipeline.name}/{impl}", lockstep)
    except Exception as err:  # noqa: BLE001 - recorded on the row; recpipe failures also fail the exit code
        result.fail(err)
        if impl == "recpipe":
            traceback.print_exc()
        elif why := torchrec_cannot_run(err, device):
            result.status, result.reason = "skipped", why
    finally:
        result.memory = memory.as_gib()
        bar.update(max(bar_end - bar.n, 0))
        del pipe, sharded
        free_device_memory(device)
    return result


def torchrec_cannot_run(err: BaseException, device: torch.device) -> str | None:
    """Why a TorchRec pipeline cannot run here, for an error known to mean that, else None.

    On CPU, TorchRec's TrainPipelineFusedSparseDist and TrainPipelineSemiSync hand each
    batch's KJTs to their embedding-lookup stream with ``record_stream``; torchrec (1.6.1,
    1.8) has no such stream on CPU and passes None, which torch refuses with "unknown
    parameter type" (``_start_embedding_lookup`` in torchrec's train_pipeline/utils.py)."""
    if device.type == "cpu" and isinstance(err, RuntimeError) and "unknown parameter type" in str(err):
        return ("TorchRec's pipeline runs on CUDA only: it calls record_stream with its embedding-lookup stream, "
                "which is None on CPU (torchrec's _start_embedding_lookup: RuntimeError: unknown parameter type)")
    return None


def combine(row: Row, per_rank: list[RunResult], global_batch: int, steps: int) -> Row:
    """Fill ``row`` from every rank's result: a step's time is the slowest rank's."""
    first = per_rank[0]
    row.pipeline_class, row.options, row.notes = first.pipeline_class, first.options, list(first.notes)
    if bad := [(i, r) for i, r in enumerate(per_rank) if r.status != "ok"]:
        row.status = "failed" if any(r.status == "failed" for _, r in bad) else "skipped"
        row.reason = (" | ".join(dict.fromkeys(r.reason for _, r in bad))
                      + ("" if len(bad) == len(per_rank) else f" (ranks {[i for i, _ in bad]})"))
        return row
    row.step_ms_per_step = [max(ts) for ts in zip(*(r.times_ms for r in per_rank))]
    row.host_ms_per_step = [max(ts) for ts in zip(*(r.host_ms for r in per_rank))]
    row.step_ms_p50_per_rank = [summarize_ms(r.times_ms)["p50"] for r in per_rank]
    row.step_losses = [r.losses for r in per_rank] if first.losses else []
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
