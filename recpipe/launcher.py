"""Local multi-process launch: ``launch_local`` starts ``distributed.nproc`` processes on
this machine, forked by multiprocessing's forkserver (``recpipe.launch_preload``), and
watches them until every one has exited (:class:`_Supervisor`). ``recpipe train`` under
torchrun needs none of it (each process is one rank); tests launch ranks with it as well.
"""

from __future__ import annotations

import math
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing import forkserver
from multiprocessing.reduction import DupFd
from typing import Any, Callable

import torch
import torch.multiprocessing as mp
from torch.distributed import TCPStore
from torch.multiprocessing.spawn import ProcessContext, ProcessExitedException, ProcessRaisedException

from recpipe.distributed import leave_after_failure, shutdown_process_group
from recpipe.errors import LauncherFailed
from recpipe.exit_codes import EXIT_STALLED, EXIT_WORKER_FAILED, exit_code_for_signal
from recpipe.launch_preload import start_server
from recpipe.stop_requests import REPEAT_WINDOW_S, SIGNALS, request
from recpipe.system import die_with_parent


def _child(
    local_rank: int, world_size: int, port: int, launcher: "_Launcher", fn: Callable[..., Any], args: tuple,
    handles_signals: bool,
) -> None:
    # The parent is launch_local's forkserver, which ends with the launcher
    # (recpipe.launch_preload); the kernel then ends this rank (die_with_parent).
    # The stop signals are blocked here, as in the server: one sent before the rank
    # handles it stays pending instead of being lost.
    die_with_parent(os.getppid())
    try:
        os.kill(launcher.pid, 0)
    except ProcessLookupError:  # the launcher died before the prctl took effect
        os._exit(EXIT_WORKER_FAILED)
    launcher.apply()
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # Connect to the parent's store as clients (env:// then never binds a port).
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    # One intra-op thread per rank unless OMP_NUM_THREADS says otherwise: the rule of
    # recpipe.train.trainer.intra_op_threads, which recpipe train's ranks apply under
    # any launcher (here for every function launch_local runs).
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    elif os.environ["OMP_NUM_THREADS"].isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        # OpenMP read the variable when the forkserver loaded it: this launch's value applies
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    failed = False
    try:
        if not handles_signals:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _Launcher.SIGNALS)
        fn(*args)
    except KeyboardInterrupt:
        # SIGINT with Python's default handler: torch's wrapper would exit 0, as if done.
        sys.exit(exit_code_for_signal(signal.SIGINT))
    except Exception:
        failed = True  # torch's wrapper writes the traceback for the launcher, then the process ends
        leave_after_failure()
        raise
    finally:
        if not failed:
            shutdown_process_group()


class _Launcher:
    """What a rank takes from the process that launches it, read when the launch starts:
    its pid, its environment, its standard output and error (the files behind fds 1 and
    2, which a caller may have redirected since the server started) and which of the stop
    signals (``recpipe.stop_requests.SIGNALS``) it ignores (a job started in the background
    ignores SIGINT, one under nohup SIGHUP). A forked rank has the forkserver's, as they
    were when the server started (and the stop signals blocked there:
    ``recpipe.launch_preload``), so it sets these first thing, as a spawned interpreter
    would have them."""

    SIGNALS = SIGNALS
    STDIO = (1, 2)

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.environ = dict(os.environ)
        self.ignored = [sig for sig in self.SIGNALS if signal.getsignal(sig) is signal.SIG_IGN]

    def __getstate__(self) -> dict[str, Any]:
        # Pickled for a child by multiprocessing: DupFd hands the child a duplicate of
        # each of this process's stdio fds (the forkserver passes them with the fork request).
        return {**self.__dict__, "stdio": [DupFd(fd) for fd in self.STDIO]}

    def apply(self) -> None:
        for target, wrapped in zip(self.STDIO, self.__dict__.pop("stdio", ())):
            fd = wrapped.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
        os.environ.clear()
        os.environ.update(self.environ)
        for sig in self.SIGNALS:
            default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            signal.signal(sig, signal.SIG_IGN if sig in self.ignored else default)


