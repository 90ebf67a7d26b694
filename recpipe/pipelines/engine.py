"""The one engine that runs every pipeline's schedule table.

A pipeline is a ``Pipeline`` subclass that names its schedule(s) and, where it
differs, how a step behaves; this engine owns everything they share: batches in
flight (slots), fill and drain, the end-of-data agreement across ranks, the GPU
fences named by ``Step.waits``, the sharded-module interception, and user hooks.

Slots: ``_slots[k]`` holds the batch k places ahead of the one being trained.
Each ``progress()`` runs the schedule's steps in order on the batches in their
slots, returns the output of slot 0, and shifts every batch one slot down.

End of data: every fetch is agreed on by all ranks (one tiny Gloo all-reduce per
step). Ranks that run out while others still have data feed padding batches (the
last batch with every loss weight 0: they train nothing but keep the collectives
aligned) or, with ``uneven_data="error"``, every rank raises. When no rank has data
left, the pipeline drains: it trains what is in flight, raises StopIteration, and
starts afresh on the next ``progress()`` (a new epoch, a new segment, or the same
iterator object reused). So every batch is trained exactly once, on every rank.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from recpipe.data.batch import Batch
from recpipe.pipelines import sharded, steps
from recpipe.pipelines.schedule import Schedule, Step
from recpipe.pipelines.streams import Event, Streams, fence, record_event, use_stream

Output = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # loss, logits, labels, weights


@dataclass(eq=False)
class InFlight:
    """One batch in the pipeline and everything made for it so far."""

    index: int  # position in the pipeline's stream of batches (0, 1, ...)
    host: Batch
    is_padding: bool = False
    device: Batch | None = None
    ctxs: dict[str, Any] = field(default_factory=dict)  # module contexts (create_context)
    splits: list[tuple[list[str], Any]] = field(default_factory=list)  # fused splits all-to-alls
    dist_in: dict[str, Any] = field(default_factory=dict)  # tensors all-to-all awaitables, then KJTLists
    emb: dict[str, Any] = field(default_factory=dict)  # early lookups: output-dist awaitables
    detached: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # semi_sync
    consumed: set[str] = field(default_factory=set)
    events: dict[str, Event] = field(default_factory=dict)
    loss: torch.Tensor | None = None
    output: Output | None = None


class Pipeline:
    """Base of every recpipe pipeline: ``progress(iterator)`` trains one batch.

    Hooks for subclasses in trainer scripts (each a no-op here; see
    scripts/custom_pipeline.py): ``on_batch_fetched(batch)``,
    ``before_forward(batch)``, ``after_backward(batch, loss)``,
    ``after_optimizer_step(batch)``. ``batch`` is the device ``Batch``, except in
    ``on_batch_fetched`` (the host batch, before the copy).
    """

    name = "pipeline"
    schedule: Schedule
    intercepts = True  # does forward take prepared inputs from the pipeline?
    lookup_stream = "dist"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        *,
        max_batches_ahead: int | None = None,
        uneven_data: str = "pad",
    ) -> None:
        if uneven_data not in ("pad", "error"):
            raise ValueError(f"uneven_data={uneven_data!r}: choose 'pad' or 'error'")
        if max_batches_ahead is not None and max_batches_ahead < 1:
            raise ValueError(f"max_batches_ahead={max_batches_ahead} must be >= 1 (or None)")
        self.model = model
        self.optimizer = optimizer
        self.device = device
        self.max_batches_ahead = max_batches_ahead
        self.uneven_data = uneven_data
        self.streams = Streams.create(device, self.all_roles(), self.lookup_stream)
        self._modules = sharded.find_sharded_modules(model) if self.intercepts else {}
        self._splits_fused = False  # SplitsOnlyForward installed (after the first input dist)
        self._slots: list[InFlight | None] = [None] * self.schedule.depth
        self._recent: OrderedDict[int, InFlight] = OrderedDict()  # for delta=-1 waits and the rate limiter
        self._current: InFlight | None = None  # the batch inside forward
        self._exhausted = False  # no rank has data left (agreed)
        self._local_done = False  # this rank's iterator has ended
        self._fetched = 0
        self._last_host: Batch | None = None
        # Shapes for padding batches when this rank has had no batch of its own yet
        # (e.g. resumed past the end of its data while other ranks still train).
        self.padding_template: Batch | None = None
        self._end_of_data = _EndOfData(_control_group(), always_wait=uneven_data == "error")
        # Events only for steps something waits on (each costs a few microseconds of host time).
        self._waited = {dep for sched in self.schedules() for step in sched.steps for dep, _ in step.waits}
        if max_batches_ahead is not None:
            self._waited.add("optimizer")
        self.attached = False
        self.attach()

    # ------------------------------------------------------------ user hooks
    def on_batch_fetched(self, batch: Batch) -> None: ...

    def before_forward(self, batch: Batch) -> None: ...

    def after_backward(self, batch: Batch, loss: torch.Tensor) -> None: ...

    def after_optimizer_step(self, batch: Batch) -> None: ...

    # ------------------------------------------------------ for subclasses
    def all_roles(self) -> frozenset[str]:
        return self.schedule.roles

    def schedules(self) -> list[Schedule]:
        """Every schedule this pipeline may run (pipelines with phases override)."""
        return [self.schedule]

    def schedule_for(self, batch: InFlight) -> Schedule:
        """The schedule of the call that trains ``batch`` (pipelines with phases override)."""
        return self.schedule

    def step_function(self, name: str) -> Callable[["Pipeline", InFlight], None]:
        return steps.STEPS[name]

    def _sharded_forward(self, batch: InFlight, fqn: str, module: Any) -> Any:
        return steps.sharded_forward(self, batch, fqn, module)

    # ------------------------------------------------------------- public
    def progress(self, dataloader_iter: Iterator[Batch]) -> Output:
        """Train one batch; raise StopIteration once every batch has been trained."""
        if not self.attached:
            self.attach()
        self._fill(dataloader_iter)
        head = self._slots[0]
        if head is None:
            # Drained: the next call starts a new pass over data (new epoch or segment,
            # or the same iterator object handing out more).
            self._exhausted = self._local_done = False
            raise StopIteration
        for step in self.schedule_for(head).steps:
            batch = self._slots[step.offset]
            if batch is None and step.name == "h2d" and not self._exhausted:
                batch = self._slots[step.offset] = self._fetch(dataloader_iter)
            if batch is not None:
                self._run(step, batch)
        assert head.output is not None, f"{self.name}: schedule finished without a forward for batch {head.index}"
        self._slots = self._slots[1:] + [None]
        return head.output

    def in_flight(self) -> int:
        return sum(b is not None for b in self._slots)

    def attach(self) -> None:
        if not self.attached:
            sharded.install(self, self._modules)
            self.attached = True

    def detach(self) -> None:
        """Restore the sharded modules' own forward. Only with no batch in flight."""
        if self.in_flight():
            raise sharded.PipelineError(
                f"{self.name}: cannot detach with {self.in_flight()} batches in flight; "
                "call progress() until StopIteration first"
            )
        sharded.remove(self._modules)
        sharded.remove_splits_only(self._modules)
        self._splits_fused = False
        self.attached = False

    @contextlib.contextmanager
    def detached(self):
        """Run the model outside the pipeline (evaluation) with no batch in flight."""
        self.detach()
        try:
            yield self.model
        finally:
            self.after_detached_run()
            self.attach()

    def after_detached_run(self) -> None:
        """Called when a ``detached()`` block ends (prefetch releases cache locks here)."""

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}(schedule={self.schedule.name}, depth={self.schedule.depth})"]
        lines += [f"  {fqn}: {vars(m).get('forward', 'own forward')!r}" for fqn, m in self._modules.items()]
        lines += [f"  input all-to-all: {vars(d).get('forward', 'own forward')!r}" for d in sharded.kjt_all_to_alls(self._modules)]
        return "\n".join(lines)

    # ------------------------------------------------------------ internals
    def _fill(self, it: Iterator[Batch]) -> None:
        """Bring batches into the slots a new pipeline (or one after a drain) needs."""
        for slot in range(self.schedule.depth - 1):
            if self._slots[slot] is not None:
                continue
            if self._exhausted:
                return
            batch = self._fetch(it)
            if batch is None:
                return
            self._slots[slot] = batch
            for step in self.schedule.catch_up(slot):
                self._run(step, batch)

    def _run(self, step: Step, batch: InFlight) -> None:
        stream = self.streams.by_role(step.stream)
        for dep, delta in step.waits:
            source = batch if delta == 0 else self._recent.get(batch.index - 1)
            if source is not None:
                fence(stream, source.events.get(dep))
        with use_stream(stream):
            self.step_function(step.name)(self, batch)
            if step.name in self._waited:
                batch.events[step.name] = record_event(stream)

    def _fetch(self, it: Iterator[Batch]) -> InFlight | None:
        host: Batch | None = None
        if not self._local_done:  # never next() an ended iterator (some loaders hang)
            try:
                host = next(it)
            except StopIteration:
                self._local_done = True
        have, total = self._end_of_data(host is not None), self._end_of_data.world
        if have == 0:
            self._exhausted = True
            return None
        is_padding = host is None
        if is_padding:
            template = self._last_host if self._last_host is not None else self.padding_template
            if self.uneven_data == "error" or template is None:
                raise sharded.PipelineError(
                    f"{self.name}: this rank ran out of data after {self._fetched} batches while {have} of "
                    f"{total} ranks still have data; give every rank the same number of batches or set "
                    "pipeline.uneven_data=pad (ranks that run out then train zero-weight padding batches)"
                )
            host = template.as_padding()
        elif have is not None and have < total and self.uneven_data == "error":
            raise sharded.PipelineError(
                f"{self.name}: {total - have} of {total} ranks ran out of data at batch {self._fetched} while this "
                "rank still has data; give every rank the same number of batches or set pipeline.uneven_data=pad"
            )
        else:
            self._last_host = host
            self.on_batch_fetched(host)
        batch = InFlight(index=self._fetched, host=host, is_padding=is_padding)
        self._fetched += 1
        self._recent[batch.index] = batch
        while len(self._recent) > self.schedule.depth + (self.max_batches_ahead or 0) + 1:
            self._recent.popitem(last=False)
        return batch


