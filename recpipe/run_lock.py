"""One run per directory: ``checkpoint.dir`` and ``logging.run_dir`` are locked while a run uses them.

Two runs on one directory would interleave their checkpoints (and prune each
other's) or mix their TensorBoard files. The lock is ``DIR/.recpipe.lock``, held
with ``fcntl.flock`` for the whole run by the process that owns it: the launcher
of ``recpipe train``, or rank 0 under torchrun. The file names the holder (pid,
host, start time) so that a refused run can say who holds it.

The kernel releases a flock when its process ends, however it ends, so a lock left
by a dead process is free: the next run takes it over and warns with the dead
holder's pid and host (a clean exit empties the file; a killed one cannot). On NFS
(v4, or v3 with lockd) Linux maps flock onto POSIX locks, which hold across
machines. The file stays in place: an existing lock file can be locked again even
after its directory became read-only. A directory that cannot be created or whose
lock file cannot be created (read-only, full, no permission) is a ``StorageError``
(exit 6, as for any write recpipe cannot make there), not a directory in use.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
import warnings
from pathlib import Path
from typing import Iterator

import torch.distributed as dist

from recpipe.errors import DirInUseError, StorageError, storage_problem

__all__ = ["LOCK_FILE", "DirLock", "hold_run_dirs", "hold_run_dirs_on_rank0"]

LOCK_FILE = ".recpipe.lock"


def _describe(holder: str) -> str:
    try:
        info = json.loads(holder)
        return f"pid {info['pid']} on host {info['host']} (started {info['started']})"
    except (ValueError, KeyError, TypeError):
        return f"an unknown holder ({holder.strip()[:200]!r})"


class DirLock:
    """An exclusive lock on ``directory`` for this process; ``release()`` frees it."""

    def __init__(self, directory: str | Path, key: str) -> None:
        self.directory = Path(directory)
        self.key = key  # the config key that names the directory, for messages
        self.path = self.directory / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> "DirLock":
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:  # read-only, full, no permission: a storage problem (exit 6), not a lock held
            raise StorageError(f"cannot write {self.key}={str(self.directory)!r} ({err.filename or self.path}): "
                               f"{storage_problem(err, self.directory)}") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace")
            os.close(fd)
            raise DirInUseError(
                f"{self.key}={str(self.directory)!r} is in use by another recpipe run: {_describe(holder)} holds "
                f"{self.path}. Wait for that run to end or stop it, or give this run another {self.key}"
            ) from None
        previous = os.pread(fd, 4096, 0).decode(errors="replace")
        if previous.strip():
            warnings.warn(
                f"{self.key}={str(self.directory)!r}: taking over the lock left by {_describe(previous)}, "
                "which ended without releasing it (killed or crashed)",
                stacklevel=2,
            )
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        except OSError:
            pass  # the lock holds without the note (e.g. a full disk); a refused run then names no holder
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # a clean exit: the next run has nothing to take over
        except OSError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _run_dirs(run_dir: str | None, checkpoint_dir: str | None) -> list[tuple[str, str]]:
    """(config key, directory) of each distinct directory, once: a process cannot
    take a second flock on a file it has locked already."""
    seen: set[Path] = set()
    out = []
    for key, value in (("logging.run_dir", run_dir), ("checkpoint.dir", checkpoint_dir)):
        if value is not None and Path(value).resolve() not in seen:
            seen.add(Path(value).resolve())
            out.append((key, value))
    return out


@contextlib.contextmanager
def hold_run_dirs(run_dir: str | None, checkpoint_dir: str | None) -> Iterator[None]:
    """Lock ``run_dir`` (``logging.run_dir``) and ``checkpoint_dir`` (``checkpoint.dir``),
    creating them, for the block (None: no directory); raises :class:`DirInUseError`
    naming the holder when another run has one, and :class:`StorageError` when one
    cannot be written."""
    with contextlib.ExitStack() as stack:
        for key, directory in _run_dirs(run_dir, checkpoint_dir):
            lock = DirLock(directory, key).acquire()
            stack.callback(lock.release)
        yield


@contextlib.contextmanager
def hold_run_dirs_on_rank0(run_dir: str | None, checkpoint_dir: str | None) -> Iterator[None]:
    """Collective, for ranks started by torchrun: rank 0 locks the run directories
    for the block; when it cannot, every rank raises rank 0's DirInUseError or
    StorageError."""
    with contextlib.ExitStack() as stack:
        problem = None
        if dist.get_rank() == 0:
            try:
                stack.enter_context(hold_run_dirs(run_dir, checkpoint_dir))
            except (DirInUseError, StorageError) as err:
                problem = (isinstance(err, StorageError), str(err))
        shared = [problem]
        dist.broadcast_object_list(shared, src=0)
        if shared[0] is not None:
            storage, message = shared[0]
            raise (StorageError if storage else DirInUseError)(message)
        yield
