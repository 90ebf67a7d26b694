"""Errors a user can act on, and how a command reports them.

A :class:`UserError` carries its exit code (``recpipe.exit_codes``) and says whether
every rank raises it identically (``every_rank``: a config problem, a checkpoint
that all ranks agreed cannot be written, a non-finite loss all ranks agreed on).
Such an error is reported by rank 0 only, once for the whole job; a rank-local one
(a malformed line that only one rank reads) by the rank that hit it (``recpipe train``:
the first rank that hit one, when several do). :func:`report`
prints one line, ``recpipe CMD: [rank R: ]message [exit N]``, and the traceback only
with ``--debug``. Anything else is a bug or a crash and keeps its traceback.
"""

from __future__ import annotations

import errno
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Iterable, Iterator, TypeVar

from recpipe.exit_codes import (
    EXIT_BAD_CONFIG,
    EXIT_BAD_DATA,
    EXIT_CHECKPOINT,
    EXIT_DIR_IN_USE,
    EXIT_DOES_NOT_FIT,
    EXIT_LAUNCHER_FAILED,
    EXIT_NONFINITE_LOSS,
    EXIT_WORKER_FAILED,
    exit_code_for_signal,
)

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DirInUseError",
    "DoesNotFitError",
    "LauncherFailed",
    "NonFiniteLossError",
    "PipelineError",
    "Preempted",
    "StopRequested",
    "StorageError",
    "UserError",
    "data_errors",
    "exit_code_of",
    "job_warning",
    "report",
    "storage_problem",
]

T = TypeVar("T")


class ConfigError(ValueError):
    """A config that cannot run. ``str(err)`` lists every problem, one per line (exit 2)."""


class PipelineError(RuntimeError):
    """A model or call pattern a pipeline cannot run; the message says what to change."""


class UserError(Exception):
    """A problem the user can fix; ``str(err)`` says what and how."""

    exit_code = EXIT_WORKER_FAILED

    def __init__(self, message: str, *, every_rank: bool = True) -> None:
        super().__init__(message)
        self.every_rank = every_rank


class DataError(UserError):
    exit_code = EXIT_BAD_DATA


class StorageError(UserError):
    """A directory recpipe writes (``checkpoint.dir``, ``logging.run_dir``) cannot be
    written: read-only, full, no permission. The message names the path and the cause
    (:func:`storage_problem`)."""

    exit_code = EXIT_CHECKPOINT


class CheckpointError(StorageError):
    """A checkpoint cannot be written, or none is intact."""


class DirInUseError(UserError):
    exit_code = EXIT_DIR_IN_USE


class NonFiniteLossError(UserError):
    exit_code = EXIT_NONFINITE_LOSS


class DoesNotFitError(UserError):
    """The memory plan does not fit the machine (exit 3)."""

    exit_code = EXIT_DOES_NOT_FIT


class LauncherFailed(UserError):
    """``recpipe train``'s launcher lost the server that forks its ranks (killed, stopped):
    it ended every rank (exit 9)."""

    exit_code = EXIT_LAUNCHER_FAILED


class StopRequested(BaseException):
    """A signal asked a command to stop while it was starting, before anything worth
    saving existed (``recpipe.stop_requests``). A ``BaseException``, like
    ``KeyboardInterrupt``: code that catches ``Exception`` does not swallow it. Every
    rank gets the signal (the launcher forwards it): rank 0 says it."""

    BEFORE_TRAINING = "before training started: nothing was trained or saved"
    every_rank = True

    def __init__(self, signum: int, what: str, detail: str = "") -> None:
        super().__init__(signum, what, detail)
        self.signum, self.what, self.detail = signum, what, detail
        self.exit_code = exit_code_for_signal(signum)

    def __str__(self) -> str:
        return f"{self.what} {self.detail}" if self.detail else self.what

    def before_training(self) -> "StopRequested":
        """The same request, as ``recpipe train`` says it."""
        return StopRequested(self.signum, self.what, self.BEFORE_TRAINING)


