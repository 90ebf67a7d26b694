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


class _Threads:
    def __init__(self, stream: BatchStream) -> None:
        self.start, self.next_index, self.stop = stream.start, stream.start, stream.stop
        self.closed = threading.Event()
        k = stream.workers
        self.queues: list[queue.Queue] = [queue.Queue(_PREFETCH_PER_THREAD) for _ in range(k)]
        self.threads = [
            threading.Thread(target=self._produce, args=(stream, w, k), name=f"recpipe-batches-{w}", daemon=True)
            for w in range(k)
        ]
        for t in self.threads:
            t.start()

    def _produce(self, stream: BatchStream, w: int, k: int) -> None:
        # One intra-op thread: k producers beside the training loop must not each
        # start a full OpenMP team (the setting is per thread in torch's OpenMP build).
        torch.set_num_threads(1)
        if stream.pin_device is not None:
            torch.cuda.set_device(stream.pin_device)
        out = self.queues[w]
        for index in range(stream.start + w, stream.stop, k):
            if self.closed.is_set():
                return
            try:
                item = stream.make(index)
            except BaseException as err:  # handed to the consumer, raised there
                item = _Failed(err)
            if not self._put(out, item) or isinstance(item, _Failed):
                return

    def _put(self, out: queue.Queue, item: Any) -> bool:
        while not self.closed.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> "_Threads":
        return self

    def __next__(self) -> Any:
        if self.next_index >= self.stop or self.closed.is_set():
            self.close()
            raise StopIteration
        item = self.queues[(self.next_index - self.start) % len(self.queues)].get()
        if isinstance(item, _Failed):
            self.close()
            raise item.error
        self.next_index += 1
        return item

    def close(self) -> None:
        """Stop the producers (they exit at their next batch or full queue)."""
        self.closed.set()

    def __del__(self) -> None:
        self.closed.set()
