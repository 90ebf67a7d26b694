"""A log interval's training time, where the device ran its steps (:class:`IntervalClock`), and
the host's time in it spent waiting for batches (:class:`LoaderWait`)."""

from __future__ import annotations

import time
from typing import Iterable, Iterator, TypeVar, Union

import torch

__all__ = ["IntervalClock", "LoaderWait", "seconds"]

Mark = Union[torch.cuda.Event, float]
T = TypeVar("T")


class IntervalClock:
    """Training time since the last log point, in stretches: a run of steps between a
    segment's start, its log points and its end (evaluations, checkpoints and the metrics'
    own work at a log point fall between stretches).

    On CUDA a stretch starts and stops with an event on the current (compute) stream, so it
    is the device's time from the work queued before its start to the work queued before
    its stop. The host queues steps ahead of the device (up to ``pipeline.steps_ahead``),
    so the host's clock at a log point runs ahead of the work it times; the events give the
    rate the device achieved, never more. Read them (:func:`seconds`) once the device has
    passed them: the trainer does at the next log point, after waiting for that interval's
    metrics, which were queued after them. On CPU the host's clock, where the work runs."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._start: Mark | None = None
        self._stretches: list[tuple[Mark, Mark]] = []

    def _mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        """Steps start (a segment, or the steps after a log point)."""
        self._start = self._mark()

    def stop(self) -> None:
        """Steps stop (a log point, a segment's end); nothing if none started."""
        if self._start is not None:
            self._stretches.append((self._start, self._mark()))
            self._start = None

    def take(self) -> list[tuple[Mark, Mark]]:
        """The stretches stopped since the last ``take``."""
        stretches, self._stretches = self._stretches, []
        return stretches


def seconds(stretches: list[tuple[Mark, Mark]]) -> float:
    """The stretches' time. On CUDA their events must be done (else torch raises)."""
    return sum(a.elapsed_time(b) / 1e3 if isinstance(a, torch.cuda.Event) else b - a for a, b in stretches)


class LoaderWait:
    """The host's time blocked in the loader's ``next()`` during training, against its time
    training: the share that says whether the loader, not the device or the host's own work,
    sets the pace. Started and stopped with the interval clock; ``take`` gives an interval's
    (waited, trained) seconds."""

    def __init__(self) -> None:
        self.total = 0.0  # every wait of the run
        self._waited = self._trained = 0.0
        self._start: float | None = None

    def timed(self, batches: Iterable[T]) -> Iterator[T]:
        """``batches``, each wait for the next one counted."""
        it = iter(batches)
        while True:
            since = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            waited = time.perf_counter() - since
            self._waited += waited
            self.total += waited
            yield batch

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self) -> None:
        if self._start is not None:
            self._trained += time.perf_counter() - self._start
            self._start = None

    def take(self) -> tuple[float, float]:
        """(seconds waiting for batches, seconds training) since the last ``take``."""
        out = (self._waited, self._trained)
        self._waited = self._trained = 0.0
        return out
