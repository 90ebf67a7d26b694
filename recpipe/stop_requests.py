"""What SIGTERM, SIGINT and SIGHUP ask of a ``recpipe`` process, from its first line to its exit.

Every ``recpipe`` command installs the handlers first thing (``recpipe.cli.main``, which
is also how a torchrun rank starts), and a rank of ``launch_local`` first thing in its
life; they stay for the rest of the process. A request goes through two phases:

* **starting** (the imports, the config checks; in ``recpipe train`` the launcher until
  its ranks run and the ranks until training starts: model build, sharding, resume):
  nothing is trained yet, so nothing can be saved. The handler raises
  :class:`recpipe.errors.StopRequested` at once, wherever the main thread is; the
  command turns it into one line, ``stopped by SIGTERM before training started``, and
  exit 128 + signal. A Python handler runs only between two bytecodes: a main thread
  that waits in C++ (a rendezvous or a collective with a peer that has already left
  on the same signal, a library's import) cannot run it. So a thread watches for the
  signal too (``signal.set_wakeup_fd``) and, when the main thread has not taken the
  request within ``STUCK_MAIN_S``, says the same line and ends the process itself.
* **recorded** (``defer_requests()``: when ``recpipe.train.preemption.Preemption``
  starts, by the launcher once its ranks have ended, and when a command returns): the
  handler records the request and returns; in training every rank stops together at a
  step boundary after a checkpoint.

The same signal again within ``REPEAT_WINDOW_S`` is the same request delivered twice
(Ctrl-C reaches every process of the terminal's group and the launcher forwards it
too; SLURM signals every process of a step). A later one ends the process at once:
exit 128 + signal, nothing saved.

SIGHUP (the job's terminal or its controlling process is gone) asks what SIGTERM asks, and ends
the run with 129. A rank whose launcher (torchrun) is gone asks the same with
``LAUNCHER_GONE``, a request code that is no signal, so that messages tell the two apart.

Processes that a rank forks to make its batches (``recpipe.data``) ignore these signals
(:func:`ignore_stop_signals`): one sent to the whole process group is the training
process's to act on, at a step boundary. They are forked with the signals blocked
(:func:`stop_signals_blocked`), so that none reaches them before they ignore it.

No torch here: the command installs the handlers before it imports anything heavy, so
that a signal during its imports is already a request.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any, Iterator

from recpipe.errors import StopRequested, report
from recpipe.exit_codes import exit_code_for_signal

__all__ = ["LAUNCHER_GONE", "REPEAT_WINDOW_S", "SIGNALS", "defer_requests", "describe_request",
           "ignore_stop_signals", "install_signal_handlers", "request", "request_age_s", "requested_signal",
           "signal_of", "stop_signals_blocked"]

REPEAT_WINDOW_S = 1.0
STUCK_MAIN_S = 1.0
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# The request of a rank whose launcher (torchrun) is gone: no signal number (above them all),
# ending the run as SIGHUP does (exit 129, ``signal_of``).
LAUNCHER_GONE = 0x100 | signal.SIGHUP


class _Requests:
    """What this process's handlers have seen in the current run (module state: handlers
    are process-wide); cleared when a run starts."""

    signum: int | None = None
    first_at = 0.0
    deferred = False
    taken = False  # the main thread raised StopRequested for the request
    command = ""  # for the line the watching thread prints: "recpipe train: ..."


def requested_signal() -> int | None:
    """The signal that asked this process to stop, or None."""
    return _Requests.signum


def request_age_s() -> float | None:
    """Seconds since the request of :func:`requested_signal` came, or None."""
    return None if _Requests.signum is None else time.monotonic() - _Requests.first_at


def signal_of(code: int) -> int:
    """The signal a request ends the run with (exit 128 + it): the request's own, SIGHUP for ``LAUNCHER_GONE``."""
    return code & 0xFF