def _control_group() -> dist.ProcessGroup | None:
    """A Gloo group for host-side agreement (no device sync); None when not distributed."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


class _EndOfData:
    """Does any rank still have data? One all-reduce of one int per fetch, on Gloo.

    A rank that has a batch already knows the answer (some rank has data), so in
    ``pad`` mode it launches its all-reduce asynchronously and collects it at the
    next fetch: no host round trip on the critical path of a step. Only a rank that
    has run out waits for the sum. In ``error`` mode every rank waits, so all ranks
    raise at the same fetch instead of some entering a collective the others left.
    """

    def __init__(self, pg: dist.ProcessGroup | None, always_wait: bool) -> None:
        self.pg = pg
        self.always_wait = always_wait
        self.world = 1 if pg is None else dist.get_world_size(pg)
        self._pending: tuple[Any, torch.Tensor] | None = None

    def __call__(self, has_batch: bool) -> int | None:
        """Ranks that have a batch, or None when unknown (this rank has one, so >= 1)."""
        if self.pg is None:
            return int(has_batch)
        if self._pending is not None:  # the previous fetch's all-reduce; done by now
            self._pending[0].wait()
            self._pending = None
        flag = torch.tensor([int(has_batch)], dtype=torch.int64)
        work = dist.all_reduce(flag, group=self.pg, async_op=True)
        if has_batch and not self.always_wait:
            self._pending = (work, flag)  # keep the tensor alive until the reduce is done
            return None
        work.wait()  # host sync: a Gloo round trip
        return int(flag.item())
