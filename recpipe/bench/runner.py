"""``recpipe bench``: every (pipeline, implementation) on the same pregenerated batches, one after
the other in one process group, ``--rounds`` times interleaved (docs/benchmarking.md). Studies add
their measurement after the rows (:data:`Sections`) and run on every rank as the bench does."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessException
from tqdm import tqdm

from recpipe.bench.compare import comparisons, comparisons_md, merge_rounds, round_order
from recpipe.bench.floor import fill_floor, floor_md, time_collectives
from recpipe.bench.measure import StepClock
from recpipe.bench.report import Row, environment, format_table, gpu_time_table, rows_md, write_outputs, write_plots
from recpipe.bench.run import (DRAIN, BenchOptions, combine, config_for_pipeline, gather, pipeline_options, run_local,
                               split_variant)
from recpipe.compat import torch as compat_torch
from recpipe.config import ConfigError, RecpipeConfig, load_config
from recpipe.preflight import check_rules
from recpipe.data import Batch, make_dataloader, num_batches
from recpipe.distributed import init_process_group, shutdown_process_group, torchrun_overrides
from recpipe.launch_preload import under_torchrun
from recpipe.launcher import launch_local
from recpipe.errors import StorageError, storage_problem
from recpipe.exit_codes import EXIT_WORKER_FAILED
from recpipe.pipelines import PIPELINES
from recpipe.speedups.registry import SPEEDUPS

__all__ = ["Sections", "launch", "main_bench", "options_from_args", "pregenerate", "run_one", "run_worker", "runs_of",
           "single_rank_group"]

# A study's measurement after the rows, on every rank (collective): -> (bench.json sections, markdown lines)
Sections = Callable[[RecpipeConfig, BenchOptions, list[Row], list[Batch], torch.device, tqdm],
                    tuple[dict[str, Any], list[str]]]


def options_from_args(args: argparse.Namespace, cfg: RecpipeConfig,
                      default_pipelines: tuple[str, ...] = tuple(PIPELINES),
                      command: str | None = None) -> BenchOptions:
    """Checked options; ConfigError (exit 2) naming the flag. Without ``--pipelines``: ``default_pipelines`` (a
    study that measures only its own runs passes ()); ``command``: the record's (default: the bench's flags)."""
    asked = [n.strip() for n in (args.pipelines or "").split(",") if n.strip()]
    names = list(dict.fromkeys(asked)) if args.pipelines else list(default_pipelines)
    unknown = [n for n in names if split_variant(n)[0] not in PIPELINES]
    if unknown or not (names or not default_pipelines):
        raise ConfigError(f"--pipelines={args.pipelines!r}: unknown {unknown}; choose from {', '.join(PIPELINES)}")
    for name in names:  # a variant's options are checked now, not after the other runs
        if split_variant(name)[1] and (skip := config_for_pipeline(cfg, name)[2]):
            raise ConfigError(f"--pipelines: {name!r}: {skip}")
    for flag, value, low in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0), ("--rounds", args.rounds, 1),
                             ("--trace-steps", args.trace_steps, 0)):
        if value < low:
            raise ConfigError(f"{flag}={value} must be >= {low}")
    if args.profile and not args.trace_steps:
        raise ConfigError("--profile writes the op tables of the traced steps: it needs --trace-steps >= 1")
    out = args.out or cfg.logging.run_dir
    writable_out(Path(out))
    if command is None:
        flags = [flag for flag, on in (("--with-torchrec", args.with_torchrec), ("--no-plots", not args.plots),
                                       (f"--rounds {args.rounds}", args.rounds > 1), ("--profile", args.profile)) if on]
        command = " ".join(["recpipe bench --config", str(args.config), *(f"--set {o}" for o in args.overrides),
                            *([f"--pipelines {','.join(names)}"] if names else []), *flags, f"--steps {args.steps}",
                            f"--warmup {args.warmup} --trace-steps {args.trace_steps} --out {out}"])
    opts = BenchOptions(tuple(names), bool(args.with_torchrec), args.steps, args.warmup, args.trace_steps, out,
                        command, str(Path(out) / "profile.txt") if args.profile else None, args.plots, args.rounds,
                        getattr(args, "check", True))
    world = cfg.distributed.nproc if not under_torchrun() else int(os.environ["WORLD_SIZE"])
    have = [num_batches(cfg, rank=r, world_size=world, split="train") for r in range(world)]
    if short := [(r, n) for r, n in enumerate(have) if n is not None and n < opts.batches_per_run]:
        raise ConfigError(
            f"the bench needs warmup + steps + trace steps + {DRAIN} = {opts.batches_per_run} batches per rank but "
            f"(rank, batches) {short} have fewer; raise data.synthetic.num_batches or lower --steps/--warmup")
    return opts


def writable_out(out: Path) -> None:
    """Before any run: ``--out`` is a directory this process can write (made if missing), so that a
    bench does not run to its end and then fail to write its report. StorageError (exit 6) naming it."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".recpipe-bench-"):
            pass
    except OSError as err:
        raise StorageError(f"cannot write --out {out}: {storage_problem(err, out)}") from None


