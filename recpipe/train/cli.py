"""``recpipe train --config PATH [--set KEY=VALUE ...] [--debug]``.

The config is loaded and validated here, in the launching process, so a bad config
exits with code 2 before any process starts. Then:

* under torchrun (RANK, WORLD_SIZE, MASTER_ADDR set; any number of machines): this
  process is one rank and trains directly; rank 0 locks the run directories;
* otherwise: this process locks ``checkpoint.dir`` and ``logging.run_dir``
  (``recpipe.run_lock``), starts ``distributed.nproc`` processes on this machine
  (``launch_local``), one rank each, and waits for them, forwarding SIGTERM / SIGINT.

Every rank runs :func:`run_rank`: a signal asks it to stop at a step boundary
(``recpipe.train.preemption``); a user error (bad data, a checkpoint that cannot be
written, a non-finite loss) becomes one line and its exit code (``recpipe.errors``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import TYPE_CHECKING

import torch
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

from recpipe.config import RecpipeConfig, check_device, load_config
from recpipe.data import check_data
from recpipe.distributed import (init_process_group, job_key, job_store, launch_local, leave_after_failure,
                                 shutdown_process_group, torchrun_overrides, under_torchrun)
from recpipe.errors import DoesNotFitError, StopRequested, exit_code_of, report
from recpipe.exit_codes import EXIT_DOES_NOT_FIT, EXIT_WORKER_FAILED
from recpipe.run_lock import hold_run_dirs, hold_run_dirs_on_rank0
from recpipe.sharding import check_model_config
from recpipe.stop_requests import defer_requests, describe_request, install_signal_handlers, requested_signal
from recpipe.train.checkpoint import check_checkpoint_config, check_resume
from recpipe.train.preemption import watch_launcher
from recpipe.train.trainer import run_worker

if TYPE_CHECKING:
    from recpipe.planner import MemoryPlan


def _check_memory_plan(cfg: RecpipeConfig, world_size: int, on_cuda: bool, verbose: bool) -> int | None:
    """Return 3 (and say why) when the memory plan does not fit, before anything is
    allocated. Every rank evaluates it (a pure function), so under torchrun all refuse
    together. On CUDA: print the planner's per-rank HBM summary and check each rank
    against its GPU. On CPU the tables, optimizer states and batches the plan counts live
    in host memory: the ranks on this machine together against its available memory."""
    from recpipe.planner import check_fits, plan_from_config, summary

    plan = plan_from_config(cfg, world_size=world_size)
    if not on_cuda:
        problem = _host_memory_problem(plan, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        if problem is None:
            return None
        err = DoesNotFitError(f"refusing to start, the configuration does not fit in this machine's memory: {problem}")
        return report("train", err) if verbose else EXIT_DOES_NOT_FIT
    if verbose:
        print(summary(plan), flush=True)
    problem = check_fits(plan)
    if problem is None:
        return None
    if verbose:
        print(f"recpipe train: refusing to start, the configuration does not fit in GPU memory:\n{problem}", file=sys.stderr)
    return EXIT_DOES_NOT_FIT


def _host_memory_problem(plan: "MemoryPlan", local_ranks: int) -> str | None:
    """Why ``local_ranks`` CPU ranks of ``plan`` cannot be held by this machine's available
    memory (the largest ranks of the plan, as a node of torchrun may hold any), or None."""
    from recpipe.planner.plan import fmt_bytes

    ranks = sorted(plan.ranks, key=lambda r: r.hbm_allocated_bytes, reverse=True)[:local_ranks]
    needed = sum(r.hbm_allocated_bytes + r.ddr_bytes for r in ranks)
    available = host_memory_available()
    if available is None or needed <= available:
        return None
    counted = [t for t in ranks[0].terms if t.side == "hbm" and t.category in ("static", "per_step")]
    big = ", ".join(f"{t.name} {fmt_bytes(t.bytes)}" for t in sorted(counted, key=lambda t: -t.bytes)[:3])
    return (f"{len(ranks)} rank(s) on CPU need about {fmt_bytes(needed)} (rank {ranks[0].rank}'s largest: {big}), "
            f"{fmt_bytes(available)} is available; shrink the tables or data.batch_size, or train on GPUs")


def host_memory_available() -> int | None:
    """This machine's available memory (MemAvailable of /proc/meminfo), or None off Linux."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_rank(cfg: RecpipeConfig, debug: bool, lock_dirs: bool = False) -> int:
    """One rank of ``recpipe train``, the whole life of its process: train; return
    0, or the exit code of a user error after reporting it (once for the job when
    every rank has it), or of a signal before training started. A bug propagates with
    its traceback. ``lock_dirs``: under torchrun, where ``recpipe.cli`` has installed
    the signal handlers, rank 0 locks the run directories; otherwise this is a rank of
    ``launch_local``, whose launcher holds them and whose signals wait, blocked, for
    the handlers installed here."""
    rank = int(os.environ.get("RANK", "0"))
    failed = False
    try:  # a signal may raise StopRequested anywhere before training, the error path below included
        try:
            if lock_dirs:  # under torchrun: its launcher is torchrun, which recpipe does not supervise
                with watch_launcher() if "TORCHELASTIC_RUN_ID" in os.environ else contextlib.nullcontext():
                    init_process_group(cfg)
                    with hold_run_dirs_on_rank0(cfg):
                        run_worker(cfg)
            else:
                install_signal_handlers("train")
                run_worker(cfg)
        except Exception as err:
            if exit_code_of(err) is None:
                failed = True
                leave_after_failure()
                raise
            if not getattr(err, "every_rank", True) and not _first_to_say_it():
                return exit_code_of(err)
            return report("train", err, rank=rank, debug=debug)
        finally:
            if not failed:
                shutdown_process_group()
    except StopRequested as stop:
        return report("train", stop, rank=rank, debug=debug)
    return 0


