"""Batches made ahead of the training loop, by producer processes (default) or threads.

Why processes (``data.workers_kind: process``, ``recpipe.data.processes``): the training
loop is host-bound Python (torchrec, FBGEMM: the Criteo-sized DLRM at 8192 samples), and
so is making a batch (many small torch ops). Producer threads in the training process
contend with the loop for the GIL: with threads ``recpipe train`` fell well short of the
samples/s of ``recpipe bench``, and with the loader's work out of the loop (batches made
before training and cycled) it nearly matched it (benchmarks/results/cpu/data_loader.md,
"Producer processes vs threads"). A forked producer process makes the batch under its
own GIL and writes it into one of its shared-memory slots (made once, reused); a
receiver thread of the training process copies it out in one memcpy (no GIL) and
rebuilds the batch (a little Python), so the training process does almost no per-batch
work, a fraction of what a producer thread costs it (``recpipe data bench``, the same
report). torch's DataLoader hands batches off less cheaply: a new shared-memory segment
per tensor and an unpickle per batch in the trainer, spawned workers that import torch,
torchrec and fbgemm again (seconds, and a screen of fbgemm warnings each), and one more
copy in the pin thread. The processes here are forked (no import), reuse their slots,
and pickle no tensor data.

Threads (``data.workers_kind: thread``) remain for machines without ``fork`` and
``memfd`` (not Linux; the stream falls back to them with a warning), and for
training with large tables in host memory (``train.device: cpu``): a forked
producer shares the training process's pages copy-on-write, so while it lives
every page the training process writes (embedding rows updated by the optimizer)
is copied once.

Order: with k producers, producer w makes indices ``start + w, start + w + k, ...``
and the consumer takes them in turn, so batches arrive in index order whatever k
is (as with DataLoader workers), bit for bit as ``workers=0`` makes them. An
exception in a producer is raised by the consumer at that batch's turn, with its
type and message.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
from typing import Any, Callable, Iterator, Literal

import torch

from recpipe.data.handoff import Failed, put_unless_closed
from recpipe.data.processes import Processes
from recpipe.errors import job_warning

__all__ = ["BatchStream", "workers_kind"]

_PREFETCH_PER_THREAD = 2
WorkersKind = Literal["process", "thread"]
# Forked producers hand segments over as memfd file descriptors (Linux).
PROCESSES_AVAILABLE = hasattr(os, "fork") and hasattr(os, "memfd_create")


def workers_kind(kind: WorkersKind) -> WorkersKind:
    """``kind``, or "thread" (with a warning) where processes are not available."""
    if kind == "process" and not PROCESSES_AVAILABLE:
        job_warning("data.workers_kind=process needs os.fork and os.memfd_create (Linux); "
                    "batches are made by threads instead", stacklevel=2)
        return "thread"
    return kind


class BatchStream:
    """``make(i)`` for ``i = start .. stop-1``, made by ``workers`` producers of ``kind``
    (0 = on demand in the consumer's thread). ``pin_device``: batches end up in pinned
    memory of this CUDA device's context: threads make them there (``make`` must pin),
    processes' batches are copied into pinned memory (``make`` must not pin).
    ``make_into(i, empty)``, where given, is ``make(i)`` with its tensors allocated by
    ``empty(shape, dtype)``: producer processes build the batch in the shared memory
    they hand it over in (no copy there)."""

    def __init__(
        self,
        make: Callable[[int], Any],
        start: int,
        stop: int,
        workers: int,
        pin_device: torch.device | None = None,
        kind: WorkersKind = "process",
        make_into: Callable[[int, Callable[..., torch.Tensor]], Any] | None = None,
    ) -> None:
        self.make, self.start, self.stop = make, start, stop
        self.workers, self.pin_device, self.kind = workers, pin_device, kind
        self.make_into = make_into

    def __len__(self) -> int:
        return max(self.stop - self.start, 0)

    def __iter__(self) -> Iterator[Any]:
        if self.workers == 0:
            return (self.make(i) for i in range(self.start, self.stop))
        if self.kind == "thread":
            return _Consumer(self, _Threads(self))
        assert self.kind == "process" and PROCESSES_AVAILABLE, (self.kind, "resolve it with workers_kind()")
        return _Consumer(self, Processes(self))


class _Running:
    """Producer sets that may still run, stopped and joined at exit while the
    interpreter is whole: a daemon thread that is inside a torch op when the
    interpreter finalizes is ended by ``pthread_exit``, which aborts the process
    ("terminate called without an active exception"); a producer process would
    live on until its parent is gone."""

    producers: list[Any] = []  # strong references until each has ended

    @classmethod
    def add(cls, producers: Any) -> None:
        cls.producers[:] = [p for p in cls.producers if p.running()] + [producers]


@atexit.register
def _stop_all_producers() -> None:
    for producers in _Running.producers:
        producers.stop(join=True)


class _Threads:
    """The threads and their queues. The threads hold the stop event, their queue and
    the stream, never the consumer's iterator, so dropping the iterator (a trainer
    leaves an epoch early) runs its ``__del__``, which stops them."""

    def __init__(self, stream: BatchStream) -> None:
        k = stream.workers
        self.closed = threading.Event()
        self.queues: list[queue.Queue] = [queue.Queue(_PREFETCH_PER_THREAD) for _ in range(k)]
        self.threads = [
            threading.Thread(target=_produce, args=(self.closed, self.queues[w], stream, w, k),
                             name=f"recpipe-batches-{w}", daemon=True)
            for w in range(k)
        ]
        self.start = stream.start
        for t in self.threads:
            t.start()

    def take(self, index: int) -> Any:
        return self.queues[(index - self.start) % len(self.queues)].get()

    def running(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def stop(self, join: bool) -> None:
        self.closed.set()
        if join:
            for t in self.threads:
                if t is not threading.current_thread():
                    t.join()


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
            item = Failed(err)
        if not put_unless_closed(closed, out, item) or isinstance(item, Failed):
            return


class _Consumer:
    """The consumer's iterator: batches in index order from the producers."""

    def __init__(self, stream: BatchStream, producers: Any) -> None:
        self.next_index, self.stop = stream.start, stream.stop
        self.producers = producers
        _Running.add(producers)

    def __iter__(self) -> "_Consumer":
        return self

    def __next__(self) -> Any:
        if self.next_index >= self.stop or self.producers.closed.is_set():
            self.close()
            raise StopIteration
        item = self.producers.take(self.next_index)
        if isinstance(item, Failed):
            self.close()
            raise item.error
        self.next_index += 1
        return item

    def close(self) -> None:
        """Stop the producers and wait for them (a thread finishes the batch it is
        making; a process is killed)."""
        self.producers.stop(join=True)

    def __del__(self) -> None:
        self.producers.stop(join=False)
