"""Exit codes of every ``recpipe`` command, in one place (README: "Exit codes").

A module of its own so that components (train, plan, bench, data, checkpoint) can
return them without importing the command-line parser.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_WORKER_FAILED = 1  # a rank failed; its traceback is printed
EXIT_BAD_CONFIG = 2  # the config or the arguments are wrong (checked before any process starts)
EXIT_DOES_NOT_FIT = 3  # the memory plan does not fit
# The data is malformed or does not match the config: a malformed TSV line in
# `recpipe data convert`, a binary dataset that is incomplete, truncated, corrupt
# or of another layout (`recpipe data verify`, `recpipe train` before any process starts).
EXIT_BAD_DATA = 4

__all__ = ["EXIT_BAD_CONFIG", "EXIT_BAD_DATA", "EXIT_DOES_NOT_FIT", "EXIT_OK", "EXIT_WORKER_FAILED"]
