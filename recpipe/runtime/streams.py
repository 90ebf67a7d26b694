"""Every cross-stream hand-off in recpipe lives here; nothing else calls ``wait_stream``.

A pipeline runs work for different batches on different CUDA streams. A tensor made
on stream A and used on stream B needs two things:

1. a GPU-side fence: B waits on an event recorded on A right after the producing
   work (``hand_off``/``fence``), never the host;
2. allocator bookkeeping: the caching allocator frees a block back to the pool of
   the stream that allocated it as soon as Python drops the last reference, while B
   may still read it. ``record_stream(B)`` (inside ``hand_off``) makes the allocator
   wait for B's queued work before reusing the block. The cost: the block stays
   reserved until B reaches that point, which is why pipelines hand off as late as
   possible and keep few batches in flight.

A hand-off from a stream to itself is never needed: work queued on one stream runs
in queue order, and the allocator already knows a block is used on the stream that
made it (or on the stream it was handed to before). ``Streams.hand_over`` and the
engine's fences skip those, so no event or ``record_stream`` is spent on them.

On CPU every stream is ``None`` and every function here is a no-op, so the same
schedules run unchanged under Gloo in CI.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

Stream = Optional[torch.cuda.Stream]
Event = Optional[torch.cuda.Event]


@dataclass(frozen=True)
class Streams:
    """The streams of one pipeline, by role. Created once, in ``Streams.create``."""

    compute: Stream  # the stream current when progress() is called: forward/backward/optimizer
    memcpy: Stream  # host-to-device copies of the next batches
    dist: Stream  # input all-to-all (splits and tensors)
    lookup: Stream  # early embedding lookup + output dist (fused_sparse_dist)
    prefetch: Stream  # UVM cache prefetch (prefetch)
    # One reusable event per source stream for ``hand_over`` (record, then wait at once).
    _scratch: dict = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def create(device: torch.device, roles: frozenset[str]) -> "Streams":
        """Streams for ``roles`` on ``device``; roles not asked for are ``None``.

        Side streams get high priority (-1) like TorchRec's, so the small copies and
        all-to-alls they carry are not starved by long compute kernels. Each side role
        a schedule names is a stream of its own (``lookup``: a lookup off the compute
        and dist streams, with its own allocator pool).
        """
        if device.type != "cuda":
            return Streams(None, None, None, None, None)

        def make(role: str) -> Stream:
            return torch.cuda.Stream(device=device, priority=-1) if role in roles else None

        compute = torch.cuda.current_stream(device)
        dist = make("dist")
        return Streams(compute, make("memcpy"), dist, make("lookup"), make("prefetch"))

    def by_role(self, role: str) -> Stream:
        return getattr(self, role)

    def ambient(self) -> Stream:
        """``compute`` if it is the current stream (then steps on it need no stream
        switch), else None. Checked once per ``progress()``: a caller may run it
        under another stream (or device), and then every step switches as before."""
        compute = self.compute
        if compute is not None and torch.cuda.current_stream() == compute:
            return compute
        return None

    def start_pass(self) -> None:
        """A pass over data starts (no batch in flight): every side stream waits for
        the work queued so far on the current stream.

        Between passes the caller's own work runs there: an evaluation (FBGEMM's
        inline cache prefetch in the forward), a checkpoint load, FBGEMM's ``flush``
        and ``reset_cache_states``, the prefetch pipeline's lock release. Inside a
        pass the schedule's fences order the side streams; but nothing on a side stream
        waits for that work, so without this fence the first prefetch of the pass could
        run on the prefetch stream beside it, on the same cache state: after flush +
        reset_cache_states, cache-line lock counters went negative, those slots were never
        evictable again, and every later step was slower than a fresh pipeline's on the
        same model."""
        if self.compute is None:
            return
        current = torch.cuda.current_stream(self.compute.device)
        others = {id(s): s for s in (self.compute, self.memcpy, self.dist, self.lookup, self.prefetch)
                  if s is not None and s != current}
        if others:
            event = record_event(current)
            for stream in others.values():
                fence(stream, event)

    def join(self) -> None:
        """The current stream waits for the work queued so far on every side stream.

        For a pass left before its end (an evaluation the caller stopped reading, an error):
        work queued for batches that will never be forwarded (a UVM-cache prefetch, whose
        cache-line locks the pipeline then releases on the current stream; an all-to-all)
        has no forward to fence it into the current stream, and what follows there must
        come after it. A pass that ends normally needs none: each batch's forward waited
        for its side-stream work."""
        if self.compute is None:
            return
        current = torch.cuda.current_stream(self.compute.device)
        for stream in {id(s): s for s in (self.compute, self.memcpy, self.dist, self.lookup, self.prefetch)
                       if s is not None and s != current}.values():
            fence(current, record_event(stream))

    def hand_over(self, obj: object, from_stream: Stream, to_stream: Stream) -> None:
        """``hand_off(obj, to_stream, after=<everything queued on from_stream so far>)``.

        Skipped when both are the same stream (stream order already holds, and every
        tensor of ``obj`` is known to that stream's allocator pool: made there or
        handed to it before). Otherwise the event is one kept per source stream and
        re-recorded each time: ``wait_event`` waits for the record that precedes it
        when it is issued, so a later re-record cannot move an earlier fence."""
        if to_stream is None or to_stream is from_stream:
            return
        event: Event = None
        if from_stream is not None:
            event = self._scratch.get(id(from_stream))
            if event is None:
                event = self._scratch[id(from_stream)] = torch.cuda.Event()
            event.record(from_stream)
        hand_off(obj, to_stream, after=event)


_NO_SWITCH = contextlib.nullcontext()  # reusable: enters and exits any number of times


def use_stream(stream: Stream, current: Stream = None) -> contextlib.AbstractContextManager:
    """Issue the enclosed work on ``stream`` (no-op on CPU, or when ``stream`` is
    ``current``: the caller knows it is the current stream already)."""
    return torch.cuda.stream(stream) if stream is not None and stream is not current else _NO_SWITCH


def record_event(stream: Stream) -> Event:
    """Mark everything queued on ``stream`` so far; later ``fence``s wait for exactly that."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def fence(stream: Stream, event: Event) -> None:
    """GPU-side: work queued on ``stream`` from now on starts after ``event``. The host does not wait."""
    if stream is not None and event is not None:
        stream.wait_event(event)