def launch_local(fn: Callable[..., Any], nproc: int, *args: Any, handles_signals: bool = False) -> None:
    """Run ``fn(*args)`` in ``nproc`` fresh processes that form one process group
    (the caller's ``fn`` calls ``init_process_group``). Raises a
    ``torch.multiprocessing.ProcessException`` if any rank fails: a
    ``ProcessRaisedException`` with its traceback, or a ``ProcessExitedException``
    whose ``exit_code`` is the rank's (a rank that exits with one of
    ``recpipe.exit_codes`` has printed why).

    The rendezvous store lives in this process on a port the OS picks, so
    concurrent launches on one machine never race for a port. No rank outlives
    this call: see :class:`_Supervisor` for signals and failures.

    Ranks are forked by multiprocessing's forkserver, a process started at this
    process's first launch that has imported what every rank needs
    (``recpipe.launch_preload``): a launch after the first costs a fork instead of every
    rank's imports (seconds per rank with spawn), and a machine's ranks import torchrec
    once, not once each. A rank gets this process's
    environment and ignored signals as they are at the launch (:class:`_Launcher`).
    The server never initializes CUDA, so forked ranks may (as spawned ones).

    A rank starts with the stop signals (SIGTERM, SIGINT, SIGHUP) blocked, so that a
    signal forwarded to it before it can handle one waits instead of being lost; they
    are unblocked before ``fn`` runs, or, with ``handles_signals``, by ``fn`` once it
    has installed its handlers (``recpipe.stop_requests.install_signal_handlers``
    does). A SIGINT that raises KeyboardInterrupt in ``fn`` ends the rank with 130."""
    store = TCPStore("127.0.0.1", 0, world_size=nproc, is_master=True, wait_for_workers=False)
    launcher = _Launcher()  # before the supervisor replaces this process's handlers
    try:
        with _Supervisor() as supervisor:
            # A no-op where ``recpipe train`` started the server first thing (its imports then
            # overlap the launcher's); otherwise it starts under the supervisor's handlers: a
            # signal from the moment it exists is the launcher's to forward, as for the ranks.
            start_server()
            context = mp.start_processes(
                _child, args=(nproc, store.port, launcher, fn, args, handles_signals), nprocs=nproc, join=False,
                start_method="forkserver"
            )
            supervisor.watch(context)
    finally:
        del store


