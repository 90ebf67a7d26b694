"""A rank that stops making progress ends the job: no training step within ``train.step_timeout_s``.

In synchronous training every rank waits for the others in each collective. A rank that
stops (SIGSTOP, a frozen host, a deadlock, a data reader that never returns, a collective
the other ranks never join) leaves the rest waiting inside a collective: Gloo and NCCL give
up only after the process group's timeout (``recpipe.distributed.COLLECTIVE_TIMEOUT``, 10
minutes), and a stopped process never ends at all, nor does a SIGTERM reach a step
boundary. TorchRec's users meet the same hang on uneven batches
(https://github.com/pytorch/torchrec/issues/4158).

Each rank runs a :class:`StepWatchdog`, a daemon thread that does not depend on the main
thread (which is the one waiting):

* The trainer arms it for each training segment and tells it every step boundary
  (``stepped``: two attribute writes, no host sync). The first step of the run (compiles,
  graph captures) is not timed, nor is the time torch.compile compiles (a later step's
  recompile, a captured step's compile: seconds to minutes on a busy host), nor are
  evaluation and checkpoint saves, whose length depends on the data and the model; while the trainer is in one of them (``during``),
  a rank that stops responding ends the job instead: every timeout, the ranks whose
  heartbeat has stopped (below) are looked for, and one found ends it as a stalled step
  does. A slow save or evaluation on ranks that all respond goes on.
* Every ``POLL_S`` it publishes a heartbeat (a counter, its last step, whether it is
  compiling) to the job's rendezvous store (the launcher's, or torchrun's agent store), and checks whether this
  rank's last step is older than the timeout: ``train.step_timeout_s``, or by default
  ``AUTO_FACTOR`` times the median step so far and at least ``AUTO_MIN_S``.
* On a timeout it reads every rank's heartbeat, and again ``SILENT_POLLS`` polls later: a
  rank whose counter did not move is not responding (stopped, or frozen holding the
  interpreter); one that is compiling keeps the others waiting for it, slow, not stalled. The first rank to time out says it in one line (which rank, its last step, the newest
  checkpoint), rank 0 (when it can) writes ``summary.json`` with ``"status": "stalled"``,
  and every rank that still runs ends its own process with ``EXIT_STALLED``; a rank that
  sees another's timeout in the store ends at once. The launcher (``launch_local`` or
  torchrun) then ends a rank that cannot end itself, and ``recpipe train``'s launcher
  records the stall in ``summary.json`` when rank 0 is the one that stopped.
* A rank whose watchdog is closed (its training is over) says so in its heartbeat: it is
  not waited for, and never taken for a rank that stopped.

The newest checkpoint stays the last good one: nothing is saved after a stall.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import threading
import time
from collections import deque
from typing import Callable, Iterator

from recpipe.compat import torch as compat_torch
from recpipe.distributed import job_key, job_store
from recpipe.errors import UserError, report
from recpipe.exit_codes import EXIT_STALLED

__all__ = ["AUTO_FACTOR", "AUTO_MIN_S", "StalledError", "StepWatchdog", "auto_timeout_s"]

AUTO_FACTOR = 100
AUTO_MIN_S = 60.0


_CLOSED = "closed"  # the heartbeat of a rank whose watchdog is closed


class StalledError(UserError):
    exit_code = EXIT_STALLED


def auto_timeout_s(step_seconds: list[float]) -> float:
    """The default timeout: ``AUTO_FACTOR`` times the median step, at least ``AUTO_MIN_S``."""
    median = statistics.median(step_seconds) if step_seconds else 0.0
    return max(AUTO_MIN_S, AUTO_FACTOR * median)


class StepWatchdog:
    """See the module docstring. ``timeout_s``: ``train.step_timeout_s`` (None: auto, 0:
    off). ``describe_newest``: the newest checkpoint, for the message; ``on_stall``: what
    this rank writes before it ends (rank 0's summary.json), called from the thread."""

    POLL_S = 1.0
    SILENT_POLLS = 3  # a rank whose heartbeat did not move over this many polls is not responding

    def __init__(self, timeout_s: float | None, rank: int, world_size: int, describe_newest: Callable[[], str],
                 on_stall: Callable[[str], None]) -> None:
        self.timeout_s, self.rank, self.world_size = timeout_s, rank, world_size
        self.describe_newest, self.on_stall = describe_newest, on_stall
        self.poll_s = min(self.POLL_S, timeout_s / 5) if timeout_s else self.POLL_S
        self.step = 0  # the last step boundary
        self._last_at: float | None = None  # when, while armed and past the run's first step; else None
        self._armed = False
        self._steps_seen = 0
        self._durations: deque[float] = deque(maxlen=200)
        self._count = 0  # heartbeats published
        # What the trainer is doing outside its training steps (``during``) and since when;
        # the thread's: the phase it last found every rank responding in, and when.
        self._phase: tuple[str, float] | None = None
        self._responding: tuple[tuple[str, float] | None, float] = (None, 0.0)
        self._done = threading.Event()
        self._store = job_store() if timeout_s != 0 else None
        self._compiling = False  # torch.compile is compiling in this process (its callbacks, any thread)
        self._stop_hearing = lambda: None
        self._thread = threading.Thread(target=self._watch, name="recpipe-step-watchdog", daemon=True)
        if timeout_s != 0:
            self._stop_hearing = compat_torch.on_compiles(self._compile_started, self._compile_ended)
            self._thread.start()

    # ------------------------------------------------------------------ main thread
    def arm(self) -> None:
        """A training segment starts: time its steps (from now, once the run's first step is done)."""
        self._armed = True
        self._last_at = time.monotonic() if self._steps_seen else None

    def disarm(self) -> None:
        """Evaluation, a checkpoint save, the end: not timed."""
        self._armed = False
        self._last_at = None

    def stepped(self, step: int) -> None:
        """A step boundary (every rank, every step)."""
        now = time.monotonic()
        if self._last_at is not None:
            self._durations.append(now - self._last_at)
        self.step = step
        self._steps_seen += 1
        self._last_at = now if self._armed else None

    @contextlib.contextmanager
    def during(self, what: str) -> Iterator[None]:
        """The block is ``what`` (``"the checkpoint save of step 8"``): not timed, but a rank
        that stops responding meanwhile ends the job (see the module docstring)."""
        self._phase = (what, time.monotonic())
        try:
            yield
        finally:
            self._phase = None

    def _compile_started(self) -> None:
        self._compiling = True

    def _compile_ended(self) -> None:
        """A step that compiled is timed from the compile's end."""
        self._compiling = False
        if self._last_at is not None:
            self._last_at = time.monotonic()

    def close(self) -> None:
        self._stop_hearing()
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._store is not None:  # the other ranks wait for this one no more
            try:
                self._store.set(self._key(f"beat/{self.rank}"), _CLOSED)
            except Exception:  # noqa: BLE001: the store is gone (the job is ending)
                pass

    # ------------------------------------------------------------------ the thread
    def current_timeout_s(self) -> float:
        return self.timeout_s if self.timeout_s else auto_timeout_s(list(self._durations))

    def _key(self, what: str) -> str:
        return job_key(f"watchdog/{what}")

    def _beat(self) -> None:
        self._count += 1
        if self._store is not None:
            self._store.set(self._key(f"beat/{self.rank}"), f"{self._count},{self.step},{int(self._compiling)}")

    def _watch(self) -> None:
        try:
            self._beat()
            while not self._done.wait(self.poll_s):
                self._beat()
                if self._store is not None and self._store.check([self._key("stalled")]):
                    self._end("")  # another rank timed out and said why: this one waits in vain too
                last = self._last_at
                if last is not None and not self._compiling and time.monotonic() - last > self.current_timeout_s():
                    message = self._diagnosis()  # before the others learn of it: they keep beating meanwhile
                    if self._last_at != last or self._compiling:
                        continue  # a step or a compile came meanwhile: slow, not stalled
                    if message is None:  # another rank compiles: time this one's step from now
                        self._last_at = time.monotonic()
                        continue
                    self._stalled(message)
                self._check_phase()
        except Exception:  # noqa: BLE001: the store is gone (the job is ending); nothing left to watch
            return

    def _check_phase(self) -> None:
        """In a phase (``during``), every timeout: end the job if a rank stopped responding."""
        phase = self._phase
        if phase is None or self._store is None:
            return
        looked, at = self._responding
        since = at if looked is phase else phase[1]
        if time.monotonic() - since <= self.current_timeout_s():
            return
        message = self._phase_diagnosis(phase[0])
        if self._phase is not phase:
            return  # the phase ended meanwhile
        if message is None:  # every rank responds: slow, not stalled; look again after another timeout
            self._responding = (phase, time.monotonic())
            return
        self._stalled(message)

    def _stalled(self, message: str) -> None:
        """End this process: the first rank that found the stall says ``message``."""
        first = self._store is None or self._store.add(self._key("stalled"), 1) == 1
        self._end(message if first else "")

    def _beats(self) -> dict[int, tuple[int, int, bool] | None]:
        """Every rank's heartbeat (count, last step, compiling; None before its first), but for
        ranks whose watchdog is closed."""
        beats: dict[int, tuple[int, int] | None] = {}
        for rank in range(self.world_size):
            key = self._key(f"beat/{rank}")
            beat = self._store.get(key).decode() if self._store.check([key]) else None
            if beat is None:
                beats[rank] = None
            elif beat != _CLOSED:
                count, step, compiling = beat.split(",")
                beats[rank] = (int(count), int(step), compiling == "1")
        return beats

    def _silent_ranks(self) -> tuple[list[int], dict[int, tuple[int, int, bool]]]:
        """The other ranks whose heartbeat did not move over ``SILENT_POLLS`` polls (this rank
        beating on meanwhile), and the heartbeats of those that have one."""
        before = self._beats()
        for _ in range(self.SILENT_POLLS):
            time.sleep(self.poll_s)
            self._beat()
        after = self._beats()
        silent = [r for r in sorted(after) if r != self.rank and r in before and before[r] == after[r]]
        return silent, {r: beat for r, beat in after.items() if beat is not None}

    def _phase_diagnosis(self, what: str) -> str | None:
        """The message for ranks that stopped responding during ``what``, or None when none did."""
        silent, _ = self._silent_ranks()
        if not silent:
            return None
        named = ", ".join(f"rank {r}" for r in silent)
        return (f"no response for {self.current_timeout_s():.0f} s during {what} ({self._timeout_rule()}): {named} "
                f"stopped responding (stopped or frozen); the other ranks waited for it. Every rank is ended; nothing "
                f"was saved after it ({self.describe_newest()})")

    def _timeout_rule(self) -> str:
        if self.timeout_s:
            return f"train.step_timeout_s={self.timeout_s:g}"
        return f"train.step_timeout_s: {AUTO_FACTOR} x the median step, at least {AUTO_MIN_S:.0f} s"

    def _diagnosis(self) -> str | None:
        """Which rank stopped, from the heartbeats over ``SILENT_POLLS`` polls (this rank
        beating on meanwhile), and the newest checkpoint; None when none stopped and another
        is compiling (this one waits for it in a collective)."""
        what = f"no training step for {self.current_timeout_s():.0f} s ({self._timeout_rule()})"
        if self._store is None:
            found = f"rank {self.rank}: {what}; its last step: {self.step}"
        else:
            silent, after = self._silent_ranks()
            # The job advances in lockstep: the ranks that respond finished the step the silent
            # one took last (its own heartbeat is up to a poll older than its last step).
            reached = max([self.step] + [after[r][1] for r in after if r not in silent])
            if not silent and any(after[r][2] for r in after if r != self.rank):
                return None
            if silent:
                named = ", ".join(f"rank {r}" for r in silent)
                found = (f"{what}: {named} stopped responding after step {reached} (stopped or frozen); the other "
                         "ranks waited for it")
            else:
                steps = ", ".join(f"rank {r}: {after[r][1]}" for r in sorted(after))
                found = (f"{what} on any rank after step {reached} (last steps: {steps}): a rank is stuck in a "
                         "collective, its data or a deadlock")
        return f"{found}. Every rank is ended; nothing was saved after it ({self.describe_newest()})"

    def _end(self, message: str) -> None:
        """Say ``message`` (the first rank to time out has one), let rank 0 write its
        summary, end this process."""
        try:
            self.on_stall(message)
        finally:
            if message:
                report("train", StalledError(message), rank=None)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_STALLED)
