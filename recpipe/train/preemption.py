"""Stopping on SIGTERM / SIGINT / SIGHUP at a step boundary, with every rank agreeing.

What SLURM and Kubernetes send on preemption is SIGTERM, to the launcher, to every
rank, or to some of them (a closed terminal sends SIGHUP, which asks the same). Each rank:

1. ``recpipe.stop_requests`` handles the signals. Until training starts a signal
   ends the run at once (nothing is trained yet). From the moment ``Preemption`` is
   built, the first SIGTERM, SIGINT or SIGHUP is only a request: training goes on for now.
   Another within ``REPEAT_WINDOW_S`` is the same request delivered twice; a later
   one ends the process at once: exit 128 + signal, nothing saved.
2. ``Preemption.after_step()`` runs on every rank at every step boundary. At an
   exchange boundary it collects the all-reduce (MAX of the ranks' requests)
   launched at the previous exchange, which has finished by then, so the host does
   not wait for it, and launches the next one, on a Gloo group, asynchronously.
   Every rank reads the same result at the same boundary, so all stop together,
   also when only one rank got the signal. Exchanges are spaced to about
   ``EXCHANGE_EVERY_S`` of training: rank 0 measures the step time and proposes
   the number of steps to the exchange after next inside the same all-reduce, so
   every rank learns the same spacing: an exchange costs host time, which once per
   step would be a visible share of a small CPU step. So a signal stops training
   within about two spacings (two steps when a step takes longer), plus the drain.
3. ``gate()`` wraps the training batches: once stopping is agreed it hands out no
   more, so the pipeline's end-of-data agreement finds no rank with data and the
   pipeline drains, training the batches already in flight. The trainer then saves
   a checkpoint (``checkpoint.on_preempt``) and raises ``Preempted``.

Evaluations (``end_evaluation()``): the same exchange runs after every eval batch,
carrying also how long ago each rank's request came. A request agreed during an
evaluation lets it go on for ``train.stop_grace_s``; then every rank ends it at the
same batch, and the trainer saves the last trained step and raises ``Preempted``. An
evaluation of thousands of batches would otherwise outlast a scheduler's grace period
(30 s is common) before the checkpoint.

A signal that arrives after the last step boundary lets the run complete (exit 0)
when the final evaluation ends within ``train.stop_grace_s``, and during the final
save; a final evaluation that it ends stops the run as above. A run never stops on a
request from before it started: ``recpipe.stop_requests.install_signal_handlers()``
clears what an earlier run in the same process saw (one process may run
``recpipe.cli.main`` several times).

A rank started by torchrun (TORCHELASTIC_RUN_ID set) also watches its launcher
(``watch_launcher()``): torchrun is its parent, and when it is gone (killed with
SIGKILL, its node lost) the rank asks every rank to stop exactly as for a signal,
with ``LAUNCHER_GONE``, which ends the run as SIGHUP does (what a shell sends a job
whose terminal is gone): they drain, save and exit 129, and the other nodes' torchrun
ends the job at once. Without the watch such a rank trained on with nobody to report to, and the other torchrun
waited out its exit barrier and exited 0. Stopping together, rather than the kernel
killing the rank as ``recpipe train``'s own launcher has it do
(``recpipe.system.die_with_parent``), keeps the other ranks out of a collective
with a dead peer (NCCL would wait for its timeout) and saves a checkpoint.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Iterable, Iterator, TypeVar

import torch
import torch.distributed as dist

from recpipe.stop_requests import LAUNCHER_GONE, defer_requests, request, request_age_s, requested_signal

__all__ = ["Preemption", "watch_launcher"]

T = TypeVar("T")


class watch_launcher:
    """For the run's duration (a context manager), check every ``POLL_S`` whether this
    process's parent, its launcher, is still the one it started with; once it is not,
    ask every rank to stop (``LAUNCHER_GONE``; see the module docstring). A daemon
    thread that only reads ``os.getppid()``."""

    POLL_S = 0.5

    def __init__(self) -> None:
        self._parent = os.getppid()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="recpipe-launcher-watch", daemon=True)

    def __enter__(self) -> "watch_launcher":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._done.wait(self.POLL_S):
            if os.getppid() != self._parent:
                print(f"recpipe: rank {os.environ.get('RANK', '0')}: its launcher (pid {self._parent}) is gone: every "
                      "rank stops after the batches in flight", file=sys.stderr, flush=True)
                request(LAUNCHER_GONE)
                return


class Preemption:
    """The step-boundary agreement of every rank on stopping (see the module docstring).

    ``group``: a Gloo group (``recpipe.groups.control_group()``), or None for a
    single process."""

    EXCHANGE_EVERY_S = 0.1
    MAX_SPACING = 100  # steps

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self._proposes = group is None or dist.get_rank(group) == 0  # rank 0 sets the spacing
        # [signal asking to stop, rank 0's proposed spacing, milliseconds since the request
        # came], each the max over the ranks. Reused: the previous all-reduce is waited for
        # before the next one starts.
        self._flag = torch.zeros(3, dtype=torch.int64)
        self._work: Any = None
        self._boundary = 0  # step boundaries (and eval batches) so far
        self._next_exchange = 1  # the boundary of the next exchange
        self._last = (0, time.perf_counter())  # (boundary, time) of the last exchange
        self.signum: int | None = None  # agreed: every rank stops
        self.evaluation_ended = False  # agreed: the evaluation in progress was ended (end_evaluation)
        defer_requests()  # training starts: a signal is a request for a step boundary from now on

    def after_step(self) -> bool:
        """Collective: call on every rank at every step boundary. True at the one
        boundary where stopping becomes agreed; ``signum`` says it from then on."""
        if self.signum is not None:
            return False
        agreed = self._exchange()
        if agreed is not None and agreed[0] > 0:
            self.signum = agreed[0]
            return True
        return False

    def end_evaluation(self, grace_s: float) -> bool:
        """Collective: call on every rank after every batch of an evaluation (every rank
        evaluates as many, padding included). True once the ranks agree that a stop request
        came at least ``grace_s`` ago: the evaluation ends there, unfinished, and the run
        stops. A request that came during the evaluation is agreed (``signum``) at once; the
        evaluation goes on meanwhile, and one that ends within ``grace_s`` counts."""
        agreed = self._exchange()
        if agreed is None:
            return False
        signum, _, age_ms = agreed
        if signum > 0 and self.signum is None:
            self.signum = signum
        if self.signum is not None and age_ms >= grace_s * 1000:
            self.evaluation_ended = True
        return self.evaluation_ended

    def _exchange(self) -> tuple[int, int, int] | None:
        """At an exchange boundary: the result of the previous exchange (every rank reads the
        same at the same boundary), and the next one launched; else None."""
        self._boundary += 1
        if self.group is None:
            signum, age = requested_signal(), request_age_s()
            return (signum or 0, 1, int((age or 0.0) * 1000))
        if self._boundary < self._next_exchange:
            return None
        agreed = None
        if self._work is not None:
            self._work.wait()  # launched one exchange ago: done by now
            self._work = None
            agreed = tuple(self._flag.tolist())
        spacing = agreed[1] if agreed is not None else 1
        self._next_exchange = self._boundary + max(1, spacing)
        self._flag[0] = requested_signal() or 0
        self._flag[1] = self._propose_spacing() if self._proposes else 0
        self._flag[2] = int((request_age_s() or 0.0) * 1000)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return agreed

    def _propose_spacing(self) -> int:
        """Steps between exchanges so that they come about every EXCHANGE_EVERY_S."""
        boundary, then = self._last
        now = time.perf_counter()
        self._last = (self._boundary, now)
        per_step = (now - then) / max(1, self._boundary - boundary)
        return max(1, min(self.MAX_SPACING, int(self.EXCHANGE_EVERY_S / max(per_step, 1e-6))))

    def close(self) -> None:
        """Collect the last all-reduce (every rank launched it), before the group goes."""
        if self._work is not None:
            self._work.wait()
            self._work = None

    def gate(self, batches: Iterable[T], every: int = 1) -> Iterator[T]:
        """``batches`` until stopping is agreed (checked before each batch is read), in
        whole groups of ``every`` (train.accumulate_steps: an optimizer step's micro-batches,
        so a stop never ends a step early)."""
        it = iter(batches)
        read = 0
        while self.signum is None or read % every:
            try:
                batch = next(it)
            except StopIteration:
                return
            read += 1
            yield batch