def main_bench(args: argparse.Namespace, sections: Sections | None = None,
               default_pipelines: tuple[str, ...] = tuple(PIPELINES), command: str | None = None) -> int:
    """``recpipe bench``: 0, 1 when a rank died or a recpipe pipeline failed (ConfigError: 2). A study passes its
    ``sections``, the pipelines it runs without ``--pipelines`` and its own command line for the record."""
    cfg = load_config(args.config, [*args.overrides, *torchrun_overrides()])  # ConfigError -> exit 2 (recpipe.cli)
    check_rules(cfg)  # the configured pipeline's and speed features' rules: ConfigError -> exit 2
    opts = options_from_args(args, cfg, default_pipelines, command)
    try:
        rows = launch(run_worker, cfg, opts, sections)
    except ProcessException as err:
        print(f"recpipe bench: rank {err.error_index} failed:\n{err}", file=sys.stderr)
        return EXIT_WORKER_FAILED
    if rows is None:  # ranks in other processes: rank 0 wrote them
        rows = [Row.from_dict(r) for r in json.loads((Path(opts.out) / "bench.json").read_text())["rows"]]
    if failed := [r.pipeline for r in rows if r.impl == "recpipe" and r.status == "failed"]:
        print(f"recpipe bench: recpipe pipelines failed: {', '.join(failed)}", file=sys.stderr)
        return EXIT_WORKER_FAILED
    return 0


def launch(worker: Callable[..., Any], cfg: RecpipeConfig, *args: Any) -> Any:
    """``worker(cfg, *args)`` on every rank: in this process under torchrun or with one rank (its result),
    else in ``distributed.nproc`` processes of ``launch_local`` (None; ``worker`` and ``args`` are pickled)."""
    if under_torchrun():
        try:
            return worker(cfg, *args)
        finally:
            shutdown_process_group()
    if cfg.distributed.nproc > 1:
        return launch_local(worker, cfg.distributed.nproc, cfg, *args)
    with single_rank_group():
        return worker(cfg, *args)


@contextlib.contextmanager
def single_rank_group() -> Iterator[None]:
    """A one-rank env:// rendezvous in this process (like ``launch_local``'s children),
    environment restored afterwards so a later call does not look like torchrun."""
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        shutdown_process_group()
        os.environ.update({k: v for k, v in saved.items() if v is not None})
        for k in (k for k, v in saved.items() if v is None):
            os.environ.pop(k, None)
        del store


def runs_of(cfg: RecpipeConfig, opts: BenchOptions) -> list[tuple[str, str]]:
    """The (pipeline, impl) runs of a round: a variant of pipeline options runs on recpipe only, one of
    dotted keys on both; a speed feature that is on may add a TorchRec run of its own, on ``base``
    (``SpeedupDef.torchrec_run``: with compile on, TorchRec's TrainPipelinePT2)."""
    runs = [(name, impl) for name in opts.pipelines for impl in ("recpipe", "torchrec")
            if impl == "recpipe" or (opts.with_torchrec and not pipeline_options(split_variant(name)[1]))]
    extra = [("base", f.torchrec_run) for f in SPEEDUPS.values()
             if f.torchrec_run is not None and f.enabled(cfg.pipeline)]
    return runs + (extra if opts.with_torchrec else [])


