"""``recpipe train --config PATH [--set KEY=VALUE ...] [--debug]``, and :func:`train`, the
same from a trainer script (with its own pipeline class: ``pipeline_class=``).

The config is loaded, validated and checked (``recpipe.preflight``) here, in the
launching process, so a bad config exits with code 2 before any process starts. Then:

* under torchrun (RANK, WORLD_SIZE, MASTER_ADDR set; any number of machines): this
  process is one rank and trains directly; rank 0 locks the run directories;
* otherwise: this process locks ``checkpoint.dir`` and ``logging.run_dir``
  (``recpipe.run_lock``), starts ``distributed.nproc`` processes on this machine
  (``launch_local``), one rank each, and waits for them, forwarding SIGTERM / SIGINT /
  SIGHUP; when a run ends in a way rank 0 could not write (a rank failed or was killed,
  rank 0 stopped, the forkserver lost), it says so in ``summary.json`` (``settle_summary``).

Every rank runs :func:`run_rank`: a signal asks it to stop at a step boundary
(``recpipe.train.preemption``); a user error (bad data, a checkpoint that cannot be
written, a non-finite loss) becomes one line and its exit code (``recpipe.errors``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

from recpipe.callables import class_spec
from recpipe.checkpoint.store import describe_newest
from recpipe.config import RecpipeConfig, apply_override, config_from_dict, load_config, parse_overrides
from recpipe.distributed import (init_process_group, job_key, job_store, leave_after_failure, shutdown_process_group,
                                 torchrun_overrides)
from recpipe.launch_preload import under_torchrun
from recpipe.launcher import launch_local
from recpipe.errors import LauncherFailed, StopRequested, exit_code_of, report
from recpipe.exit_codes import EXIT_WORKER_FAILED
from recpipe.preflight import Machine, check_memory, preflight
from recpipe.run_lock import hold_run_dirs, hold_run_dirs_on_rank0
from recpipe.stop_requests import defer_requests, describe_request, install_signal_handlers, requested_signal
from recpipe.train.preemption import watch_launcher
from recpipe.train.run_dir import read_summary, settle_summary
from recpipe.train.startup import StartupClock


def _silent(line: str) -> None:
    """What ranks other than 0 print of the memory plan: nothing."""


def run_rank(cfg: RecpipeConfig, debug: bool, lock_dirs: bool = False, startup: StartupClock | None = None) -> int:
    """One rank of ``recpipe train``, the whole life of its process: train; return
    0, or the exit code of a user error after reporting it (once for the job when
    every rank has it), or of a signal before training started. A bug propagates with
    its traceback. ``lock_dirs``: under torchrun, where ``recpipe.cli`` has installed
    the signal handlers, rank 0 locks the run directories; otherwise this is a rank of
    ``launch_local``, whose launcher holds them and whose signals wait, blocked, for
    the handlers installed here. ``startup``: the command's start-up clock
    (``recpipe.train.startup``)."""
    # Here, not at the top: the launcher, which runs no rank, never imports the trainer (its
    # ranks are forked from a server that has it: recpipe.launch_preload)
    from recpipe.train.trainer import run_worker

    if lock_dirs and startup is not None:  # under torchrun this process is the rank: its imports are its own
        startup.lap("imports")
    rank = int(os.environ.get("RANK", "0"))
    failed = False
    # Under torchrun no launcher of recpipe's outlives the ranks: rank 0 says how a run it
    # could not finish ended (settle_summary), as far as it can.
    settles = lock_dirs and rank == 0
    summary_before = read_summary(cfg.logging.run_dir) if settles else None
    try:  # a signal may raise StopRequested anywhere before training, the error path below included
        try:
            if lock_dirs:  # under torchrun: its launcher is torchrun, which recpipe does not supervise
                with watch_launcher() if "TORCHELASTIC_RUN_ID" in os.environ else contextlib.nullcontext():
                    init_process_group(cfg)
                    with hold_run_dirs_on_rank0(cfg.logging.run_dir, cfg.checkpoint.dir):
                        run_worker(cfg, startup)
            else:
                install_signal_handlers("train")
                run_worker(cfg, startup)
        except Exception as err:
            if settles:
                settle_summary(cfg.logging.run_dir, summary_before, exit_code_of(err) or EXIT_WORKER_FAILED,
                               (str(err).strip().splitlines() or [type(err).__name__])[0])
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


def _local_rank(cfg: RecpipeConfig, debug: bool, startup: StartupClock) -> None:
    """``launch_local``'s target (module level: multiprocessing pickles it); exits with the rank's code."""
    code = run_rank(cfg, debug, startup=startup)
    if code:
        sys.exit(code)


def _launch_failed(err: ProcessException) -> int:
    """The launcher's exit code for a failed rank. A rank that exited with a code
    of its own has printed why; otherwise print its traceback (a bug or a crash)."""
    if isinstance(err, ProcessExitedException) and err.exit_code > EXIT_WORKER_FAILED:
        return err.exit_code
    print(f"recpipe train: rank {err.error_index} failed:\n{err}", file=sys.stderr)
    return EXIT_WORKER_FAILED


def _failure_line(err: ProcessException) -> str:
    """A failed rank in one line, for summary.json: how it ended, or its exception's last line."""
    if isinstance(err, ProcessExitedException):
        return str(err)
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"rank {err.error_index} failed: {lines[-1] if lines else type(err).__name__}"


