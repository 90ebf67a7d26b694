"""Rank 0's files in ``logging.run_dir``: ``config.yaml``, TensorBoard scalars, ``summary.json``.

Every write goes through :class:`RunDir`, which turns a failed write (full disk,
read-only filesystem, no permission) into one :class:`~recpipe.errors.StorageError`
naming the directory, the file and the cause (exit code 6) instead of a traceback.
Opening is collective: rank 0 creates the directory and ``config.yaml`` and every
rank raises the same error when it cannot, before any step is trained. A write that
fails later (TensorBoard's writer thread reports a failed write at the next scalar
or at close) is rank 0's alone: it reports it, and the launcher ends the other ranks.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter

from recpipe.config import RecpipeConfig
from recpipe.errors import StorageError, storage_problem

__all__ = ["RunDir"]


def _writer_thread_errors_are_reported(args: threading.ExceptHookArgs) -> None:
    """``threading.excepthook`` while a TensorBoard writer is open: its writer thread keeps
    a failed write (a full disk) and raises it again, which Python prints as a traceback
    of that thread; RunDir reports it in one line at the next scalar or at close, so the
    thread's own traceback is not printed. Every other thread's goes to the previous hook."""
    if isinstance(args.exc_value, OSError) and type(args.thread).__module__.startswith("tensorboard."):
        return
    _PREVIOUS_EXCEPTHOOK(args)


_PREVIOUS_EXCEPTHOOK = threading.excepthook


class RunDir:
    """``logging.run_dir`` as rank 0 writes it; on other ranks every method does nothing."""

    def __init__(self, cfg: RecpipeConfig, rank: int) -> None:
        self.path = Path(cfg.logging.run_dir)
        self.rank = rank
        self.writer: SummaryWriter | None = None
        problem = None
        if rank == 0:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
                (self.path / "config.yaml").write_text(cfg.to_yaml())
                self.writer = SummaryWriter(str(self.path)) if cfg.logging.tensorboard else None
                threading.excepthook = _writer_thread_errors_are_reported
            except OSError as err:
                problem = self._message(err, self.path / "config.yaml")
        shared = [problem]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(shared, src=0)  # every rank stops before training
        if shared[0] is not None:
            raise StorageError(shared[0])

    def _message(self, err: BaseException, file: Path) -> str:
        return f"cannot write logging.run_dir={str(self.path)!r} ({file}): {storage_problem(err, file)}"

    def scalars(self, step: int, scalars: dict[str, float]) -> None:
        if self.writer is None:
            return
        try:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)
        except OSError as err:  # raised by the writer thread's failed write
            raise StorageError(self._message(err, self.path / "events.out.tfevents.*"), every_rank=False) from err

    def close(self) -> None:
        if self.writer is None:
            return
        writer, self.writer = self.writer, None
        try:
            writer.close()  # flushes what the writer thread still holds
        except OSError as err:
            raise StorageError(self._message(err, self.path / "events.out.tfevents.*"), every_rank=False) from err

    def write_summary(self, summary: dict[str, Any]) -> Path:
        """``summary.json`` (strict JSON: the caller replaced non-finite numbers)."""
        path = self.path / "summary.json"
        if self.rank == 0:
            try:
                path.write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
            except OSError as err:
                raise StorageError(self._message(err, path), every_rank=False) from err
        return path
