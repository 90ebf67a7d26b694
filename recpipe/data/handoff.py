"""What a batch producer (thread or process) hands the consumer besides batches, how it
puts into a bounded queue that may be closed meanwhile, and what it is given to produce
(``recpipe.data.stream``, ``recpipe.data.processes``)."""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Protocol

__all__ = ["Failed", "Production", "put_unless_closed"]


class Production(Protocol):
    """What producers make: ``make(i)`` for ``i = start .. stop-1``, by ``workers``
    producers, pinned for ``pin_device`` (``recpipe.data.stream.BatchStream``)."""

    make: Callable[[int], Any]
    # make(i) with its tensors allocated by ``empty(shape, dtype)``: a producer process
    # passes views of the shared memory it hands the batch over in (None: not offered)
    make_into: Callable[[int, Callable[..., Any]], Any] | None
    start: int
    stop: int
    workers: int
    pin_device: Any


class Failed:
    """A producer's exception, queued at its batch's turn."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def put_unless_closed(closed: threading.Event, out: queue.Queue, item: Any) -> bool:
    """Put ``item`` into the bounded ``out``; False if ``closed`` is set first."""
    while not closed.is_set():
        try:
            out.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False