def run_worker(cfg: RecpipeConfig, opts: BenchOptions, sections: Sections | None = None) -> list[Row]:
    """One rank of ``recpipe bench`` (module-level: ``launch_local`` pickles it). Every rank
    returns the same rows; rank 0 prints and writes them, with ``sections``' results."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch")
    compat_torch.fx_trace_logger().setLevel(logging.ERROR)
    device = init_process_group(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    gpu_names = gather(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    started = time.perf_counter()
    batches = pregenerate(cfg, rank, world, opts.batches_per_run, device)
    generation_s = max(gather(time.perf_counter() - started))
    header = dict(environment(device, world, gpu_names), bench={
        "pipelines": list(opts.pipelines), "with_torchrec": opts.with_torchrec, "steps": opts.steps,
        "warmup": opts.warmup, "drain": DRAIN, "global_batch": cfg.data.batch_size * world,
        "batches_per_rank": len(batches), "batch_generation_s": generation_s,
        "batch_generation_ms_per_batch": 1e3 * generation_s / len(batches), "pinned": device.type == "cuda",
        "timing": StepClock(device).method, "rounds": opts.rounds, "trace_steps": opts.trace_steps,
        "runs": "sequential in one process group; fresh model (train.seed) per run"
                + (f"; {opts.rounds} interleaved rounds (compare.round_order)" if opts.rounds > 1 else "")})
    header["command"] = opts.command or header["command"]
    runs = runs_of(cfg, opts)
    if rank == 0:
        v = header["versions"]
        print(f"recpipe bench: {len(runs)} runs on {world} x {header['gpu']['name']}; torch {v['torch']}, "
              f"fbgemm-gpu {v['fbgemm_gpu']}, torchrec {v['torchrec']}{f', CUDA ' + v['cuda'] if v['cuda'] else ''}; "
              f"{len(batches)} batches/rank made in {generation_s:.1f} s", flush=True)
    # rank 0's bar, on a terminal only (disable=None): in a log every refresh is one more line
    bar = tqdm(total=opts.rounds * len(runs) * len(batches), unit="step", dynamic_ncols=True,
               disable=None if rank == 0 and cfg.train.progress else True)
    measured: dict[tuple[str, str], list[Row]] = {run: [] for run in runs}
    references: dict[str, list[list[float]] | str] = {}  # recpipe row -> its lockstep run's losses, per rank
    for r in range(opts.rounds):
        for name, impl in round_order(runs, r):
            if any(earlier.status != "ok" for earlier in measured[(name, impl)]):
                bar.update(len(batches))  # skipped or failed once: it would again, on the same config
                continue
            bar.set_description(f"{name}/{impl}" + (f" round {r + 1}/{opts.rounds}" if opts.rounds > 1 else ""))
            row = run_one(cfg, name, impl, batches, opts, device, bar)
            if opts.check and impl == "recpipe" and row.status == "ok":
                if name not in references:
                    references[name] = lockstep_losses(cfg, name, batches, opts, device)
                row.check = compare_losses(row.step_losses, references[name])
            measured[(name, impl)].append(row)
            if rank == 0:
                ms = row.step_ms
                result = f"{row.status}: {row.reason}" if row.status != "ok" else (
                    f"P50 {ms['p50']:.2f} ms, P90 {ms['p90']:.2f} ms, {row.samples_per_s:,.0f} samples/s"
                    + (f"; check: {row.check}" if row.check else ""))
                tqdm.write(f"recpipe bench: {row.pipeline} ({row.impl}) {result}"
                           + (f" (round {r + 1})" if opts.rounds > 1 else ""))
    rows = [merge_rounds(measured[run], cfg.data.batch_size * world) for run in runs]
    comm = time_collectives(cfg, device)  # on the same ranks, after the rows
    for row in rows:
        if row.status == "ok":
            fill_floor(row, comm)
    extra, extra_md = sections(cfg, opts, rows, batches, device, bar) if sections else ({}, [])
    extra, extra_md = {"floor": comm, **extra}, floor_md(comm) + extra_md
    bar.close()
    if rank == 0:
        _write(cfg, opts, header, rows, extra, extra_md)
    dist.barrier()
    return rows


def _write(cfg: RecpipeConfig, opts: BenchOptions, header: dict[str, Any], rows: list[Row], extra: dict[str, Any],
           extra_md: list[str]) -> None:
    """Rank 0: plots, bench.json and bench.md; the table (and with --profile the kernel classes) printed."""
    pairs = comparisons(rows)
    plots = write_plots(opts.out, rows) if opts.plots else None
    sections = {"comparisons": pairs, **extra, **({"plots": plots} if plots else {})}
    plots_md = [f"Plots: {', '.join(f'`{p}`' for p in plots['written']) or 'none'}"
                + (f" ({plots['reason']})" if plots["reason"] else ""), ""] if plots else []
    path = write_outputs(opts.out, cfg, header, rows, sections,
                         rows_md(rows) + comparisons_md(pairs) + extra_md + plots_md)
    print(format_table(rows))
    if opts.profile and gpu_time_table(rows, markdown=False):
        print(f"GPU ms per step by kernel class (share of summed kernel time):\n{gpu_time_table(rows, markdown=False)}")
    for p in (plots or {}).get("written", []):
        print(f"wrote {Path(opts.out) / p}")
    print(f"wrote {path} and {path.with_suffix('.md')}")


def pregenerate(cfg: RecpipeConfig, rank: int, world: int, count: int, device: torch.device) -> list[Batch]:
    """``count`` host batches of this rank's train split, in pageable memory: a run hands each to the
    pipeline in a pinned buffer of its own, as the trainer's loader does (``run.fed_as_trained``);
    pinned pages would be copied into every forked producer."""
    pageable = cfg.model_copy(update={"data": cfg.data.model_copy(update={"pin_memory": False})})
    batches = list(itertools.islice(iter(make_dataloader(pageable, rank=rank, world_size=world, split="train")), count))
    if min(counts := gather(len(batches))) < count:
        raise ValueError(f"the bench needs {count} batches per rank, the data gave (per rank) {counts}")
    return batches


def lockstep_losses(cfg: RecpipeConfig, name: str, batches: list[Batch], opts: BenchOptions,
                    device: torch.device) -> list[list[float]] | str:
    """Collective: every rank's losses of ``name`` run again on a fresh model with the host waiting for
    the device after every step (no step's work can run ahead of the one before: whatever a pipeline
    overlaps, it overlaps only inside a step), or why that run failed."""
    cfg_p = config_for_pipeline(cfg, name)[0]
    local = run_local(cfg_p, "recpipe", batches, opts, device, tqdm(disable=True), label=name, lockstep=True)
    per_rank = gather(local)
    failed = [f"rank {i}: {r.reason}" for i, r in enumerate(per_rank) if r.status != "ok"]
    return "; ".join(failed) if failed else [r.losses for r in per_rank]


def compare_losses(losses: list[list[float]], reference: list[list[float]] | str) -> str:
    """``equal`` when every rank's every step's loss equals the reference's bit for bit; else what differs."""
    if isinstance(reference, str):
        return f"not checked (the run in lockstep failed: {reference})"
    for rank, (got, want) in enumerate(zip(losses, reference)):
        if len(got) != len(want):
            return f"differs: rank {rank} has {len(got)} losses, the run in lockstep {len(want)}"
        for step, (a, b) in enumerate(zip(got, want)):
            if a != b and not (a != a and b != b):  # NaN on both sides is the same outcome
                worst = max(abs(x - y) for x, y in zip(got, want))
                return f"differs: rank {rank} from step {step + 1} ({a!r} vs {b!r}; largest difference {worst:.3g})"
    return "equal"


def run_one(cfg: RecpipeConfig, name: str, impl: str, batches: list[Batch], opts: BenchOptions,
            device: torch.device, bar: tqdm) -> Row:
    """Collective: every rank runs (name, impl) and the row combines all ranks."""
    row = Row(pipeline=name, impl=impl)
    cfg_p, row.config_overrides, skip = config_for_pipeline(cfg, name)
    if cfg_p is None:
        row.status, row.reason = "skipped", skip
        bar.update(len(batches))
        return row
    local = run_local(cfg_p, impl, batches, opts, device, bar, label=name)
    return combine(row, gather(local), cfg.data.batch_size * dist.get_world_size(), opts.steps)