def describe_request(signum: int) -> str:
    """What asked the ranks to stop, for messages: "SIGTERM", or that a launcher is gone."""
    if signum == LAUNCHER_GONE:
        return "the loss of a rank's launcher (torchrun)"
    return signal.Signals(signum).name


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block ``SIGNALS`` in this thread for the block: a process forked in it starts with them
    blocked (pending, not lost, not acted on by the parent's handlers) until it sets its own."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def ignore_stop_signals() -> None:
    """In a process that makes batches for a rank, first thing: ignore ``SIGNALS`` (one sent to
    the whole process group is the rank's to act on; a pending one is dropped) and unblock them."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def request(signum: int) -> None:
    """Record a request to stop (from any thread); the first one counts."""
    if _Requests.signum is None:
        _Requests.signum, _Requests.first_at = signum, time.monotonic()


def _stop_for(signum: int) -> StopRequested:
    """The exception of a request in the starting phase, as ``command`` says it."""
    stop = StopRequested(signum, f"stopped by {describe_request(signum)}")
    return stop.before_training() if _Requests.command == "train" else stop


def _on_signal(signum: int, frame: Any) -> None:
    if _Requests.signum is None:
        request(signum)
        if not _Requests.deferred:
            _Requests.taken = True
            raise _stop_for(signum)
    elif time.monotonic() - _Requests.first_at >= REPEAT_WINDOW_S:
        name = signal.Signals(signum).name
        print(f"recpipe: second {name} on rank {os.environ.get('RANK', '0')}: stopping at once, without a checkpoint",
              file=sys.stderr, flush=True)
        os._exit(exit_code_for_signal(signum))


def install_signal_handlers(command: str) -> None:
    """Start a run's signal handling in the starting phase, for ``recpipe COMMAND``:
    forget any request seen before (an earlier run in this process), handle ``SIGNALS``
    from now on, for the rest of this process, and unblock them (a rank of
    ``launch_local`` starts with them blocked: one sent before this is delivered now).
    Main thread only; elsewhere Python cannot install handlers and this does nothing. A
    signal ignored now (SIG_IGN, as in background jobs) stays ignored. Never restored:
    until the process is gone a signal must not kill it by default, since torchrun sends
    SIGTERM to the ranks still running as soon as one has exited non-zero, and a rank
    that stops a moment later (every rank does, after a preemption) would be reported as
    killed instead of exiting with its own code; and a signal between two runs of one
    process is recorded and forgotten, not fatal."""
    _Requests.signum, _Requests.first_at, _Requests.deferred, _Requests.taken = None, 0.0, False, False
    _Requests.command = command
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _on_signal)
    _StuckMainWatch.start()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def defer_requests() -> None:
    """Leave the starting phase: from now on a request is recorded, not raised (training
    has started, and ``Preemption`` acts on it at a step boundary; or the command is
    over, and the next run forgets it)."""
    _Requests.deferred = True


class _StuckMainWatch:
    """The thread of the starting phase's second way out (see the module docstring).
    Python's C-level handler writes each signal's number to a pipe whether or not the
    main thread can run the Python handler; this thread reads it. One per process,
    started with the first handlers; it only reads and, in the rare case, exits."""

    started_in: int | None = None  # the pid whose thread runs (a forked child has none)

    @classmethod
    def start(cls) -> None:
        if cls.started_in == os.getpid():
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:  # not the main thread of the main interpreter
            os.close(read_fd)
            os.close(write_fd)
            return
        if cls.started_in is None:
            os.register_at_fork(after_in_child=cls._forget)
        cls.started_in = os.getpid()
        threading.Thread(target=cls._watch, args=(read_fd,), name="recpipe-signal-watch", daemon=True).start()

    @staticmethod
    def _forget() -> None:
        """In a forked child (a worker, a producer): its signals are its own, not news for
        its parent's thread, which reads the pipe the child inherited."""
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:  # forked from another thread than the main one: nothing set here
            pass

    @staticmethod
    def _watch(read_fd: int) -> None:
        while True:
            for signum in os.read(read_fd, 64):
                if signum not in SIGNALS or _Requests.deferred or signal.getsignal(signum) is not _on_signal:
                    continue  # recorded, or for another handler (launch_local's supervisor) to act on
                deadline = time.monotonic() + STUCK_MAIN_S
                while not _Requests.taken and not _Requests.deferred and time.monotonic() < deadline:
                    time.sleep(0.05)
                if _Requests.taken or _Requests.deferred:
                    continue
                rank = os.environ.get("RANK")
                report(_Requests.command, _stop_for(signum), rank=None if rank is None else int(rank))
                os._exit(exit_code_for_signal(signum))
