"""``recpipe bench``: time every pipeline on the same batches, recpipe's and TorchRec's.

Per rank, once: make ``warmup + steps + trace_steps + DRAIN`` host batches with ``make_dataloader``
(pinned on CUDA). Then for each (pipeline, implementation), one after the other in
the same process group:

1. free what the previous run left (``gc.collect``, ``empty_cache``), reset the
   allocator's peak counters;
2. build a fresh sharded model from ``train.seed`` and its optimizer, then the
   pipeline (recpipe's class, or TorchRec's counterpart: see ``torchrec_impl``);
3. feed it a fresh iterator over (shallow copies of) the same host batches: ``warmup``
   untimed steps, ``steps`` timed steps (``measure.StepClock``; UVM-cache counters read
   around them, ``uvm_cache``), ``trace_steps`` steps under torch.profiler (GPU busy
   time, host time by phase, cache work: ``trace``), then untimed steps until
   StopIteration. The ``DRAIN`` extra batches keep every timed and traced step in
   steady state (TorchRec's SemiSync fetches three batches ahead);
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

After the runs, optional sections, each collective and on fresh models:
``--bound`` (``bound``: every stage timed alone, summed per resource: an estimate,
each row's P50 as a multiple of it), ``--multipass`` (``multipass``: the prefetch
pipeline at several ``sharding.prefetch_passes``), ``--sweep-cache`` / ``--sweep-zipf``
(``sweep``: prefetch vs sparse_dist over cache load factor and Zipf alpha, and which
to use). Always: samples/s per GPU on every row and the planner's weak-scaling
prediction; ``--baseline`` adds efficiency versus an earlier ``bench.json``
(``weak_scaling``). Then rank 0 writes ``bench.json``, ``bench.md`` and, unless
``--no-plots``, the PNGs (``plots``).

Exit codes: 0, 1 when a rank died or a recpipe pipeline failed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed import TCPStore
from torch.multiprocessing.spawn import ProcessException
from tqdm import tqdm

from recpipe.bench.bound import apply_bound, measure_bound
from recpipe.bench.compare import check_targets, merge_rounds, round_order, targets_md
from recpipe.bench.measure import StepClock
from recpipe.bench.multipass import describe_point, run_multipass
from recpipe.bench.plots import write_plots
from recpipe.bench.report import Row, environment, format_table, write_outputs
from recpipe.bench.run import (
    combine,
    config_for_pipeline,
    fresh_batches,
    gather,
    pipeline_options,
    run_local,
    split_variant,
)
from recpipe.bench.sections import render_sections, rows_md
from recpipe.bench.sweep import parse_grid, run_sweep
from recpipe.bench.weak_scaling import load_baseline, weak_scaling
from recpipe.config import ConfigError, RecpipeConfig, load_config
from recpipe.data import Batch, make_dataloader, num_batches
from recpipe.distributed import init_process_group, launch_local, shutdown_process_group, torchrun_overrides, under_torchrun
from recpipe.pipelines import PIPELINES

__all__ = ["BenchOptions", "DRAIN", "config_for_pipeline", "main_bench", "run_worker"]

DRAIN = 3  # untimed batches after the timed (and traced) ones
TRACE_STEPS = 5  # default --trace-steps
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
    profile: str | None = None  # file for torch.profiler op tables of the traced steps
    bound: bool = False  # time every stage alone: the hardware bound
    multipass: tuple[int, ...] = ()  # sharding.prefetch_passes values to sweep
    baseline: str | None = None  # an earlier bench.json: weak-scaling efficiency
    plots: bool = True
    rounds: int = 1  # every run repeated, interleaved (compare.round_order)
    trace_steps: int = TRACE_STEPS  # profiled steps after the timed ones (trace.py); 0 = none
    sweep_cache: tuple[float, ...] = ()  # cache load factors of the prefetch sweep (sweep.py)
    sweep_zipf: tuple[float, ...] = ()  # Zipf alphas of the prefetch sweep

    @property
    def sweep(self) -> bool:
        return bool(self.sweep_cache or self.sweep_zipf)

    @property
    def batches_per_run(self) -> int:
        return self.warmup + self.steps + self.trace_steps + DRAIN


# ----------------------------------------------------------------- CLI entry
def _options(args: argparse.Namespace, cfg: RecpipeConfig) -> BenchOptions:
    asked = [n.strip() for n in (args.pipelines or "").split(",") if n.strip()]
    sweep_only = not args.pipelines and bool(getattr(args, "sweep_cache", None) or getattr(args, "sweep_zipf", None))
    # A cache sweep runs its own pipelines at every point: the plain runs only when asked for.
    names = list(dict.fromkeys(asked)) if args.pipelines else [] if sweep_only else list(PIPELINES)
    unknown = [n for n in names if split_variant(n)[0] not in PIPELINES]
    if unknown or not (names or sweep_only):
        raise ConfigError(f"--pipelines={args.pipelines!r}: unknown {unknown}; choose from {', '.join(PIPELINES)}")
    for name in names:  # a variant's options are checked now, not after the other runs
        if split_variant(name)[1] and config_for_pipeline(cfg, name)[0] is None:
            raise ConfigError(f"--pipelines: {name!r}: {config_for_pipeline(cfg, name)[2]}")
    if args.steps < 1:
        raise ConfigError(f"--steps={args.steps} must be >= 1")
    if args.warmup < 0:
        raise ConfigError(f"--warmup={args.warmup} must be >= 0")
    rounds = int(getattr(args, "rounds", 1))
    if rounds < 1:
        raise ConfigError(f"--rounds={rounds} must be >= 1")
    trace_steps = int(getattr(args, "trace_steps", TRACE_STEPS))
    if trace_steps < 0:
        raise ConfigError(f"--trace-steps={trace_steps} must be >= 0")
    if getattr(args, "profile", False) and not trace_steps:
        raise ConfigError("--profile writes the op tables of the traced steps: it needs --trace-steps >= 1")
    sweep_cache = parse_grid(getattr(args, "sweep_cache", None), "--sweep-cache", 0.0, 1.0, low_open=True)
    sweep_zipf = parse_grid(getattr(args, "sweep_zipf", None), "--sweep-zipf", 0.0, 10.0, low_open=False)
    out = args.out or cfg.logging.run_dir
    bound, plots = bool(getattr(args, "bound", False)), bool(getattr(args, "plots", True))
    passes = _passes(getattr(args, "multipass", None))
    baseline = getattr(args, "baseline", None)
    if baseline:
        load_baseline(baseline)  # ConfigError (exit 2) before any process starts
    flags = [flag for flag, on in (("--with-torchrec", args.with_torchrec), ("--bound", bound),
                                   (f"--multipass {','.join(map(str, passes))}", passes),
                                   (f"--baseline {baseline}", baseline), ("--no-plots", not plots),
                                   (f"--rounds {rounds}", rounds > 1),
                                   (f"--trace-steps {trace_steps}", trace_steps != TRACE_STEPS),
                                   (f"--sweep-cache {','.join(map(str, sweep_cache))}", sweep_cache),
                                   (f"--sweep-zipf {','.join(map(str, sweep_zipf))}", sweep_zipf)) if on]
    command = " ".join(
        ["recpipe bench --config", str(args.config), *(f"--set {o}" for o in args.overrides),
         *([f"--pipelines {','.join(names)}"] if names else []), *flags, f"--steps {args.steps} --warmup {args.warmup} --out {out}"]
    )
    profile = str(Path(out) / "profile.txt") if getattr(args, "profile", False) else None
    opts = BenchOptions(tuple(names), bool(args.with_torchrec), args.steps, args.warmup, out, command, profile,
                        bound=bound, multipass=passes, baseline=baseline, plots=plots, rounds=rounds,
                        trace_steps=trace_steps, sweep_cache=sweep_cache, sweep_zipf=sweep_zipf)
    world = cfg.distributed.nproc if not under_torchrun() else int(os.environ["WORLD_SIZE"])
    have = [num_batches(cfg, rank=r, world_size=world, split="train") for r in range(world)]
    short = [(r, n) for r, n in enumerate(have) if n is not None and n < opts.batches_per_run]
    if short:
        raise ConfigError(
            f"the bench needs warmup + steps + trace steps + {DRAIN} = {opts.batches_per_run} batches per rank but "
            f"(rank, batches) {short} have fewer; raise data.synthetic.num_batches or lower --steps/--warmup"
        )
    return opts


def _passes(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        passes = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        passes = ()
    if not passes or min(passes) < 1:
        raise ConfigError(f"--multipass={text!r}: give comma-separated pass counts >= 1, e.g. 1,2,4,8")
    return tuple(dict.fromkeys(passes))


def main_bench(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, [*args.overrides, *torchrun_overrides()])  # ConfigError -> exit 2 (recpipe.cli)
    opts = _options(args, cfg)
    if under_torchrun():
        try:
            rows = run_worker(cfg, opts)
        finally:
            shutdown_process_group()
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
        shutdown_process_group()
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
    gpu_names = gather(gpu)

    started = time.perf_counter()
    batches = pregenerate(cfg, rank, world, opts.batches_per_run, device)
    generation_s = max(gather(time.perf_counter() - started))
    header = _header(cfg, opts, device, world, gpu_names, generation_s, len(batches))
    # A variant's pipeline options (name:key=value) are recpipe's own: TorchRec has no
    # counterpart. A variant of dotted config keys only (name:sharding.x=y) runs on both.
    runs = [(name, impl) for name in opts.pipelines for impl in IMPLS
            if impl == "recpipe" or (opts.with_torchrec and not pipeline_options(split_variant(name)[1]))]
    if rank == 0:
        v = header["versions"]
        print(
            f"recpipe bench: {len(runs)} runs on {world} x {header['gpu']['name']}; torch {v['torch']}, "
            f"fbgemm-gpu {v['fbgemm_gpu']}, torchrec {v['torchrec']}{f', CUDA ' + v['cuda'] if v['cuda'] else ''}; "
            f"{len(batches)} batches/rank made in {generation_s:.1f} s",
            flush=True,
        )
    # rank 0's bar, on a terminal only (disable=None): in a log every refresh is one more line
    bar = tqdm(
        total=(opts.rounds * len(runs) + len(opts.multipass)) * len(batches), unit="step", dynamic_ncols=True,
        disable=None if rank == 0 and cfg.train.progress else True,
    )
    measured: dict[tuple[str, str], list[Row]] = {run: [] for run in runs}
    for r in range(opts.rounds):
        for name, impl in round_order(runs, r):
            if any(earlier.status != "ok" for earlier in measured[(name, impl)]):
                bar.update(len(batches))  # skipped or failed once: it would again, on the same config
                continue
            bar.set_description(f"{name}/{impl}" + (f" round {r + 1}/{opts.rounds}" if opts.rounds > 1 else ""))
            row = run_one(cfg, name, impl, batches, opts, device, bar)
            measured[(name, impl)].append(row)
            if rank == 0:
                tqdm.write(f"recpipe bench: {_describe(row)}" + (f" (round {r + 1})" if opts.rounds > 1 else ""))
    global_batch = cfg.data.batch_size * world
    rows = [merge_rounds(measured[run], global_batch) for run in runs]
    sections = _optional_sections(cfg, opts, rows, batches, device, bar, header["gpu"]["name"])
    bar.close()
    if rank == 0:
        _write(cfg, opts, header, rows, sections, world)
    dist.barrier()
    return rows


def _describe(row: Row) -> str:
    if row.status != "ok":
        return f"{row.pipeline} ({row.impl}) {row.status}: {row.reason}"
    return (f"{row.pipeline} ({row.impl}) P50 {row.step_ms['p50']:.2f} ms, P90 {row.step_ms['p90']:.2f} ms, "
            f"{row.samples_per_s:,.0f} samples/s")


def _header(
    cfg: RecpipeConfig, opts: BenchOptions, device: torch.device, world: int, gpu_names: list[str],
    generation_s: float, num_batches_made: int,
) -> dict[str, Any]:
    header = environment(device, world, gpu_names)
    header["command"] = opts.command or header["command"]
    header["bench"] = {
        "pipelines": list(opts.pipelines),
        "with_torchrec": opts.with_torchrec,
        "steps": opts.steps,
        "warmup": opts.warmup,
        "drain": DRAIN,
        "global_batch": cfg.data.batch_size * world,
        "batches_per_rank": num_batches_made,
        "batch_generation_s": generation_s,
        "batch_generation_ms_per_batch": 1e3 * generation_s / num_batches_made,
        "pinned": device.type == "cuda",
        "timing": StepClock(device).method,
        "rounds": opts.rounds,
        "runs": "sequential in one process group; fresh model (train.seed) per run"
                + (f"; {opts.rounds} interleaved rounds (compare.round_order)" if opts.rounds > 1 else ""),
        "trace_steps": opts.trace_steps,
        "sweep_cache": list(opts.sweep_cache),
        "sweep_zipf": list(opts.sweep_zipf),
        "bound": opts.bound,
        "multipass": list(opts.multipass),
        "baseline": opts.baseline,
    }
    return header


def _optional_sections(
    cfg: RecpipeConfig, opts: BenchOptions, rows: list[Row], batches: list[Batch], device: torch.device, bar: tqdm,
    gpu_name: str,
) -> dict[str, Any]:
    """Collective: ``--bound``, ``--multipass`` and the cache sweep, after every run
    (each builds its own fresh models, so the runs above saw the same memory as
    without them)."""
    sections: dict[str, Any] = {}
    rank0 = dist.get_rank() == 0
    if opts.bound:
        bar.set_description("bound")
        bound = sections["bound"] = measure_bound(cfg, list(fresh_batches(batches)), device, gpu_name)
        apply_bound(rows, bound)
        if rank0:
            tqdm.write(f"recpipe bench: bound {bound['bound_ms']:.3f} ms ({bound['bound_resource']})"
                       if bound["status"] == "ok" else f"recpipe bench: bound failed: {bound['reason']}")
    if opts.multipass:
        sweep = sections["multipass"] = run_multipass(cfg, opts.multipass, batches, opts, device, bar)
        if rank0 and sweep["status"] != "ok":
            tqdm.write(f"recpipe bench: multipass sweep skipped: {sweep['reason']}")
        for p in sweep.get("points", []) if rank0 else []:
            tqdm.write(f"recpipe bench: {describe_point(p)}")
    if opts.sweep:
        rank, world = dist.get_rank(), dist.get_world_size()
        grid = sections["cache_sweep"] = run_sweep(
            cfg, opts, opts.sweep_cache, opts.sweep_zipf,
            lambda c: pregenerate(c, rank, world, opts.batches_per_run, device), device, bar)
        if rank0:
            tqdm.write(f"recpipe bench: cache sweep {grid['status']}" + (
                f": {grid['reason']}" if grid["status"] != "ok" else f", {len(grid['points'])} points"))
    return sections


def _write(
    cfg: RecpipeConfig, opts: BenchOptions, header: dict[str, Any], rows: list[Row], sections: dict[str, Any], world: int
) -> None:
    """Rank 0: weak scaling (needs no collective), plots, bench.json and bench.md."""
    baseline = load_baseline(opts.baseline) if opts.baseline else None
    sections["weak_scaling"] = weak_scaling(cfg, rows, world, header["gpu"]["name"], baseline, opts.baseline)
    sections["targets"] = check_targets(rows, sections.get("bound"))
    if opts.plots:
        sections["plots"] = write_plots(opts.out, rows, sections)
    markdown = rows_md(rows) + targets_md(sections["targets"], opts.rounds) + render_sections(sections)
    path = write_outputs(opts.out, cfg, header, rows, sections, markdown)
    print(format_table(rows))
    for p in sections.get("plots", {}).get("written", []):
        print(f"wrote {Path(opts.out) / p}")
    print(f"wrote {path} and {path.with_suffix('.md')}")


def pregenerate(cfg: RecpipeConfig, rank: int, world: int, count: int, device: torch.device) -> list[Batch]:
    """``count`` host batches of this rank's train split, pinned on CUDA."""
    loader = make_dataloader(cfg, rank=rank, world_size=world, split="train")
    batches = list(itertools.islice(iter(loader), count))
    counts = gather(len(batches))
    if min(counts) < count:
        raise ValueError(f"the bench needs {count} batches per rank, the data gave (per rank) {counts}")
    if device.type == "cuda":
        batches = [b if b.dense_features.is_pinned() else b.pin_memory() for b in batches]
    return batches


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
    local = run_local(cfg_p, impl, batches, opts, device, bar, label=name)
    combine(row, gather(local), cfg.data.batch_size * dist.get_world_size(), opts.steps)
    return row