def hand_off(obj: object, to_stream: Stream, after: Event = None) -> None:
    """Hand ``obj`` (a tensor, KJT, Batch, KeyedTensor, module context or a list
    of them) to ``to_stream``: fence on ``after`` and record the stream on every
    tensor so the allocator keeps the memory until ``to_stream`` is done with it."""
    if to_stream is None:
        return
    fence(to_stream, after)
    for item in _multistreamables(obj):
        item.record_stream(to_stream)


def _multistreamables(obj: object) -> Iterator:
    if obj is None:
        return
    if isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _multistreamables(item)
    elif isinstance(obj, dict):  # EmbeddingCollection output: feature -> JaggedTensor
        for item in obj.values():
            yield from _multistreamables(item)
    elif isinstance(obj, torch.Tensor):
        yield obj
    elif hasattr(obj, "record_stream"):
        yield obj
    elif hasattr(obj, "values") and callable(obj.values):  # KeyedTensor has no record_stream
        yield obj.values()


class StepsAhead:
    """How far the host may run ahead of the device: at most ``steps`` steps queued and not
    finished. ``step_queued()`` after each step records an event on ``stream`` (compute: a
    step's last work is there) and first waits, on the host, for the event of the step
    ``steps`` back (host sync, on a step the device has usually long finished).

    Without a bound the host runs as far ahead as it can queue work: a step graph's step
    is one launch and less host time than the device needs (the step_graph rows of
    benchmarks/results/h100x1/criteo_bf16_step_graph.md: host ms/call against P50), so
    the host reached the next point that waits for the device (a log point, up to a log
    interval later) and every batch in between kept its device and pinned host copies
    alive. Bounded, the batches alive are the
    schedule's depth plus ``steps`` - 1 (the planner counts that many), and a clock on
    the host measures the device's pace within ``steps`` steps. A ring of ``steps``
    events, recorded again in turn: waiting on one waits for its latest record."""

    def __init__(self, steps: int, stream: Stream) -> None:
        self.steps = steps
        self.waited = 0  # steps after which the host found the device `steps` behind and waited
        self.waited_s = 0.0  # the host's time in those waits
        self._stream = stream
        self._ring = [torch.cuda.Event() for _ in range(steps)] if stream is not None else []
        self._next = 0

    def step_queued(self) -> None:
        if not self._ring:
            return
        event = self._ring[self._next]
        if not event.query():  # the device is `steps` steps behind the host: the device bounds the run
            self.waited += 1
            started = time.perf_counter()
            event.synchronize()  # host sync: on the step `steps` back
            self.waited_s += time.perf_counter() - started
        event.record(self._stream)
        self._next = (self._next + 1) % self.steps
