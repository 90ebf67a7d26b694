"""One timed run of one (pipeline, implementation) on one rank, and combining ranks.

``run_local`` is what every row of ``recpipe bench`` and every point of the multi-pass
sweep runs: free what the previous run left, build a fresh sharded model from
``train.seed`` (with FBGEMM's cache counters where tables are UVM-cached:
``uvm_cache``), build the pipeline (recpipe's, TorchRec's, or a ``RunProbe``'s), feed
it fresh copies of the same host batches (warm-up, timed steps, profiled steps:
``trace``, drain), and return a plain dict that ``combine`` turns into a ``Row``
once every rank's dict is gathered.
"""

from __future__ import annotations

import copy
import dataclasses
import time
import traceback
from typing import TYPE_CHECKING, Any, Iterator, Protocol

import torch
import torch.distributed as dist
import yaml
from tqdm import tqdm

from recpipe.bench.measure import MemorySnapshot, StepClock, free_device_memory, reserved_by_stream, summarize_ms
from recpipe.bench.report import Row
from recpipe.bench.torchrec_impl import build_torchrec_pipeline, pipelined_module_count
from recpipe.bench.trace import combine_ranks, profile_progress
from recpipe.bench.uvm_cache import (
    cache_metrics,
    counter_delta,
    prefetch_unavailable,
    read_counters,
    stats_fused_params,
    unavailable,
)
from recpipe.config import ConfigError, RecpipeConfig, apply_override, config_from_dict
from recpipe.data import Batch
from recpipe.models import make_model
from recpipe.errors import PipelineError
from recpipe.pipelines.options import PipelineOptions
from recpipe.pipelines.registry import make_pipeline
from recpipe.sharding import shard_model

if TYPE_CHECKING:
    from recpipe.bench.runner import BenchOptions

__all__ = ["RunProbe", "build_run", "combine", "config_for_pipeline", "fresh_batches", "gather", "run_local",
           "split_variant", "timed_steps", "traced_steps", "untimed_steps"]

class RunProbe(Protocol):
    """Builds the recpipe pipeline of a run instead of ``make_pipeline`` (e.g. a
    subclass with timing hooks) and reads what it measured after the timed steps."""

    def build(self, cfg: RecpipeConfig, model: Any, optimizer: Any, device: torch.device) -> Any: ...

    def collect(self, pipe: Any) -> dict[str, Any]: ...


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (collective)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def fresh_batches(batches: list[Batch]) -> Iterator[Batch]:
    """The same tensors in new Batch/KJT objects: KJT caches (offsets, ...) that one
    pipeline computes on a host batch must not make the next one's copies bigger."""
    return iter([dataclasses.replace(b, sparse_features=copy.copy(b.sparse_features)) for b in batches])


def split_variant(label: str) -> tuple[str, dict[str, Any]]:
    """``"semi_sync:output_dist_wait=early+start_batch=2"`` -> ``("semi_sync",
    {"output_dist_wait": "early", "start_batch": 2})``: a pipeline with its own options
    (values read as YAML), so variants run in one interleaved bench. A key without a dot
    is a ``pipeline.<key>`` option; a dotted key is any other config key
    (``sparse_dist:sharding.default.weights_precision=fp16``) except ``data.*``: every
    run of a bench trains on the same pregenerated batches."""
    name, _, options = label.partition(":")
    pairs = [item.partition("=") for item in options.split("+") if item]
    bad = [key for key, eq, _ in pairs if not eq or not key]
    if bad or (options and not pairs):
        raise ConfigError(f"pipeline variant {label!r}: write name:key=value+key=value (pipeline.<key> options "
                          "or dotted config keys)")
    refused = [key for key, _, _ in pairs if key.strip().split(".")[0] in ("data", "pipeline") and "." in key]
    if refused:
        raise ConfigError(f"pipeline variant {label!r}: {', '.join(refused)}: a variant cannot set data.* (all runs "
                          "share the pregenerated batches; use --set) nor pipeline.* by its dotted name (write the "
                          "bare pipeline option)")
    return name, {key.strip(): yaml.safe_load(value) for key, _, value in pairs}


def pipeline_options(options: dict[str, Any]) -> dict[str, Any]:
    """The ``pipeline.<key>`` options of a variant (``split_variant``); the dotted keys
    are other config keys, which TorchRec's pipelines take as well."""
    return {k: v for k, v in options.items() if "." not in k}