def main_train(args: argparse.Namespace) -> int:
    startup = StartupClock()  # from this process's start
    startup.lap("imports")
    cfg = load_config(args.config, [*args.overrides, *torchrun_overrides()])  # ConfigError -> exit 2
    startup.lap("config")
    return run_train(cfg, args.debug, startup)


def train(cfg: RecpipeConfig, pipeline_class: type | None = None, debug: bool = False) -> int:
    """``recpipe train`` from a trainer script: returns its exit code, a user error reported
    in one line as the command reports it (``debug``: with its traceback), and a SIGTERM /
    SIGINT / SIGHUP handled as the command handles it. ``pipeline_class``: a subclass of the
    configured pipeline's class, trained in its place with the configured options and speed
    features (it becomes ``pipeline.class``, imported by name in every rank: its module must
    import without starting a run, so a script keeps its entry point under
    ``if __name__ == "__main__":``, as every multiprocessing program). Under torchrun each
    rank runs the script, and ``distributed.nproc`` is torchrun's."""
    install_signal_handlers("train")
    startup = StartupClock(started_at=time.time())  # from this call: the script's own start is not ours
    try:
        try:
            overrides = parse_overrides(torchrun_overrides())
            if pipeline_class is not None:
                overrides["pipeline.class"] = class_spec(pipeline_class)
            if overrides:
                raw = cfg.editable_dump()
                for key, value in overrides.items():
                    apply_override(raw, key, value)
                cfg = config_from_dict(raw, f"the trainer script's config with {', '.join(overrides)}")
            startup.lap("config")
            return run_train(cfg, debug, startup)
        except Exception as err:
            if exit_code_of(err) is None:
                raise  # a bug: keep the traceback
            return report("train", err, debug=debug)
    except StopRequested as stop:
        return report("train", stop)
    finally:
        defer_requests()  # the run is over: a later signal is recorded, and forgotten by the next run


def run_train(cfg: RecpipeConfig, debug: bool = False, startup: StartupClock | None = None) -> int:
    """``recpipe train`` on a loaded config: every pre-launch check, the memory plan, then the
    ranks; returns the exit code (user errors before launch raise, for ``recpipe.cli``).
    ``startup``: the start-up clock of the command (else from this call)."""
    startup = startup or StartupClock(started_at=time.time())
    machine = Machine.here()
    preflight(cfg, machine)  # ConfigError -> exit 2, DataError -> 5: before any process starts
    world_size = cfg.distributed.nproc  # WORLD_SIZE under torchrun (torchrun_overrides)
    first = int(os.environ.get("RANK", "0")) == 0  # under torchrun every rank runs this; rank 0 says it
    if first:
        refused = check_memory(cfg, machine, world_size=world_size)
    else:
        refused = check_memory(cfg, machine, world_size=world_size, log=_silent, refusal=_silent)
    if refused is not None:
        return refused
    startup.lap("preflight")
    if under_torchrun():
        code = run_rank(cfg, debug, lock_dirs=True, startup=startup)  # a bug raises, and torchrun reports the rank
    else:
        with hold_run_dirs(cfg.logging.run_dir, cfg.checkpoint.dir):  # DirInUseError -> exit 7, StorageError -> 6 (recpipe.cli)
            summary_before = read_summary(cfg.logging.run_dir)
            error = None
            try:
                launch_local(_local_rank, cfg.distributed.nproc, cfg, debug, startup, handles_signals=True)
                code = 0
            except ProcessException as err:
                code, error = _launch_failed(err), _failure_line(err)
            except LauncherFailed as err:
                error = f"{err}; {describe_newest(cfg.checkpoint.dir)}"
                code = report("train", LauncherFailed(error), debug=debug)
            finally:
                defer_requests()  # the ranks have ended: a signal from now on has nothing left to stop
            if code:  # what rank 0 could not write: a rank failed or was killed, rank 0 stalled, ...
                settle_summary(cfg.logging.run_dir, summary_before, code, error)
    signum = requested_signal()
    if code == 0 and signum is not None and first:
        print(f"recpipe train: {describe_request(signum)} came after the last step: the run completed", file=sys.stderr,
              flush=True)
    return code
