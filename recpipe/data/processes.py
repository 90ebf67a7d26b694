"""Batches made by forked producer processes, handed over through shared memory.

See ``recpipe.data.stream`` for why processes and how the batches are ordered.
Between the training process and producer ``w`` (of ``k``):

* a duplex pipe (a Unix socket pair). Producer -> training process: one small
  pickled message per batch: its index, the slot it is in, each tensor's dtype,
  shape and byte offset, and the spec that rebuilds the :class:`Batch` around them
  (``recpipe.data.flat``); or the producer's exception, at that batch's turn.
  Training process -> producer: one empty message per batch copied out of its slot.
* ``SLOTS + 1`` shared-memory segments (``memfd``: no name, no ``/dev/shm`` space,
  gone with the last process that maps it), the producer's ring of slots, used in
  turn and freed in the same order: up to ``SLOTS`` batches handed over and the one
  it is making. Where the stream offers ``make_into`` (binary, criteo_npy), the
  batch is made in its free slot, its tensors views of the segment (no copy, no
  allocation); other batches are copied in. A slot's segment is created by the
  producer the first time it is used, sized from that batch with headroom, and
  created anew, larger, for a batch that does not fit (never a dropped or truncated
  batch). The new segment's file descriptor goes to the training process behind the
  message (``SCM_RIGHTS``), which maps it and keeps it: segments are made per slot,
  not per batch, and no tensor data is pickled.
* a sentinel pipe whose write end only the producer holds: readable once the
  producer is gone, however it ended (a killed producer is an error naming it,
  not a hang).

In the training process one receiver thread takes the batches in index order: it
waits for the producer whose turn it is, copies the slot's bytes in one ``memcpy``
(numpy, without the GIL) into one buffer, pinned on CUDA (from torch's caching
host allocator, which tracks the asynchronous host-to-device copies made from it,
so a buffer is reused only when they are done), frees the slot at once, and
queues the :class:`Batch` built from views of that buffer. Its own Python per
batch is an unpickle and a few views (tens of microseconds).

Producers are forked, not spawned (no second import of torch, torchrec and fbgemm:
the first batch comes within milliseconds of the fork, and fbgemm's import logs
nothing) and never touch CUDA (their batches are never pinned; a CUDA call there
raises torch's "Cannot re-initialize CUDA in forked subprocess", which reaches the
consumer like any producer error). A producer ignores SIGINT, SIGTERM and SIGHUP
(sent to the whole process group by Ctrl-C, SLURM, Kubernetes, a closed terminal:
the trainer reads batches until its ranks agree to stop at a step boundary), dies
with its parent (``PR_SET_PDEATHSIG``), and is ended with SIGKILL and reaped when the
iterator is closed, dropped, or at interpreter exit.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import pickle
import queue
import signal
import threading
import traceback
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any, NoReturn

import numpy as np
import torch

from recpipe.data.batch import Batch
from recpipe.data.flat import flatten_batch, unflatten_batch
from recpipe.data.handoff import Failed, Production, put_unless_closed
from recpipe.system import die_with_parent
from recpipe.stop_requests import ignore_stop_signals, stop_signals_blocked

__all__ = ["ProducerDied", "Processes"]

SLOTS = 2  # per producer: batches made ahead of the one it is making (which has a slot too)
READY = 2  # batches copied out and waiting for the consumer
_ALIGN = 64  # byte offset of each tensor in a slot
_HEADROOM = 1.25  # a slot's size over the batch it is made for (later batches may be larger)
_POLL_S = 0.1  # how often a waiting receiver checks whether the iterator was closed
_BATCH, _OBJECT, _ERROR = range(3)  # message kinds


class ProducerDied(RuntimeError):
    """A producer process ended without handing over the batch whose turn it was."""


class _Segment:
    """One slot's shared memory, mapped in this process."""

    def __init__(self, fd: int, size: int, writable: bool) -> None:
        self.size = size
        self.map = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        # Producer: a torch view to write any dtype into; receiver: numpy, whose copy releases the GIL.
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8) if writable else np.frombuffer(self.map, np.uint8)