def config_for_pipeline(cfg: RecpipeConfig, label: str) -> tuple[RecpipeConfig | None, dict[str, Any], str]:
    """(config to run ``label`` with, its overrides versus ``cfg``, skip reason or '');
    ``label`` is a pipeline name or a variant (``split_variant``)."""
    name, options = split_variant(label)
    raw = cfg.editable_dump()
    overrides: dict[str, Any] = {}
    for key, value in options.items():
        if "." in key:
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
    raw["pipeline"].update(pipe_opts)
    overrides.update({f"pipeline.{k}": v for k, v in pipe_opts.items()})
    if name != "prefetch" and probe.cache_line_locking and probe.sharding.prefetch_passes != 1:
        raw["sharding"].update(prefetch_passes=1)  # multi-pass prefetch is the prefetch pipeline's
        overrides["sharding.prefetch_passes"] = 1
    try:
        return config_from_dict(raw, f"bench config for {name}"), overrides, ""
    except ConfigError as err:  # e.g. semi_sync on UVM-cached tables (no cache-line locking)
        return None, overrides, str(err).replace("\n", " ")


def untimed_steps(pipe: Any, it: Iterator[Batch], bar: tqdm, n: int | None = None) -> int:
    """``n`` untimed steps (None: until StopIteration, the drain); returns how many ran."""
    done = 0
    while n is None or done < n:
        try:
            pipe.progress(it)
        except StopIteration:
            if n is None:
                break
            raise
        done += 1
        bar.update(1)
    return done


def build_run(cfg: RecpipeConfig, impl: str, device: torch.device, probe: RunProbe | None,
           out: dict[str, Any]) -> tuple[Any, Any]:
    """(sharded model, pipeline) on a fresh model from ``train.seed``; (model, None)
    with ``out`` marked skipped when the recpipe pipeline refuses the config."""
    torch.manual_seed(cfg.train.seed)
    sharded = shard_model(make_model(cfg), cfg, device, extra_fused_params=stats_fused_params(cfg))
    if impl == "recpipe":
        try:
            build = probe.build if probe is not None else make_pipeline
            pipe = build(cfg, sharded.model, sharded.optimizer, device)
        except PipelineError as err:
            out.update(status="skipped", reason=str(err))
            return sharded, None
        out["options"] = cfg.pipeline.model_dump(exclude={"name"})
    else:
        pipe, out["options"], out["notes"] = build_torchrec_pipeline(cfg, sharded.model, sharded.optimizer, device)
    out["cls"] = f"{type(pipe).__module__}.{type(pipe).__name__}"
    return sharded, pipe


def timed_steps(pipe: Any, it: Iterator[Batch], steps: int, device: torch.device, bar: tqdm, out: dict[str, Any]) -> None:
    clock = StepClock(device)
    wall = time.perf_counter()  # after the warm-up's synchronize (phase_done)
    for _ in range(steps):
        clock.start()
        pipe.progress(it)
        clock.stop()
        bar.update(1)
    out["times_ms"] = clock.times_ms()  # synchronizes
    out["host_ms"] = clock.host_ms()
    out["wall_s"] = time.perf_counter() - wall


def traced_steps(pipe: Any, it: Iterator[Batch], opts: "BenchOptions", device: torch.device, title: str) -> dict[str, Any]:
    """``trace.profile_progress`` of ``opts.trace_steps`` calls; a failure of the
    profiler or of reading its trace is the trace's reason, not the run's."""
    tables = (opts.profile, title) if opts.profile else None
    try:
        return {"status": "ok", **profile_progress(pipe, it, opts.trace_steps, device, tables)}
    except Exception as err:  # noqa: BLE001 - a broken pipeline fails again in the drain
        return {"status": "failed", "reason": f"{type(err).__name__}: {str(err).strip()[:300]}"}