class _Supervisor:
    """Watches the ranks of one ``launch_local`` until every one has exited.

    Signals: the first SIGTERM, SIGINT or SIGHUP this process gets is forwarded to every
    rank (``recpipe train``'s ranks then finish the step, drain, save and exit with
    128 + signal). More within ``REPEAT_WINDOW_S`` are the same one delivered again:
    a signal to the process group reaches this process and every rank directly, and
    a wrapper (``timeout``, a shell, a scheduler's step launcher) forwards it once
    more to its child. One that comes later kills the ranks at once (SIGKILL). A
    signal ignored when the launch starts (SIG_IGN, as for background jobs) stays
    ignored.

    The server that forks the ranks (multiprocessing's forkserver, their parent) is watched
    too (:class:`_ServerWatch`): the ranks' exits reach this process through it, and the
    ranks die with it. Killed, or stopped for ``_ServerWatch.STOPPED_S`` (training would
    end and this process wait forever for exits that never come), it ends the job: every
    rank is killed and :class:`~recpipe.errors.LauncherFailed` (exit 9) names it.

    Failures: when a rank exits non-zero, the others get a grace period to end by
    themselves: ``USER_EXIT_GRACE_S`` when it exited with a code of its own (the
    other ranks are then usually raising the same error, and rank 0 prints it),
    ``CRASH_GRACE_S`` otherwise, or when it ended the job for a rank that stopped
    making steps (``EXIT_STALLED``): the rest are then waiting in a collective, or
    stopped. Then they are killed (SIGKILL ends a stopped process too). The rank reported is the first that exited
    with a code of its own, else the one whose traceback was written first, else the first that failed.
    """

    USER_EXIT_GRACE_S = 15.0
    CRASH_GRACE_S = 2.0
    SIGNALS = SIGNALS
    REPEAT_WINDOW_S = REPEAT_WINDOW_S  # the ranks' own

    def __init__(self) -> None:
        self.context: ProcessContext | None = None
        self.received: list[int] = []  # the first signal, and a second one that killed the ranks
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_Supervisor":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: Any) -> None:
        # Whatever ends the watch (an exception here, KeyboardInterrupt), no rank stays.
        self._send(signal.SIGKILL)
        for process in self.context.processes if self.context else ():
            process.join()
        # torch.multiprocessing gives every rank a file for its traceback; a rank that
        # failed with an exception wrote one, which _failure read only for the rank it
        # reports. None stays behind in the temporary directory.
        for error_file in self.context.error_files if self.context else ():
            try:
                os.unlink(error_file)
            except FileNotFoundError:
                pass
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if not self.received:
            self.received.append(signum)
            self._first_at = now
            request(signum)  # this process's record too: ``recpipe train`` says it when the run completed anyway
            # Said at once, by the process that got it: a run that ends with 128 + signal
            # always says which process was signalled.
            print(f"recpipe: {signal.Signals(signum).name} received by the launcher (pid {os.getpid()}): forwarded "
                  "to every rank", file=sys.stderr, flush=True)
            self._send(signum)
        elif len(self.received) == 1 and now - self._first_at < self.REPEAT_WINDOW_S:
            return  # the first one, delivered again (see the class docstring)
        elif len(self.received) == 1:
            self.received.append(signum)
            print(f"recpipe: second {signal.Signals(signum).name}: ending every rank now, without a checkpoint",
                  file=sys.stderr, flush=True)
            self._send(signal.SIGKILL)

    def _send(self, sig: int) -> None:
        for process in self.context.processes if self.context else ():
            if process.exitcode is None:
                try:
                    os.kill(process.pid, sig)
                except ProcessLookupError:
                    pass

    def watch(self, context: ProcessContext) -> None:
        """Wait for every rank; raise for the reported failure (see the class docstring)."""
        self.context = context
        if self.received:  # a signal came while the ranks were being started
            self._send(self.received[0] if len(self.received) == 1 else signal.SIGKILL)
        processes = context.processes
        pending = {process.sentinel: rank for rank, process in enumerate(processes)}
        failed: list[int] = []  # ranks that exited non-zero, in the order they did
        deadline = math.inf  # to kill the ranks still running, once one has failed
        server = _ServerWatch()
        while pending:
            timeout = min(_ServerWatch.POLL_S, max(0.0, deadline - time.monotonic()))
            ended = multiprocessing.connection.wait(list(pending), timeout=timeout)
            for sentinel in ended:
                processes[pending[sentinel]].join()
            # A rank's exit comes through the server: one it could not report reads as 255
            # (its death closes the pipes a moment before it can be seen dead).
            unreported = any(processes[pending[s]].exitcode == _UNREPORTED for s in ended)
            fault = server.fault(wait_s=1.0 if unreported else 0.0)
            if fault is not None:
                self._send(signal.SIGKILL)
                server.end()
                raise LauncherFailed(f"the process that forks the ranks (multiprocessing's forkserver, pid "
                                     f"{server.pid}) {fault}; every rank was ended")
            for sentinel in ended:
                rank = pending.pop(sentinel)
                if processes[rank].exitcode != 0:
                    failed.append(rank)
                    if len(failed) == 1:
                        own = self._own_exit_code(processes[rank].exitcode)
                        waiting = own is None or own == EXIT_STALLED  # the others wait in a collective
                        deadline = time.monotonic() + (self.CRASH_GRACE_S if waiting else self.USER_EXIT_GRACE_S)
            if time.monotonic() >= deadline:
                self._send(signal.SIGKILL)
                deadline = math.inf
        if failed:
            raise self._failure(context, failed)

    def _own_exit_code(self, exitcode: int) -> int | None:
        """The code a rank chose to exit with (a recpipe exit code, 128 + signal after
        a graceful stop); a rank ended by the forwarded signal itself counts as 128 + it."""
        if exitcode is not None and exitcode > EXIT_WORKER_FAILED:
            return exitcode
        if exitcode is not None and exitcode < 0 and self.received and -exitcode in self.received:
            return exit_code_for_signal(-exitcode)
        return None

    def _failure(self, context: ProcessContext, failed: list[int]) -> Exception:
        processes = context.processes
        if len(self.received) > 1:  # killed on the second signal
            rank = failed[0]
            code = exit_code_for_signal(self.received[0])
            return ProcessExitedException(f"rank {rank} killed on a second signal", rank, processes[rank].pid, code)
        own = [rank for rank in failed if self._own_exit_code(processes[rank].exitcode) is not None]
        rank = own[0] if own else _first_traceback(context, failed)
        pid, exitcode = processes[rank].pid, processes[rank].exitcode
        if own:
            code = self._own_exit_code(exitcode)
            return ProcessExitedException(f"rank {rank} exited with code {code}", rank, pid, code)
        error_file = context.error_files[rank]
        if os.access(error_file, os.R_OK):
            with open(error_file, "rb") as fh:
                trace = pickle.load(fh)
            os.unlink(error_file)
            return ProcessRaisedException(f"\n\n-- Process {rank} terminated with the following error:\n{trace}", rank, pid)
        if exitcode < 0:
            name = signal.Signals(-exitcode).name
            return ProcessExitedException(f"process {rank} terminated with signal {name}", rank, pid, exitcode, name)
        return ProcessExitedException(f"process {rank} terminated with exit code {exitcode}", rank, pid, exitcode)


