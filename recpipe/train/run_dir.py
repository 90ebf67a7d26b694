"""Rank 0's files in ``logging.run_dir``: ``config.yaml``, TensorBoard scalars (and the config
as text and as hparams, and histograms of the embedding rows' norms), ``summary.json``.

A rerun into a used ``logging.run_dir`` continues its TensorBoard run when it resumes from a
checkpoint, else starts a new one beside it (:func:`tensorboard_dir`).

Every write goes through :class:`RunDir`, which turns a failed write (full disk,
read-only filesystem, no permission) into one :class:`~recpipe.errors.StorageError`
naming the directory, the file and the cause (exit code 6) instead of a traceback.
Opening is collective: rank 0 creates the directory and ``config.yaml`` and every
rank raises the same error when it cannot, before any step is trained. A write that
fails later (TensorBoard's writer thread reports a failed write at the next scalar
or at close) is rank 0's alone: it reports it, and the launcher ends the other ranks.
"""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn

from recpipe.config import RecpipeConfig
from recpipe.errors import StorageError, storage_problem
from recpipe.exit_codes import (EXIT_BAD_CONFIG, EXIT_BAD_DATA, EXIT_CHECKPOINT, EXIT_DIR_IN_USE, EXIT_DOES_NOT_FIT,
                                EXIT_LAUNCHER_FAILED, EXIT_NONFINITE_LOSS, EXIT_STALLED, EXIT_WORKER_FAILED)
from recpipe.train.embedding_norms import local_row_norms

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["RunDir", "read_summary", "settle_summary", "status_of_exit", "tensorboard_dir", "tensorboard_runs"]


RERUN_PREFIX = "rerun_"
EVENT_FILES = "events.out.tfevents.*"


def tensorboard_runs(run_dir: Path) -> list[Path]:
    """``run_dir`` and its ``rerun_<n>`` directories, oldest first: each holds one TensorBoard run."""
    return [run_dir] + sorted((d for d in run_dir.glob(f"{RERUN_PREFIX}*")
                               if d.is_dir() and d.name.removeprefix(RERUN_PREFIX).isdigit()),
                              key=lambda d: int(d.name.removeprefix(RERUN_PREFIX)))


def tensorboard_dir(run_dir: Path, resumed_from: int) -> tuple[Path, int | None, str | None]:
    """Where this run's TensorBoard events go: (directory, purge step, what to say or None).

    One TensorBoard run never gets two event files over the same steps. A run that resumes
    from step ``s`` continues the newest TensorBoard run of ``run_dir`` (``run_dir`` itself
    or its newest ``rerun_<n>``) with TensorBoard's ``purge_step`` ``s + 1``: what the earlier
    process logged after its checkpoint is hidden, and the resumed steps are logged once. A
    fresh run into a ``run_dir`` that holds events of an earlier run starts a new TensorBoard
    run beside them, ``run_dir/rerun_<n>`` (``tensorboard --logdir`` shows each as a run)."""
    runs = tensorboard_runs(run_dir)
    used = [d for d in runs if any(d.glob(EVENT_FILES))]
    if resumed_from > 0:
        newest = used[-1] if used else run_dir
        return newest, resumed_from + 1, None
    if not used:
        return run_dir, None, None
    fresh = run_dir / f"{RERUN_PREFIX}{int(runs[-1].name.removeprefix(RERUN_PREFIX)) + 1 if len(runs) > 1 else 1}"
    return fresh, None, (f"logging.run_dir={str(run_dir)!r} holds the TensorBoard events of an earlier run; this "
                         f"run's go to {fresh} (a TensorBoard run of its own)")


# The resolved config (config.yaml's text), as TensorBoard text at the step the run starts from.
CONFIG_TAG = "config"


# Histograms of the L2 norms of each table's embedding rows: ROW_NORMS_TAG/<table>.
ROW_NORMS_TAG = "embedding_row_norms"
HParam = bool | int | float | str


def flat_hparams(tree: dict[str, Any], prefix: str = "") -> dict[str, HParam]:
    """The scalar values of a nested config dict, keyed by their dotted path
    (``optimizer.dense.lr``); lists and nulls are left out (the config text has them)."""
    out: dict[str, HParam] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_hparams(value, f"{path}."))
        elif isinstance(value, (bool, int, float, str)):
            out[path] = value
    return out


def _as_markdown_code(text: str) -> str:
    """``text`` as one Markdown code block: TensorBoard renders text as Markdown."""
    return "\n".join("    " + line for line in text.splitlines())


SUMMARY_FILE = "summary.json"
RUNNING = "running"
_STATUS_OF_EXIT = {
    EXIT_WORKER_FAILED: "failed",
    EXIT_BAD_CONFIG: "bad_config",
    EXIT_DOES_NOT_FIT: "does_not_fit",
    EXIT_NONFINITE_LOSS: "nonfinite_loss",
    EXIT_BAD_DATA: "bad_data",
    EXIT_CHECKPOINT: "storage_error",
    EXIT_DIR_IN_USE: "dir_in_use",
    EXIT_STALLED: "stalled",
    EXIT_LAUNCHER_FAILED: "launcher_failed",
}


