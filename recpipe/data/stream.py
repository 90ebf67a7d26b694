"""Batches made ahead of the training loop by threads of the training process.

Why threads and not DataLoader worker processes (for the synthetic and binary
sources, whose batches are a few vectorised numpy/torch operations that release
the GIL): a worker process hands every batch over by moving each tensor into a
new shared-memory segment and unpickling it in the trainer (1.3-1.8 ms of the
trainer's own CPU time per 8192-sample Criteo batch, measured on the 2-core dev
machine); a spawned worker imports torch, torchrec and fbgemm again before its
first batch (about 15 s on the GPU machine, and fbgemm's import logs a screen of
blank ``WARNING:root:`` lines in every worker); and pinning then copies each batch
once more in the DataLoader's pin thread. A producer thread builds the batch
directly in pinned memory and hands over a reference.

Order: with k threads, thread w makes indices ``start + w, start + w + k, ...`` into
its own bounded queue and the consumer takes from the queues in turn, so batches
arrive in index order whatever k is (as with DataLoader workers). An exception in a
thread is raised by the consumer at that batch's turn.
"""

from __future__ import annotations

import atexit
import queue
import threading
from typing import Any, Callable, Iterator

import torch

__all__ = ["BatchStream"]

_PREFETCH_PER_THREAD = 2


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class BatchStream:
    """``make(i)`` for ``i = start .. stop-1``, made by ``workers`` threads (0 = on demand
    in the consumer's thread). ``pin_device``: make the batches on a thread whose
    current CUDA device is this one (pinned allocations then belong to its context)."""

    def __init__(
        self,
        make: Callable[[int], Any],
        start: int,
        stop: int,
        workers: int,
        pin_device: torch.device | None = None,
    ) -> None:
        self.make, self.start, self.stop = make, start, stop
        self.workers, self.pin_device = workers, pin_device

    def __len__(self) -> int:
        return max(self.stop - self.start, 0)

    def __iter__(self) -> Iterator[Any]:
        if self.workers == 0:
            return (self.make(i) for i in range(self.start, self.stop))
        return _Threads(self)


class _Producers:
    """The threads and their queues. The threads hold the stop event, their queue and
    the stream, never the consumer's iterator, so dropping the iterator (a trainer
    leaves an epoch early) runs its ``__del__``, which stops them. At exit every producer still running is stopped
    and joined while the interpreter is whole: a daemon thread that is inside a
    torch op when the interpreter finalizes is ended by ``pthread_exit``, which
    aborts the process ("terminate called without an active exception")."""

    running: list["_Producers"] = []  # strong references until every thread has ended

    def __init__(self, stream: BatchStream) -> None:
        k = stream.workers
        self.closed = threading.Event()
        self.queues: list[queue.Queue] = [queue.Queue(_PREFETCH_PER_THREAD) for _ in range(k)]
        self.threads = [
            threading.Thread(target=_produce, args=(self.closed, self.queues[w], stream, w, k),
                             name=f"recpipe-batches-{w}", daemon=True)
            for w in range(k)
        ]
        _Producers.running[:] = [p for p in _Producers.running if any(t.is_alive() for t in p.threads)] + [self]
        for t in self.threads:
            t.start()

    def stop(self, join: bool) -> None:
        self.closed.set()
        if join:
            for t in self.threads:
                if t is not threading.current_thread():
                    t.join()


@atexit.register
def _stop_all_producers() -> None:
    for producers in _Producers.running:
        producers.stop(join=True)


def _produce(closed: threading.Event, out: queue.Queue, stream: BatchStream, w: int, k: int) -> None:
    # One intra-op thread: k producers beside the training loop must not each
    # start a full OpenMP team (the setting is per thread in torch's OpenMP build).
    torch.set_num_threads(1)
    if stream.pin_device is not None:
        torch.cuda.set_device(stream.pin_device)
    for index in range(stream.start + w, stream.stop, k):
        if closed.is_set():
            return
        try:
            item = stream.make(index)
        except BaseException as err:  # handed to the consumer, raised there
            item = _Failed(err)
        if not _put(closed, out, item) or isinstance(item, _Failed):
            return


def _put(closed: threading.Event, out: queue.Queue, item: Any) -> bool:
    while not closed.is_set():
        try:
            out.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


class _Threads:
    """The consumer's iterator: batches in index order from the producers' queues."""

    def __init__(self, stream: BatchStream) -> None:
        self.start, self.next_index, self.stop = stream.start, stream.start, stream.stop
        self.producers = _Producers(stream)

    def __iter__(self) -> "_Threads":
        return self

    def __next__(self) -> Any:
        if self.next_index >= self.stop or self.producers.closed.is_set():
            self.close()
            raise StopIteration
        queues = self.producers.queues
        item = queues[(self.next_index - self.start) % len(queues)].get()
        if isinstance(item, _Failed):
            self.close()
            raise item.error
        self.next_index += 1
        return item

    def close(self) -> None:
        """Stop the producers and wait for them (each finishes the batch it is making)."""
        self.producers.stop(join=True)

    def __del__(self) -> None:
        self.producers.stop(join=False)