def run_local(
    cfg: RecpipeConfig, impl: str, batches: list[Batch], opts: "BenchOptions", device: torch.device, bar: tqdm,
    probe: RunProbe | None = None, label: str | None = None,
) -> dict[str, Any]:
    """This rank's run: warm-up, timed steps (cache counters read around them),
    traced steps, drain. Never raises (the error goes into the result). ``label``:
    the row's name in ``--profile``'s tables (a variant's full label); default the pipeline's."""
    out: dict[str, Any] = {"status": "ok", "reason": "", "notes": [], "options": {}, "cls": ""}
    pipe = sharded = None
    bar_end = bar.n + len(batches)  # every batch of the run ticks the bar once, whatever happens
    free_device_memory(device)
    memory = MemorySnapshot.begin(device)
    try:
        built = time.perf_counter()
        sharded, pipe = build_run(cfg, impl, device, probe, out)
        if pipe is None:
            return out
        memory.built()
        out["build_s"] = time.perf_counter() - built
        it = fresh_batches(batches)
        untimed_steps(pipe, it, bar, opts.warmup)
        memory.phase_done("warmup")
        if impl == "torchrec":
            out["pipelined"] = pipelined_module_count(pipe)
        why = unavailable(cfg, device)
        counters = read_counters(sharded.model) if not why else None
        if why and cfg.pipeline.name == "prefetch":
            out["cache_reason"] = why
        timed_steps(pipe, it, opts.steps, device, bar, out)
        if counters is not None:
            out["cache_counters"] = counter_delta(counters, read_counters(sharded.model))
        memory.phase_done("timed")
        if device.type == "cuda":
            out["reserved_by_stream"] = reserved_by_stream(device, pipe)
        if probe is not None:
            out["probe"] = probe.collect(pipe)
        if opts.trace_steps:
            out["trace"] = traced_steps(pipe, it, opts, device, f"{label or cfg.pipeline.name}/{impl}")
            bar.update(opts.trace_steps)
        untimed_steps(pipe, it, bar)
    except Exception as err:  # noqa: BLE001 - recorded on the row; recpipe failures also fail the exit code
        first = (str(err).strip().splitlines() or [""])[0]
        out.update(status="failed", reason=f"{type(err).__name__}: {first[:300]}")
        if impl == "recpipe":
            traceback.print_exc()
    finally:
        out["memory"] = memory.as_gib()
        bar.update(max(bar_end - bar.n, 0))
        del pipe, sharded
        free_device_memory(device)
    return out


def combine(row: Row, per_rank: list[dict[str, Any]], global_batch: int, steps: int) -> None:
    """Fill ``row`` from every rank's ``run_local`` result: a step's time is the slowest rank's."""
    statuses = [r["status"] for r in per_rank]
    first = per_rank[0]
    row.pipeline_class = first["cls"]
    row.options = first["options"]
    row.notes = list(first["notes"])
    if any(s != "ok" for s in statuses):
        bad = [(i, r) for i, r in enumerate(per_rank) if r["status"] != "ok"]
        row.status = "failed" if any(r["status"] == "failed" for _, r in bad) else "skipped"
        reasons = dict.fromkeys(r["reason"] for _, r in bad)
        row.reason = " | ".join(reasons) + ("" if len(bad) == len(per_rank) else f" (ranks {[i for i, _ in bad]})")
        return
    per_step = [max(ts) for ts in zip(*(r["times_ms"] for r in per_rank))]
    row.steps = steps
    row.step_ms = summarize_ms(per_step)
    row.step_ms_per_step = per_step
    row.step_ms_p50_per_rank = [summarize_ms(r["times_ms"])["p50"] for r in per_rank]
    row.round_p50_ms = [row.step_ms["p50"]]
    row.samples_per_s = global_batch / (row.step_ms["p50"] / 1e3)
    row.samples_per_s_per_gpu = row.samples_per_s / len(per_rank)
    row.wall_s = max(r["wall_s"] for r in per_rank)
    row.host_ms_per_step = [max(ts) for ts in zip(*(r["host_ms"] for r in per_rank))]
    row.host_ms = summarize_ms(row.host_ms_per_step)
    row.samples_per_s_wall = global_batch * steps / row.wall_s
    row.build_s = max(r["build_s"] for r in per_rank)
    mems = [r["memory"] for r in per_rank]
    if mems[0]:
        row.memory = {k: max(m[k] for m in mems) if mems[0][k] is not None else None for k in mems[0]}
        row.memory["per_rank"] = mems
        if "reserved_by_stream" in first:  # per rank: {stream role: [reserved GiB, live GiB]}
            row.memory["reserved_by_stream"] = [r.get("reserved_by_stream", {}) for r in per_rank]
    if "trace" in first:
        row.trace = combine_ranks([r.get("trace") for r in per_rank])
        row.gpu_busy_ms = row.trace.get("gpu_busy_ms")
        row.x_busy = row.step_ms["p50"] / row.gpu_busy_ms if row.gpu_busy_ms else None
    if "cache_counters" in first:
        row.cache = cache_metrics([r["cache_counters"] for r in per_rank], steps,
                                  [(r.get("trace") or {}).get("cache") for r in per_rank])
    elif first.get("cache_reason"):
        row.cache = {"reason": first["cache_reason"]}
    if "pipelined" in first:
        row.torchrec_pipelined_modules = first["pipelined"]
        if first["pipelined"] == 0:
            row.notes.append("TorchRec pipelined no sharded module (FX trace found no usable inputs): no overlap")
