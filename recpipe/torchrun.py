"""``recpipe torchrun ARGS``: torchrun (``torch.distributed.run``) in this process, ending
on a signal or a failed rank with one line and an exit code instead of a traceback.

torchrun's agent turns SIGTERM, SIGINT and SIGHUP into a ``SignalException``: it forwards
the signal to its ranks, waits for them (``--shutdown-timeout``), then raises it again
out of ``main``, and Python prints it with two tracebacks. Its ranks (``recpipe train``)
stop at a step boundary, save, and say so themselves. This wrapper catches what torchrun
raises and says it in one line:

* a signal: ``recpipe torchrun: stopped by SIGTERM: forwarded to the ranks, which said
  above what they saved [exit 143]``, exit 128 + signal;
* a failed rank (``ChildFailedError``): torchrun's summary of the failures, without its
  traceback, and the first failed rank's exit code (torchrun itself exits 1), so a job
  script sees the ranks' documented codes (docs/fault_tolerance.md).

A signal delivered twice (a wrapper such as ``timeout`` or a scheduler signals the process
group as well as torchrun) reaches torchrun's agent while it shuts its ranks down; it then
shuts them down again, still waiting for them, and raises one ``SignalException``.
"""

from __future__ import annotations

import signal
import sys

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing import api as elastic
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from recpipe.errors import StopRequested, report
from recpipe.exit_codes import EXIT_WORKER_FAILED

__all__ = ["main_torchrun"]

COMMAND = "torchrun"


def main_torchrun(argv: list[str]) -> int:
    """Run torchrun with ``argv`` (its own flags, then the rank's command) and return the exit code."""
    try:
        torchrun.main(argv)
    except elastic.SignalException as stop:
        return report(COMMAND, StopRequested(stop.sigval, f"stopped by {signal.Signals(stop.sigval).name}: "
                                             "forwarded to the ranks, which said above what they saved"))
    except ChildFailedError as failed:
        _, first = failed.get_first_failure()
        print(failed.format_msg(), file=sys.stderr, flush=True)
        return first.exitcode if isinstance(first.exitcode, int) and first.exitcode > 0 else EXIT_WORKER_FAILED
    return 0

