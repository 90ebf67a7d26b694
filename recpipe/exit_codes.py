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
EXIT_NONFINITE_LOSS = 4  # the loss became NaN/inf (train.on_nonfinite=error); nothing was saved after it
# The data is malformed or does not match the config: a malformed TSV line (file:line) in
# `recpipe data convert` or in training, a binary dataset that is incomplete, truncated,
# corrupt or of another layout (`recpipe data verify`, `recpipe train` before any process starts).
EXIT_BAD_DATA = 5
EXIT_CHECKPOINT = 6  # a checkpoint cannot be written, or none in checkpoint.dir is intact
EXIT_DIR_IN_USE = 7  # checkpoint.dir or logging.run_dir is locked by another run (or cannot be locked)
# Stopped by a signal (preemption): 128 + the signal number, as shells report it. The
# ranks finished their step, drained and saved a checkpoint (checkpoint.on_preempt).
EXIT_PREEMPTED = 128 + signal.SIGTERM  # 143: SIGTERM (SLURM, Kubernetes, `kill`)
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130: SIGINT (Ctrl-C)


def exit_code_for_signal(signum: int) -> int:
    """128 + the signal number: 143 for SIGTERM, 130 for SIGINT."""
    return 128 + int(signum)


__all__ = [
    "EXIT_BAD_CONFIG",
    "EXIT_BAD_DATA",
    "EXIT_CHECKPOINT",
    "EXIT_DIR_IN_USE",
    "EXIT_DOES_NOT_FIT",
    "EXIT_INTERRUPTED",
    "EXIT_NONFINITE_LOSS",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "EXIT_WORKER_FAILED",
    "exit_code_for_signal",
]