class Preempted(UserError):
    """The ranks stopped on a signal, at a step boundary, after saving (when configured)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = exit_code_for_signal(signum)


def _os_errors(err: BaseException) -> Iterator[OSError]:
    """``err`` and the exceptions it was raised from (``__cause__``, ``__context__``),
    and those DCP collected per rank (``CheckpointException.failures``), that carry an errno."""
    seen: set[int] = set()
    todo = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            yield e
        todo += [e.__cause__, e.__context__]
        for failure in getattr(e, "failures", {}).values():  # DCP: {rank: (exception, traceback)}
            todo.append(failure[0] if isinstance(failure, tuple) else failure)


def storage_problem(err: BaseException, path: str | Path) -> str:
    """Why writing under ``path`` failed, in words: "No space left on device",
    "Read-only file system", "Permission denied", ... (``os.strerror`` of the errno).
    torch's own writers (``torch.save``'s zip writer) turn a short write into a
    message without the errno ("unexpected pos 704 vs 598"); when no errno is found
    and the filesystem of ``path`` has no free block left, that is the cause."""
    for e in _os_errors(err):
        return os.strerror(e.errno)
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        stat = os.statvfs(probe)
    except OSError:
        stat = None
    if stat is not None and stat.f_bavail == 0:
        return os.strerror(errno.ENOSPC)
    return str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__


def exit_code_of(err: BaseException) -> int | None:
    """The documented exit code of a user error; None for anything else (a bug)."""
    if isinstance(err, UserError):
        return err.exit_code
    if isinstance(err, ConfigError):
        return EXIT_BAD_CONFIG
    if isinstance(err, StopRequested):
        return err.exit_code
    return None


def report(command: str, err: BaseException, *, rank: int | None = None, debug: bool = False) -> int:
    """Print ``err`` as one line on stderr (its traceback first with ``debug``) unless
    another rank reports it; return its exit code (``EXIT_WORKER_FAILED`` for a bug)."""
    code = exit_code_of(err)
    if code is None:
        code = EXIT_WORKER_FAILED
    every_rank = isinstance(err, ConfigError) or getattr(err, "every_rank", False)
    if every_rank and rank not in (None, 0):
        return code  # rank 0 says it for every rank
    if debug:
        traceback.print_exception(err, file=sys.stderr)
    who = f"rank {rank}: " if rank is not None and not every_rank else ""
    command = f"recpipe {command}" if command else "recpipe"
    message = str(err).rstrip()
    if "\n" in message:  # multi-line messages (config problems) keep their lines
        print(f"{command}: {who}{message}\n[exit {code}]", file=sys.stderr, flush=True)
    else:
        print(f"{command}: {who}{message} [exit {code}]", file=sys.stderr, flush=True)
    return code


def job_warning(message: str, stacklevel: int = 2) -> None:
    """``warnings.warn`` on rank 0 only: for what every rank of a job would warn alike (a
    setting's effect on this machine), so that the job prints it once. A process that is
    no rank of a job (no RANK in its environment) warns."""
    if os.environ.get("RANK", "0") == "0":
        warnings.warn(message, stacklevel=stacklevel + 1)


def _reader_message(err: Exception) -> str:
    """The reader's own message. A DataLoader worker's exception comes back as
    "Caught ValueError in DataLoader worker process 0. Original Traceback ...",
    whose last line is "ValueError: <the message>"."""
    text = str(err).strip()
    if "Original Traceback" in text:
        last = text.splitlines()[-1]
        return last.split(": ", 1)[1] if ": " in last else last
    return text


def data_errors(batches: Iterable[T], what: str = "training data") -> Iterator[T]:
    """Iterate ``batches``; a ``ValueError`` or ``OSError`` raised while reading (the
    readers name file:line in it) becomes a rank-local :class:`DataError`."""
    it = iter(batches)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except (ValueError, OSError) as err:
            raise DataError(f"bad {what}: {_reader_message(err)}", every_rank=False) from err
        yield batch
