"""Exit codes of every ``recpipe`` command, in one place (docs/fault_tolerance.md, "When things go wrong").

A module of its own so that components (train, plan, bench, data, checkpoint) can
return them without importing the command-line parser.
"""

from __future__ import annotations

import signal

EXIT_OK = 0
EXIT_WORKER_FAILED = 1  # a rank failed (a bug or a crash); its traceback is printed
EXIT_BAD_CONFIG = 2  # the config or the arguments are wrong (checked before any process starts)
EXIT_DOES_NOT_FIT = 3  # the memory plan does not fit
# The model diverged: a non-finite training loss (train.on_nonfinite=error), too many skipped
# steps (skip_step: train.max_skipped_steps), a non-finite eval loss, or non-finite weights
# found before a save. Nothing was saved after the step where it began.
EXIT_NONFINITE_LOSS = 4
# The data is malformed or does not match the config: a malformed TSV line (file:line) in
# `recpipe data convert` or in training, a binary dataset that is incomplete, truncated,
# corrupt or of another layout (`recpipe data verify`, `recpipe train` before any process starts);
# no training data at all (an empty TSV file, a dataset of 0 rows, a data.factory that yields nothing).
EXIT_BAD_DATA = 5
# checkpoint.dir or logging.run_dir cannot be written (read-only, full disk, no permission), at
# the start or while training, no checkpoint in checkpoint.dir is intact, or a checkpoint file
# names code to run (refused: recpipe reads checkpoints as data only).
EXIT_CHECKPOINT = 6
EXIT_DIR_IN_USE = 7  # checkpoint.dir or logging.run_dir is locked by another recpipe run
# A rank made no training step within train.step_timeout_s (stopped, frozen, stuck in a
# collective another rank never joined): every rank was ended; the newest checkpoint is
# the last one saved before it.
EXIT_STALLED = 8
# recpipe train's launcher lost the server that forks its ranks (multiprocessing's
# forkserver, their parent): it was killed or stopped, so the ranks' exits could not reach
# the launcher. Every rank was ended; the newest checkpoint is the last one saved before.
EXIT_LAUNCHER_FAILED = 9
# Stopped by a signal (preemption): 128 + the signal number, as shells report it. The
# ranks finished their step, drained and saved a checkpoint (checkpoint.on_preempt).
EXIT_PREEMPTED = 128 + signal.SIGTERM  # 143: SIGTERM (SLURM, Kubernetes, `kill`)
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130: SIGINT (Ctrl-C)
# 129: SIGHUP (the job's terminal or its controlling process is gone), or a rank under torchrun whose own
# torchrun (its parent) is gone, which asks every rank to stop as SIGHUP does; they save
# and exit 129.
EXIT_HANGUP = EXIT_LAUNCHER_GONE = 128 + signal.SIGHUP


def exit_code_for_signal(signum: int) -> int:
    """128 + the signal number: 143 for SIGTERM, 130 for SIGINT, 129 for SIGHUP."""
    return 128 + int(signum)


__all__ = [
    "EXIT_BAD_CONFIG",
    "EXIT_BAD_DATA",
    "EXIT_CHECKPOINT",
    "EXIT_DIR_IN_USE",
    "EXIT_DOES_NOT_FIT",
    "EXIT_HANGUP",
    "EXIT_INTERRUPTED",
    "EXIT_LAUNCHER_FAILED",
    "EXIT_LAUNCHER_GONE",
    "EXIT_NONFINITE_LOSS",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "EXIT_STALLED",
    "EXIT_WORKER_FAILED",
    "exit_code_for_signal",
]