def _first_to_say_it() -> bool:
    """For an error of this rank's own (bad data it read): whether it is the job's first,
    counted in the job's store. A damaged file that several ranks read is then said once;
    the others exit with the same code, silently."""
    store = job_store()
    return store is None or store.add(job_key("rank_errors"), 1) == 1


def _local_rank(cfg: RecpipeConfig, debug: bool) -> None:
    """``launch_local``'s target (module level: multiprocessing pickles it); exits with the rank's code."""
    code = run_rank(cfg, debug)
    if code:
        sys.exit(code)


def _launch_failed(err: ProcessException) -> int:
    """The launcher's exit code for a failed rank. A rank that exited with a code
    of its own has printed why; otherwise print its traceback (a bug or a crash)."""
    if isinstance(err, ProcessExitedException) and err.exit_code > EXIT_WORKER_FAILED:
        return err.exit_code
    print(f"recpipe train: rank {err.error_index} failed:\n{err}", file=sys.stderr)
    return EXIT_WORKER_FAILED


def main_train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, [*args.overrides, *torchrun_overrides()])  # ConfigError -> exit 2
    check_checkpoint_config(cfg.checkpoint)
    check_resume(cfg)  # another distributed.nproc or optimizer than the checkpoint's: ConfigError -> exit 2
    cuda = torch.cuda.is_available()
    check_device(cfg, cuda)  # ConfigError -> exit 2
    check_data(cfg)  # missing TSV files: ConfigError -> 2; a damaged binary dataset: BinaryDataError -> 5
    on_cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and cuda)
    # The model's tables (a model.factory model's are known only now, built on meta)
    # against sharding.*: ConfigError -> exit 2, before any process starts.
    check_model_config(cfg, device_type="cuda" if on_cuda else "cpu")
    world_size = cfg.distributed.nproc  # WORLD_SIZE under torchrun (torchrun_overrides)
    first = int(os.environ.get("RANK", "0")) == 0  # under torchrun every rank runs this
    refused = _check_memory_plan(cfg, world_size, on_cuda, verbose=first)
    if refused is not None:
        return refused
    if under_torchrun():
        code = run_rank(cfg, args.debug, lock_dirs=True)  # a bug raises, and torchrun reports the rank
    else:
        with hold_run_dirs(cfg):  # DirInUseError -> exit 7, StorageError -> 6 (recpipe.cli)
            try:
                launch_local(_local_rank, cfg.distributed.nproc, cfg, args.debug, handles_signals=True)
                code = 0
            except ProcessException as err:
                code = _launch_failed(err)
            finally:
                defer_requests()  # the ranks have ended: a signal from now on has nothing left to stop
    signum = requested_signal()
    if code == 0 and signum is not None and first:
        print(f"recpipe train: {describe_request(signum)} came after the last step: the run completed", file=sys.stderr,
              flush=True)
    return code