_UNREPORTED = 255  # multiprocessing's exit code of a rank whose exit its forkserver did not report


def _first_traceback(context: ProcessContext, failed: list[int]) -> int:
    """The failed rank to report: the first to exit, unless another failed rank wrote its
    traceback earlier. A rank's peers see it gone only after its traceback is written
    (``recpipe.distributed.leave_after_failure``), so the earliest traceback is the cause and a
    later one a consequence ("Connection closed by peer"), whichever process the forkserver
    reports dead first: two ranks that end within a moment of each other reach this process
    in either order on a busy host."""
    first = failed[0]
    written = {}
    for rank in failed:
        try:
            written[rank] = os.stat(context.error_files[rank]).st_mtime_ns
        except OSError:  # no traceback: killed by a signal, or ended by a crash
            continue
    if first not in written:
        return first
    return min(written, key=lambda rank: (written[rank], failed.index(rank)))


class _ServerWatch:
    """The forkserver of :func:`launch_local`, a child of this process, looked at without
    reaping it (``waitid`` with ``WNOWAIT``: multiprocessing reaps it when it restarts one)."""

    POLL_S = 0.5
    # A stop that lasts this long is a fault. Job control (Ctrl-Z, then fg) stops and
    # continues the whole process group, this process with it.
    STOPPED_S = 3.0

    def __init__(self) -> None:
        # multiprocessing keeps the server's pid in its module state (no public accessor)
        self.pid: int | None = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
        if not hasattr(os, "waitid"):
            self.pid = None
        self._stopped_since: float | None = None

    def fault(self, wait_s: float = 0.0) -> str | None:
        """What happened to the server ("was killed by SIGKILL", "was stopped ..."), or None
        while it serves; waits up to ``wait_s`` for an exit that is under way."""
        end = time.monotonic() + wait_s
        while True:
            found = self._look()
            if found is not None or time.monotonic() >= end:
                return found
            time.sleep(0.02)

    def _look(self) -> str | None:
        if self.pid is None:
            return None
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WSTOPPED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # not a child this process can wait for (SIGCHLD ignored: reaped at once)
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return "is gone (its ranks die with it)"
            self.pid = None  # alive: nothing more to learn of it here
            return None
        if info is None or info.si_code == os.CLD_TRAPPED:  # serving (or in a debugger's hands)
            self._stopped_since = None
            return None
        if info.si_code == os.CLD_STOPPED:
            now = time.monotonic()
            self._stopped_since = self._stopped_since or now
            if now - self._stopped_since < self.STOPPED_S:
                return None
            return (f"was stopped ({signal.Signals(info.si_status).name}) for {self.STOPPED_S:g} s (the ranks' exits "
                    "reach the launcher through it)")
        if info.si_code == os.CLD_EXITED:
            return f"exited with code {info.si_status} (its ranks die with it)"
        return f"was killed by {signal.Signals(info.si_status).name} (its ranks die with it)"

    def end(self) -> None:
        """Kill a server that is stopped (a dead one stays for multiprocessing to reap)."""
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
