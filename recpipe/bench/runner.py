"""``recpipe bench``: time every pipeline on the same batches, recpipe's and TorchRec's.

Per rank, once: make ``warmup + steps + DRAIN`` host batches with ``make_dataloader``
(pinned on CUDA). Then for each (pipeline, implementation), one after the other in
the same process group:

1. free what the previous run left (``gc.collect``, ``empty_cache``), reset the
   allocator's peak counters;
2. build a fresh sharded model from ``train.seed`` and its optimizer, then the
   pipeline (recpipe's class, or TorchRec's counterpart: see ``torchrec_impl``);
3. feed it a fresh iterator over (shallow copies of) the same host batches: ``warmup``
   untimed steps, ``steps`` timed steps (``measure.StepClock``), then untimed steps
   until StopIteration. The ``DRAIN`` extra batches keep every timed step in steady
   state (TorchRec's SemiSync fetches three batches ahead);
4. gather every rank's numbers: a step's time is the slowest rank's.

Which config each pipeline runs: the given config with ``pipeline.name`` set to that
pipeline (its options from the config if it names the same pipeline, else the
defaults; ``max_batches_ahead``/``uneven_data`` carried over). ``prefetch`` runs only
when the config has a ``fused_uvm_caching`` table and ``sharding.prefetch_pipeline``;
every other pipeline runs with ``sharding.prefetch_pipeline=false`` (the config rule
that only ``prefetch`` may lock cache lines). The overrides are on each row.
A recpipe pipeline that refuses the config (``PipelineError``) is skipped with its
message; a TorchRec pipeline that raises is recorded as failed (TorchRec's
FusedSparseDist, SemiSync and Prefetch pipelines do not run on CPU). An exception
that only some ranks hit leaves the others in a collective until its timeout.

Exit codes: 0, 1 when a rank died or a recpipe pipeline failed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import itertools
import json
import logging
import os
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed import TCPStore
from torch.multiprocessing.spawn import ProcessException
from tqdm import tqdm

from recpipe.bench.measure import MemorySnapshot, StepClock, free_device_memory, summarize_ms
from recpipe.bench.report import Row, environment, format_table, write_outputs
from recpipe.bench.torchrec_impl import build_torchrec_pipeline, pipelined_module_count
from recpipe.config import BasePipelineConfig, ConfigError, RecpipeConfig, config_from_dict, load_config
from recpipe.data import Batch, make_dataloader, num_batches
from recpipe.distributed import init_process_group, launch_local, under_torchrun
from recpipe.models import build_model
from recpipe.pipelines import PIPELINES, PipelineError, make_pipeline
from recpipe.sharding import shard_model

__all__ = ["BenchOptions", "DRAIN", "config_for_pipeline", "main_bench", "run_worker"]

DRAIN = 3  # untimed batches after the timed ones
IMPLS = ("recpipe", "torchrec")
EXIT_FAILED = 1


@dataclass(frozen=True)
class BenchOptions:
    pipelines: tuple[str, ...]
    with_torchrec: bool
    steps: int
    warmup: int
    out: str
    command: str = ""  # the bench invocation, for the record
    profile: str | None = None  # file for torch.profiler op tables of the last warm-up steps

    @property
    def batches_per_run(self) -> int:
        return self.warmup + self.steps + DRAIN


# ----------------------------------------------------------------- CLI entry
def _options(args: argparse.Namespace, cfg: RecpipeConfig) -> BenchOptions:
    asked = [n.strip() for n in (args.pipelines or "").split(",") if n.strip()]
    names = list(dict.fromkeys(asked)) if args.pipelines else list(PIPELINES)
    unknown = [n for n in names if n not in PIPELINES]
    if unknown or not names:
        raise ConfigError(f"--pipelines={args.pipelines!r}: unknown {unknown}; choose from {', '.join(PIPELINES)}")
    if args.steps < 1:
        raise ConfigError(f"--steps={args.steps} must be >= 1")
    if args.warmup < 0:
        raise ConfigError(f"--warmup={args.warmup} must be >= 0")
    out = args.out or cfg.logging.run_dir
    command = " ".join(
        ["recpipe bench --config", str(args.config), *(f"--set {o}" for o in args.overrides),
         f"--pipelines {','.join(names)}", *(["--with-torchrec"] if args.with_torchrec else []),
         f"--steps {args.steps} --warmup {args.warmup} --out {out}"]
    )
    profile = str(Path(out) / "profile.txt") if getattr(args, "profile", False) else None
    opts = BenchOptions(tuple(names), bool(args.with_torchrec), args.steps, args.warmup, out, command, profile)
    world = cfg.distributed.nproc if not under_torchrun() else int(os.environ["WORLD_SIZE"])
    have = [num_batches(cfg, rank=r, world_size=world, split="train") for r in range(world)]
    short = [(r, n) for r, n in enumerate(have) if n is not None and n < opts.batches_per_run]
    if short:
        raise ConfigError(
            f"the bench needs warmup + steps + {DRAIN} = {opts.batches_per_run} batches per rank but "
            f"(rank, batches) {short} have fewer; raise data.synthetic.num_batches or lower --steps/--warmup"
        )
    return opts


def main_bench(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # ConfigError -> exit 2 (recpipe.cli)
    opts = _options(args, cfg)
    if under_torchrun():
        rows = run_worker(cfg, opts)
    else:
        try:
            if cfg.distributed.nproc > 1:
                launch_local(run_worker, cfg.distributed.nproc, cfg, opts)
            else:
                with _single_rank_group():
                    run_worker(cfg, opts)
        except ProcessException as err:
            print(f"recpipe bench: rank {err.error_index} failed:\n{err}", file=sys.stderr)
            return EXIT_FAILED
        record = json.loads((Path(opts.out) / "bench.json").read_text())
        rows = [Row(**r) for r in record["rows"]]
    failed = [r.pipeline for r in rows if r.impl == "recpipe" and r.status == "failed"]
    if failed:
        print(f"recpipe bench: recpipe pipelines failed: {', '.join(failed)}", file=sys.stderr)
        return EXIT_FAILED
    return 0


_RANK_ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
)


@contextlib.contextmanager
def _single_rank_group() -> Iterator[None]:
    """A one-rank env:// rendezvous in this process (like ``launch_local``'s children),
    environment restored afterwards so a later call does not look like torchrun."""
    store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    saved = {k: os.environ.get(k) for k in _RANK_ENV}
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True",
    )
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        del store


# ------------------------------------------------------------------ one rank
def run_worker(cfg: RecpipeConfig, opts: BenchOptions) -> list[Row]:
    """One rank of ``recpipe bench`` (module-level: ``launch_local`` pickles it).
    Every rank returns the same rows; rank 0 prints and writes them."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch")
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    device = init_process_group(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    gpu_names = _gather(gpu)

    started = time.perf_counter()
    batches = pregenerate(cfg, rank, world, opts.batches_per_run, device)
    generation_s = max(_gather(time.perf_counter() - started))
    header = environment(device, world, gpu_names)
    header["command"] = opts.command or header["command"]
    header["bench"] = {
        "pipelines": list(opts.pipelines),
        "with_torchrec": opts.with_torchrec,
        "steps": opts.steps,
        "warmup": opts.warmup,
        "drain": DRAIN,
        "global_batch": cfg.data.batch_size * world,
        "batches_per_rank": len(batches),
        "batch_generation_s": generation_s,
        "batch_generation_ms_per_batch": 1e3 * generation_s / len(batches),
        "pinned": device.type == "cuda",
        "timing": StepClock(device).method,
        "runs": "sequential in one process group; fresh model (train.seed) per run",
    }

    runs = [(name, impl) for name in opts.pipelines for impl in IMPLS if impl == "recpipe" or opts.with_torchrec]
    if rank == 0:
        v = header["versions"]
        print(
            f"recpipe bench: {len(runs)} runs on {world} x {header['gpu']['name']}; torch {v['torch']}, "
            f"fbgemm-gpu {v['fbgemm_gpu']}, torchrec {v['torchrec']}, CUDA {v['cuda']}; "
            f"{len(batches)} batches/rank made in {generation_s:.1f} s",
            flush=True,
        )
    bar = tqdm(
        total=len(runs) * len(batches), unit="step", dynamic_ncols=True,
        disable=rank != 0 or not cfg.train.progress,
    )
    rows = []
    for name, impl in runs:
        bar.set_description(f"{name}/{impl}")
        row = run_one(cfg, name, impl, batches, opts, device, bar)
        rows.append(row)
        if rank == 0 and row.status != "ok":
            tqdm.write(f"recpipe bench: {name} ({impl}) {row.status}: {row.reason}")
        elif rank == 0:
            tqdm.write(
                f"recpipe bench: {name} ({impl}) P50 {row.step_ms['p50']:.2f} ms, P90 {row.step_ms['p90']:.2f} ms, "
                f"{row.samples_per_s:,.0f} samples/s"
            )
    bar.close()
    if rank == 0:
        path = write_outputs(opts.out, cfg, header, rows)
        print(format_table(rows))
        print(f"wrote {path} and {path.with_suffix('.md')}")
    dist.barrier()
    return rows


def pregenerate(cfg: RecpipeConfig, rank: int, world: int, count: int, device: torch.device) -> list[Batch]:
    """``count`` host batches of this rank's train split, pinned on CUDA."""
    loader = make_dataloader(cfg, rank=rank, world_size=world, split="train")
    batches = list(itertools.islice(iter(loader), count))
    counts = _gather(len(batches))
    if min(counts) < count:
        raise ValueError(f"the bench needs {count} batches per rank, the data gave (per rank) {counts}")
    if device.type == "cuda":
        batches = [b if b.dense_features.is_pinned() else b.pin_memory() for b in batches]
    return batches


def _fresh(batches: list[Batch]) -> Iterator[Batch]:
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


def run_one(
    cfg: RecpipeConfig, name: str, impl: str, batches: list[Batch], opts: BenchOptions, device: torch.device, bar: tqdm
) -> Row:
    """Collective: every rank runs (name, impl) and the row combines all ranks."""
    row = Row(pipeline=name, impl=impl)
    cfg_p, row.config_overrides, skip = config_for_pipeline(cfg, name)
    if cfg_p is None:
        row.status, row.reason = "skipped", skip
        bar.update(len(batches))
        return row
    local = _run_local(cfg_p, impl, batches, opts, device, bar)
    _combine(row, _gather(local), cfg.data.batch_size * dist.get_world_size(), opts.steps)
    return row


PROFILED_STEPS = 5


def _profile_steps(pipe: Any, it: Iterator[Batch], n: int, device: torch.device, path: str, title: str) -> int:
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


def _run_local(
    cfg: RecpipeConfig, impl: str, batches: list[Batch], opts: BenchOptions, device: torch.device, bar: tqdm
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
        sharded = shard_model(build_model(cfg.model), cfg, device)
        if impl == "recpipe":
            try:
                pipe = make_pipeline(cfg, sharded.model, sharded.optimizer, device)
            except PipelineError as err:
                out.update(status="skipped", reason=str(err))
                return out
            out["options"] = cfg.pipeline.model_dump(exclude={"name"})
        else:
            pipe, out["options"], out["notes"] = build_torchrec_pipeline(cfg, sharded.model, sharded.optimizer, device)
        out["cls"] = f"{type(pipe).__module__}.{type(pipe).__name__}"
        memory.built()
        out["build_s"] = time.perf_counter() - built
        it = _fresh(batches)
        profiled = PROFILED_STEPS if opts.profile and opts.warmup > PROFILED_STEPS else 0
        for _ in range(opts.warmup - profiled):
            pipe.progress(it)
            calls += 1
            bar.update(1)
        if profiled:
            calls += _profile_steps(pipe, it, profiled, device, opts.profile, f"{cfg.pipeline.name}/{impl}")
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
        while True:
            try:
                pipe.progress(it)
            except StopIteration:
                break
            calls += 1
            bar.update(1)
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


def _combine(row: Row, per_rank: list[dict[str, Any]], global_batch: int, steps: int) -> None:
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
    row.samples_per_s = global_batch / (row.step_ms["p50"] / 1e3)
    row.wall_s = max(r["wall_s"] for r in per_rank)
    row.host_ms = summarize_ms([max(ts) for ts in zip(*(r["host_ms"] for r in per_rank))])
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


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out