def status_of_exit(code: int) -> str:
    """summary.json's ``status`` for a run that ended with exit ``code`` (not 0) without rank 0
    writing one: 128 + signal is a run whose ranks were killed (a second signal)."""
    return _STATUS_OF_EXIT.get(code, "killed" if code > 128 else "failed")


def read_summary(run_dir: str | Path) -> str | None:
    """The text of ``run_dir``'s summary.json, or None when there is none to read."""
    try:
        return (Path(run_dir) / SUMMARY_FILE).read_text()
    except (OSError, UnicodeDecodeError):
        return None


def settle_summary(run_dir: str | Path, before: str | None, code: int, error: str | None = None) -> None:
    """Once a run has ended with exit ``code`` (not 0): when ``run_dir``'s summary.json is this
    run's (its text is no longer ``before``, what it was when the run started) and still says
    "running", say how the run ended (:func:`status_of_exit`), with ``exit_code`` and ``error``.
    Rank 0 writes each ending it decides itself (completed, preempted, stalled, ...); this is
    for what it could not write: a rank that failed or was killed, rank 0 stopped, the ranks'
    launcher failing. Best effort: a summary that cannot be written now (a full disk, the
    cause the run already reported) stays as it is."""
    text = read_summary(run_dir)
    if text is None or text == before:
        return
    try:
        summary = json.loads(text)
    except ValueError:
        return
    if not isinstance(summary, dict) or summary.get("status") != RUNNING:
        return
    summary.update(status=status_of_exit(code), exit_code=code, error=error)
    path = Path(run_dir) / SUMMARY_FILE
    tmp = path.with_name(f".{SUMMARY_FILE}.tmp")
    try:
        tmp.write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
        tmp.replace(path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


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
    """``logging.run_dir`` as rank 0 writes it; on other ranks every method does nothing.
    ``resumed_from``: the step a resumed run starts after (0: a fresh run); see
    :func:`tensorboard_dir`. ``note``: what rank 0 should say about it, or None."""

    def __init__(self, cfg: RecpipeConfig, rank: int, resumed_from: int = 0) -> None:
        self.path = Path(cfg.logging.run_dir)
        self.rank = rank
        self.writer: SummaryWriter | None = None
        self.note: str | None = None
        problem = None
        if rank == 0:
            written = self.path / "config.yaml"
            try:
                self.path.mkdir(parents=True, exist_ok=True)
                written.write_text(cfg.to_yaml())
                if cfg.logging.tensorboard:
                    events, purge_step, self.note = tensorboard_dir(self.path, resumed_from)
                    written = events / EVENT_FILES
                    # before the writer starts: its thread's first write (the file's header) may fail
                    threading.excepthook = _writer_thread_errors_are_reported
                    # TensorBoard is imported here, where rank 0 makes its writer: no other rank
                    # and no other command needs it
                    from torch.utils.tensorboard import SummaryWriter

                    self.writer = SummaryWriter(str(events), purge_step=purge_step)
                    self.writer.add_text(CONFIG_TAG, _as_markdown_code(cfg.to_yaml()), global_step=resumed_from)
                    self._write_hparams(cfg)
            except OSError as err:
                problem = self._message(err, written)
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
            raise StorageError(self._message(err, self.path / EVENT_FILES), every_rank=False) from err

    def _write_hparams(self, cfg: RecpipeConfig) -> None:
        """The config's scalar values as this TensorBoard run's hparams, beside the eval
        metrics, whose values the HParams dashboard reads from the run's last eval scalars."""
        # TensorBoard, as above; the metrics import torchmetrics, which the launcher (it imports
        # this module) never loads
        from torch.utils.tensorboard.summary import hparams

        from recpipe.train.metrics import METRICS

        assert self.writer is not None
        metrics = {f"eval/{name}": 0.0 for name in METRICS}  # each one's last value
        experiment, session_start, _ = hparams(flat_hparams(cfg.model_dump(mode="json")), metrics)
        self.writer.file_writer.add_summary(experiment)
        self.writer.file_writer.add_summary(session_start)

    def embedding_row_norms(self, step: int, model: nn.Module) -> None:
        """A histogram of each table's row L2 norms, of the rows rank 0 holds (at most
        ``embedding_norms.MAX_ROWS`` a table; column_wise tables are left out)."""
        if self.writer is None:
            return
        try:
            for table, norms in local_row_norms(model).items():
                self.writer.add_histogram(f"{ROW_NORMS_TAG}/{table}", norms, step)
        except OSError as err:  # raised by the writer thread's failed write
            raise StorageError(self._message(err, self.path / EVENT_FILES), every_rank=False) from err

    def close(self) -> None:
        if self.writer is None:
            return
        writer, self.writer = self.writer, None
        try:
            writer.close()  # flushes what the writer thread still holds
        except OSError as err:
            raise StorageError(self._message(err, self.path / EVENT_FILES), every_rank=False) from err

    def write_summary(self, summary: dict[str, Any]) -> Path:
        """``summary.json`` (strict JSON: the caller replaced non-finite numbers)."""
        path = self.path / SUMMARY_FILE
        if self.rank == 0:
            try:
                path.write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
            except OSError as err:
                raise StorageError(self._message(err, path), every_rank=False) from err
        return path
