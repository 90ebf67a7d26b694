"""One timed run of one (pipeline, implementation) on one rank, and combining ranks.

``run_local`` is what every row of ``recpipe bench`` and every point of the multi-pass
sweep runs: free what the previous run left, build a fresh sharded model from
``train.seed``, build the pipeline (recpipe's, TorchRec's, or a ``RunProbe``'s), feed
it fresh copies of the same host batches (warm-up, timed steps, drain), and return a
plain dict that ``combine`` turns into a ``Row`` once every rank's dict is gathered.
"""

from __future__ import annotations

import copy
import dataclasses
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Protocol

import torch
import torch.distributed as dist
from tqdm import tqdm

from recpipe.bench.measure import MemorySnapshot, StepClock, free_device_memory, summarize_ms
from recpipe.bench.report import Row
from recpipe.bench.torchrec_impl import build_torchrec_pipeline, pipelined_module_count
from recpipe.config import BasePipelineConfig, ConfigError, RecpipeConfig, config_from_dict
from recpipe.data import Batch
from recpipe.models import make_model
from recpipe.pipelines import PipelineError, make_pipeline
from recpipe.sharding import shard_model

if TYPE_CHECKING:
    from recpipe.bench.runner import BenchOptions

__all__ = ["RunProbe", "combine", "config_for_pipeline", "fresh_batches", "gather", "run_local"]

PROFILED_STEPS = 5


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


def config_for_pipeline(cfg: RecpipeConfig, name: str) -> tuple[RecpipeConfig | None, dict[str, Any], str]:
    """(config to run ``name`` with, its overrides versus ``cfg``, skip reason or '')."""
    raw = cfg.model_dump(mode="json")
    overrides: dict[str, Any] = {}
    cached = [t for t, s in cfg.table_sharding().items() if s.kernel == "fused_uvm_caching"]
    if name == "prefetch" and not (cached and cfg.sharding.prefetch_pipeline):
        return None, overrides, (
            "needs a fused_uvm_caching table and sharding.prefetch_pipeline=true "
            f"(cached tables: {cached or 'none'}, prefetch_pipeline={cfg.sharding.prefetch_pipeline})"
        )
    if name != cfg.pipeline.name:
        common = {k: v for k, v in raw["pipeline"].items() if k in BasePipelineConfig.model_fields and k != "name"}
        raw["pipeline"] = {"name": name, **common}
        overrides["pipeline.name"] = name
    if name != "prefetch" and cfg.sharding.prefetch_pipeline:
        raw["sharding"].update(prefetch_pipeline=False, prefetch_passes=1)
        overrides["sharding.prefetch_pipeline"] = False
        if cfg.sharding.prefetch_passes != 1:
            overrides["sharding.prefetch_passes"] = 1
    try:
        return config_from_dict(raw, f"bench config for {name}"), overrides, ""
    except ConfigError as err:  # e.g. semi_sync on UVM-cached tables (no cache-line locking)
        return None, overrides, str(err).replace("\n", " ")


def profile_steps(pipe: Any, it: Iterator[Batch], n: int, device: torch.device, path: str, title: str) -> int:
    """Run ``n`` steps under torch.profiler; rank 0 appends the op table (by self
    CPU time: host overhead is what separates pipelines at equal GPU work) to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(n):
            pipe.progress(it)
        if device.type == "cuda":
            torch.cuda.synchronize()
    if dist.get_rank() == 0:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        gpu = prof.key_averages().table(sort_by="self_device_time_total", row_limit=15) if device.type == "cuda" else ""
        with open(path, "a") as f:
            f.write(f"\n===== {title}: {n} steps =====\n{table}\n{gpu}\n")
    return n


def _untimed(pipe: Any, it: Iterator[Batch], bar: tqdm, n: int | None = None) -> int:
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


def run_local(
    cfg: RecpipeConfig, impl: str, batches: list[Batch], opts: "BenchOptions", device: torch.device, bar: tqdm,
    probe: RunProbe | None = None,
) -> dict[str, Any]:
    """This rank's run; never raises (the error goes into the result)."""
    out: dict[str, Any] = {"status": "ok", "reason": "", "notes": [], "options": {}, "cls": ""}
    calls = 0
    pipe = sharded = None
    free_device_memory(device)
    memory = MemorySnapshot.begin(device)
    try:
        built = time.perf_counter()
        torch.manual_seed(cfg.train.seed)
        sharded = shard_model(make_model(cfg), cfg, device)
        if impl == "recpipe":
            try:
                build = probe.build if probe is not None else make_pipeline
                pipe = build(cfg, sharded.model, sharded.optimizer, device)
            except PipelineError as err:
                out.update(status="skipped", reason=str(err))
                return out
            out["options"] = cfg.pipeline.model_dump(exclude={"name"})
        else:
            pipe, out["options"], out["notes"] = build_torchrec_pipeline(cfg, sharded.model, sharded.optimizer, device)
        out["cls"] = f"{type(pipe).__module__}.{type(pipe).__name__}"
        memory.built()
        out["build_s"] = time.perf_counter() - built
        it = fresh_batches(batches)
        profiled = PROFILED_STEPS if opts.profile and opts.warmup > PROFILED_STEPS else 0
        calls += _untimed(pipe, it, bar, opts.warmup - profiled)
        if profiled:
            calls += profile_steps(pipe, it, profiled, device, opts.profile, f"{cfg.pipeline.name}/{impl}")
            bar.update(profiled)
        memory.phase_done("warmup")
        if impl == "torchrec":
            out["pipelined"] = pipelined_module_count(pipe)
        clock = StepClock(device)
        wall = time.perf_counter()  # after the warm-up's synchronize (phase_done)
        for _ in range(opts.steps):
            clock.start()
            pipe.progress(it)
            clock.stop()
            calls += 1
            bar.update(1)
        out["times_ms"] = clock.times_ms()  # synchronizes
        out["host_ms"] = clock.host_ms()
        out["wall_s"] = time.perf_counter() - wall
        memory.phase_done("timed")
        if probe is not None:
            out["probe"] = probe.collect(pipe)
        calls += _untimed(pipe, it, bar)
    except Exception as err:  # noqa: BLE001 - recorded on the row; recpipe failures also fail the exit code
        first = (str(err).strip().splitlines() or [""])[0]
        out.update(status="failed", reason=f"{type(err).__name__}: {first[:300]}")
        if impl == "recpipe":
            traceback.print_exc()
    finally:
        out["memory"] = memory.as_gib()
        bar.update(max(len(batches) - calls, 0))
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
    if "pipelined" in first:
        row.torchrec_pipelined_modules = first["pipelined"]
        if first["pipelined"] == 0:
            row.notes.append("TorchRec pipelined no sharded module (FX trace found no usable inputs): no overlap")