def _layout(tensors: list[torch.Tensor], segment: _Segment | None = None) -> tuple[list[tuple], int]:
    """(dtype, shape, byte offset, bytes, already there) of each tensor in a slot, and the
    bytes used. A tensor made in ``segment`` (``_Carver``) keeps its place; the others
    follow, aligned."""
    base = segment.bytes.data_ptr() if segment is not None else None
    places, end = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        there = base is not None and t.untyped_storage().data_ptr() == base and t.is_contiguous()
        places.append(t.data_ptr() - base if there else None)
        if there:
            end = max(end, places[-1] + nbytes)
    layout = []
    for t, offset in zip(tensors, places):
        nbytes = t.numel() * t.element_size()
        there = offset is not None
        if not there:
            offset = -(-end // _ALIGN) * _ALIGN
            end = offset + nbytes
        layout.append((t.dtype, tuple(t.shape), offset, nbytes, there))
    return layout, end


class _Carver:
    """``empty(shape, dtype)`` for ``make_into``: tensors carved in turn out of the free
    slot's segment, so that the batch is made where it is handed over; ``torch.empty``
    where the segment is full or not made yet (those tensors are copied in, as any
    batch's are, into a larger segment if need be)."""

    def __init__(self, segment: _Segment | None) -> None:
        self.segment, self.end = segment, 0

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        offset = -(-self.end // _ALIGN) * _ALIGN
        if self.segment is None or offset + nbytes > self.segment.size:
            return torch.empty(shape, dtype=dtype)
        self.end = offset + nbytes
        return self.segment.bytes[offset : offset + nbytes].view(dtype).view(shape)


# ------------------------------------------------------------------ producer side
class _Producer:
    """Producer ``w`` of ``k``, in its own process: makes its batches and writes them
    into its slots, in turn: ``SLOTS`` handed over and not yet copied out, and the one
    it is making (in place where the stream offers ``make_into``)."""

    def __init__(self, conn: Connection, w: int, k: int) -> None:
        self.conn, self.w, self.k = conn, w, k
        self.segments: list[_Segment | None] = [None] * (SLOTS + 1)
        self.sent = self.freed = 0

    def run(self, stream: Production) -> None:
        for index in range(stream.start + self.w, stream.stop, self.k):
            try:
                # At most SLOTS batches are out: this slot is free.
                slot = self.sent % len(self.segments)
                into = getattr(stream, "make_into", None)
                item = stream.make(index) if into is None else into(index, _Carver(self.segments[slot]))
                if self.sent - self.freed == SLOTS:  # SLOTS batches out: wait for the oldest
                    self.conn.recv_bytes()
                    self.freed += 1
                self._send(index, item)
            except BaseException as err:  # raised by the consumer at this batch's turn
                self._send_error(index, err)
                return
        while self.freed < self.sent:  # exit only once every batch is copied out
            self.conn.recv_bytes()
            self.freed += 1

    def _send(self, index: int, item: Any) -> None:
        slot = self.sent % len(self.segments)
        self.sent += 1
        if type(item) is not Batch:  # another object (tests, other makers): pickled whole
            self.conn.send_bytes(pickle.dumps((_OBJECT, index, item), pickle.HIGHEST_PROTOCOL))
            return
        tensors, spec = flatten_batch(item)
        segment, fd = self.segments[slot], None
        layout, size = _layout(tensors, segment)
        if segment is None or segment.size < size:
            layout, size = _layout(tensors)  # all copied into the new segment
            fd = os.memfd_create(f"recpipe-batches-{self.w}.{slot}")
            grown = -(-int(size * _HEADROOM) // mmap.PAGESIZE) * mmap.PAGESIZE + mmap.PAGESIZE
            os.ftruncate(fd, grown)
            segment = self.segments[slot] = _Segment(fd, grown, writable=True)
        for t, (dtype, _, offset, nbytes, there) in zip(tensors, layout):
            if not there:
                segment.bytes[offset : offset + nbytes].view(dtype).copy_(t.reshape(-1))
        layout = [entry[:4] for entry in layout]
        message = (_BATCH, index, slot, size, layout, spec, 0 if fd is None else segment.size)
        self.conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
        if fd is not None:  # behind its message: the receiver maps it before reading the slot
            send_handle(self.conn, fd, os.getppid())
            os.close(fd)

    def _send_error(self, index: int, err: BaseException) -> None:
        where = (f"raised in recpipe batch producer process {self.w} of {self.k} (pid {os.getpid()}) "
                 f"making batch {index}; its traceback:\n{traceback.format_exc()}")
        try:
            err.add_note(where)
            payload = pickle.dumps(err, pickle.HIGHEST_PROTOCOL)
        except Exception:  # an exception that cannot be pickled: its text, as a RuntimeError
            payload = None
        text = f"{type(err).__module__}.{type(err).__qualname__}: {err}\n{where}"
        self.conn.send_bytes(pickle.dumps((_ERROR, index, payload, text), pickle.HIGHEST_PROTOCOL))


def _producer_main(stream: Production, w: int, k: int, conn: Connection, parent_pid: int,
                   parents_ends: tuple[Connection, int]) -> NoReturn:
    """The forked child's whole life: it never returns into the parent's code. It
    starts with the stop signals blocked (see ``_Child``) and ignores them: the training
    process decides."""
    code = 0
    try:
        die_with_parent(parent_pid)
        ignore_stop_signals()
        parents_ends[0].close()
        os.close(parents_ends[1])
        # One intra-op thread: k producers beside the training process must not each run a full team.
        torch.set_num_threads(1)
        _keep_freed_memory()
        _Producer(conn, w, k).run(stream)
    except BaseException:  # the pipe is gone: the iterator was closed; nothing to report
        code = 1
    finally:
        os._exit(code)  # no atexit handlers, no flush of buffers copied from the parent


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_HEAP_KEPT = 256 << 20  # freed heap memory a producer keeps for its next batches
_HEAP_BLOCK = 64 << 20  # allocations up to this size come from the heap, not their own mmap


def _keep_freed_memory() -> None:
    """Make glibc keep a producer's freed memory for its next batch. A batch's arrays
    (megabytes each) are allocated and freed once per batch; with glibc's defaults
    (allocations of 128 KiB and more are mmapped, and a freed heap top of more than
    twice that is trimmed back) most batches got fresh pages, and a page fault for each
    one, costing more CPU than making the batch (benchmarks/results/cpu/data_loader.md);
    a handful of faults once the memory is kept. A producer's peak stays what one batch
    needs; this process only (not the training process), and only where the C library
    is glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _HEAP_BLOCK)
        libc.mallopt(_M_TRIM_THRESHOLD, _HEAP_KEPT)
    except (OSError, AttributeError):  # no glibc: its defaults stay
        pass


# ------------------------------------------------------------------ training process side
class _Child:
    """The training process's handle on one producer process."""

    def __init__(self, stream: Production, w: int, k: int) -> None:
        self.w, self.k = w, k
        conn, child_conn = Pipe(duplex=True)
        sentinel, child_sentinel = os.pipe()
        parent_pid = os.getpid()
        # Blocked across the fork, so that a Ctrl-C cannot raise KeyboardInterrupt in
        # the child before it is inside _producer_main (it would run the parent's code).
        with stop_signals_blocked():
            pid = os.fork()
            if pid == 0:
                _producer_main(stream, w, k, child_conn, parent_pid, (conn, sentinel))
        # Closed here before the next fork, so that only this producer holds them.
        os.close(child_sentinel)
        child_conn.close()
        self.pid, self.conn, self.sentinel = pid, conn, sentinel
        self.segments: list[_Segment | None] = [None] * (SLOTS + 1)
        self._lock = threading.Lock()
        self._exit_code: int | None = None

    def receive(self, index: int, closed: threading.Event) -> tuple | None:
        """The producer's next message; None once ``closed`` is set."""
        while not closed.is_set():
            ready = wait([self.conn, self.sentinel], _POLL_S)
            if not ready:
                continue
            if self.conn in ready or self.conn.poll():  # what it sent before it ended still counts
                try:
                    return pickle.loads(self.conn.recv_bytes())
                except (EOFError, ConnectionResetError):  # reset: it died with our messages unread
                    pass
            if closed.is_set():
                return None
            raise ProducerDied(self._death(index))
        return None

    def take(self, message: tuple, pin: bool) -> Any:
        """The item of ``message`` (a ``Failed`` for an error), its slot freed."""
        kind = message[0]
        if kind == _ERROR:
            return Failed(_exception(message))
        if kind == _OBJECT:
            self._free()
            return message[2]
        _, _, slot, size, layout, spec, grown = message
        if grown:
            try:
                fd = recv_handle(self.conn)
            except (OSError, EOFError, RuntimeError) as err:  # it died between the message and the segment
                raise ProducerDied(self._death(message[1])) from err
            self.segments[slot] = _Segment(fd, grown, writable=False)
            os.close(fd)
        buffer = self._buffer(size, pin)
        np.copyto(buffer.numpy(), self.segments[slot].bytes[:size])
        self._free()
        return unflatten_batch(spec, [buffer[o : o + n].view(dtype).view(shape) for dtype, shape, o, n in layout])

    @staticmethod
    def _buffer(size: int, pin: bool) -> torch.Tensor:
        """A batch's own memory: a new tensor per batch, never one a batch still in flight
        holds. Pinned ones come from torch's caching host allocator, which gives a block back
        only once the asynchronous copies made from it are done."""
        return torch.empty(size, dtype=torch.uint8, pin_memory=pin)

    def _free(self) -> None:
        try:
            self.conn.send_bytes(b"")
        except OSError:  # the producer is gone: the next receive says so, if it matters
            pass

    def _death(self, index: int) -> str:
        code = self.reap()
        if code < 0:
            how = f"was killed by signal {-code} ({signal.Signals(-code).name})"
            if -code == signal.SIGKILL:
                how += ", which is also what the kernel's out-of-memory killer sends (see `dmesg`)"
        else:
            how = f"exited with code {code}"
        return f"recpipe batch producer process {self.w} of {self.k} (pid {self.pid}) {how} before handing over batch {index}"

    def kill(self) -> None:
        with self._lock:
            if self._exit_code is None:  # not reaped: the pid is still this child's
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def reap(self) -> int:
        """Wait for the process to end (once) and return its exit code (-signal if killed)."""
        with self._lock:
            if self._exit_code is None:
                _, status = os.waitpid(self.pid, 0)
                self._exit_code = os.waitstatus_to_exitcode(status)
            return self._exit_code

    @property
    def reaped(self) -> bool:
        return self._exit_code is not None

    def close_pipes(self) -> None:
        self.conn.close()
        os.close(self.sentinel)
        self.segments = [None] * (SLOTS + 1)


def _exception(message: tuple) -> BaseException:
    _, _, payload, text = message
    try:
        err = pickle.loads(payload) if payload is not None else None
    except Exception:  # e.g. an exception class whose constructor takes other arguments
        err = None
    return err if isinstance(err, BaseException) else RuntimeError(text)


class Processes:
    """The producer processes and the receiver thread of one iterator over ``stream``."""

    def __init__(self, stream: Production) -> None:
        k = stream.workers
        self.closed = threading.Event()
        self.ready: queue.Queue = queue.Queue(READY)
        self.children: list[_Child] = []
        try:
            for w in range(min(k, len(stream))):  # a producer without batches is not started
                self.children.append(_Child(stream, w, k))
        except BaseException:  # a fork failed: end the ones that started
            self.stop(join=False)
            for child in self.children:
                child.close_pipes()
            raise
        self.thread = threading.Thread(target=self._receive, args=(stream.start, stream.stop, k, stream.pin_device),
                                       name="recpipe-batch-receiver", daemon=True)
        self.thread.start()

    def take(self, index: int) -> Any:
        return self.ready.get()

    def _receive(self, start: int, stop: int, k: int, pin_device: torch.device | None) -> None:
        try:
            if pin_device is not None:  # pinned allocations belong to this device's context
                torch.cuda.set_device(pin_device)
            for index in range(start, stop):
                child = self.children[(index - start) % k]
                message = child.receive(index, self.closed)
                if message is None:
                    return
                item = child.take(message, pin_device is not None)
                if not put_unless_closed(self.closed, self.ready, item) or isinstance(item, Failed):
                    return
        except BaseException as err:  # handed to the consumer, raised there
            put_unless_closed(self.closed, self.ready, Failed(err))
        finally:
            for child in self.children:
                child.close_pipes()

    def stop(self, join: bool) -> None:
        """End the producers (SIGKILL: they hold nothing that needs a clean exit) and
        reap them; with ``join``, wait for the receiver thread too."""
        self.closed.set()
        for child in self.children:
            child.kill()
        for child in self.children:
            child.reap()
        thread = getattr(self, "thread", None)
        if join and thread is not None and thread is not threading.current_thread():
            thread.join()

    def running(self) -> bool:
        return self.thread.is_alive() or not all(c.reaped for c in self.children)
