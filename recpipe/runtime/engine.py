"""The one engine that runs every pipeline's schedule table.

A pipeline is its definition (``recpipe.runtime.definition.PipelineDef``: its
schedules and capabilities, data) run by this engine, or by a ``Pipeline`` subclass
that says, where it differs, how a step behaves; the engine owns everything they
share: batches in flight (slots), fill and drain, the end-of-data agreement across
ranks, the GPU fences named by ``Step.waits``, the sharded-module interception, and
user hooks. Speed features (``recpipe.speedups``) are applied to the model and to the
pipeline from outside, through three public hooks: ``wrap_step`` (a step's function,
wrapped), ``replace_schedule`` (another schedule, with step functions of its own) and
``on_detached`` (called when a run outside the pipeline ends).

What a step, a hook or a speed feature may use of the engine is one object, the
pipeline's :class:`StepContext` (``pipeline.context``): steps are ``step(ctx, batch)``,
speed features are applied as ``apply(ctx, options)``, and hooks read ``self.context``.
Nothing outside this module reads the engine's private fields
(``tests/test_imports.py`` counts them: none).

Slots: ``_slots[k]`` holds the batch k places ahead of the one being trained.
Each ``progress()`` runs the schedule's steps in order on the batches in their
slots, returns the output of slot 0, and shifts every batch one slot down.

Host cost: each schedule is compiled once, on the first ``progress()``, into a plan
(``_Op`` per step: its function, stream and the fences it needs), so a step costs a
list walk, not lookups by name. A fence on a step that ran on the same stream is
dropped (stream order already holds) and events are recorded only after steps that
a fence on another stream waits for. Steps on the compute stream switch no stream
when compute is already current (the usual case).

The batch's device copy: ``h2d`` allocates it on the memcpy stream, so the caching
allocator would hand its blocks to the memcpy stream's next copies as soon as Python
drops the batch, whatever another stream has still queued on them. Every step that
waits for its batch's ``h2d`` from another stream therefore gets the copy handed to its
stream first (``streams.hand_off``: ``record_stream``), here, once for every step and
schedule, speed features' steps included. The host runs ahead of the device (a step
graph's replay is one launch): without it a later batch's copy overwrote an earlier
batch's before that batch's step had read it.

Inputs: the first batch of a pipeline's life is trained while the sharded modules
run their own forward (``discovering``), which is how the pipeline learns where each
module's input lives in the batch (``recpipe.runtime.inputs``); only the steps
that need that knowledge wait for it. See ``_progress_discovering``.

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
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from recpipe.compat import torch as compat_torch
from recpipe.errors import PipelineError
from recpipe.groups import control_group
from recpipe.runtime import sharded, steps
from recpipe.runtime.context import InFlight, StepContext
from recpipe.runtime.definition import PipelineDef
from recpipe.runtime.inputs import InputSource
from recpipe.runtime.schedule import Schedule, Step
from recpipe.runtime.streams import Stream, Streams, StepsAhead, fence, hand_off, record_event, use_stream

__all__ = ["InFlight", "Pipeline", "StepContext"]


@dataclass(frozen=True, eq=False)
class _Op:
    """One step of a schedule, resolved for this pipeline (see ``Pipeline._plan``)."""

    step: Step
    fn: Callable[["StepContext", InFlight], None]
    stream: Stream
    fences: tuple[tuple[str, int], ...]  # the step's waits on steps of another stream
    record: bool  # record an event after it (a fence on another stream waits for it)
    takes_batch: bool  # it reads the batch's device copy, made on another stream (it waits for its h2d)

    @property
    def label(self) -> str:
        return f"recpipe.{self.step.name}"

class Pipeline:
    """Base of every recpipe pipeline: ``progress(iterator)`` trains one batch.

    The model is called as ``model(batch)`` and returns ``(loss, output)``, as
    TorchRec's pipelines require; ``progress()`` returns ``output`` and leaves the
    detached loss in ``last_loss`` (a device tensor: reading it is a host sync) and
    whether the batch was padding in ``last_is_padding``. ``inputs`` maps sharded
    module paths (``sparse.ebc``) to functions that compute the module's input from
    the device batch, for modules whose input is built inside forward.

    What it runs is its ``definition`` (``recpipe.runtime.definition.PipelineDef``:
    name, schedules, capabilities), given when it is built (``PIPELINES[name](...)``,
    ``recpipe.builder.make_pipeline``) or set on a pipeline's own class.

    Hooks for subclasses in trainer scripts (each a no-op here; see
    scripts/custom_pipeline.py and ``pipeline.class``): ``on_batch_fetched(batch)``,
    ``before_forward(batch)``, ``after_backward(batch, loss)``,
    ``after_optimizer_step(batch)``. ``batch`` is the batch on the device, except in
    ``on_batch_fetched`` (the host batch, before the copy); ``self.context`` is what
    they may use of the engine (:class:`StepContext`).

    For pipeline classes (a pipeline with steps of its own): ``schedules()``,
    ``schedule_for(batch)``, ``step_function(name)``, ``sharded_forward(...)``,
    ``own_forward(...)`` and ``after_detached_run()``.
    """

    definition: PipelineDef | None = None  # a pipeline class's own (else given when built)

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        *,
        definition: PipelineDef | None = None,
        schedule: Schedule | None = None,
        max_batches_ahead: int | None = None,
        steps_ahead: int = 2,
        uneven_data: str = "pad",
        inputs: Mapping[str, Callable[[Any], Any]] | None = None,
        streams: Streams | None = None,
        intercepts: bool | None = None,
        sources: Mapping[str, InputSource] | None = None,
    ) -> None:
        """``definition``: what to run (default: the class's own). ``schedule``: run this
        schedule instead of the definition's first (a variant order, made of the steps this
        pipeline has functions for). ``streams``: run on these, ``intercepts``: whether to
        intercept the sharded modules (default: the definition's capability) and
        ``sources``: where their inputs are, as another pipeline learned them (an
        evaluation runs on its training pipeline's, ``recpipe.pipelines.evaluation``).
        The other options are the ``pipeline`` config section's common keys
        (``recpipe.runtime.options.PipelineKeys``, where they are validated)."""
        definition = definition or type(self).definition
        if definition is None:
            raise PipelineError(f"{type(self).__name__} has no pipeline definition: build it through "
                                "recpipe.pipelines.PIPELINES[name](...) or give definition=")
        self.definition = definition
        self.name = definition.name
        self.schedule = (schedule or definition.schedules[0]).validate()
        self.intercepts = definition.intercepts if intercepts is None else intercepts
        self.model = model
        self.optimizer = optimizer
        self.device = device
        self.max_batches_ahead = max_batches_ahead
        self.uneven_data = uneven_data
        modules = sharded.find_sharded_modules(model) if self.intercepts else {}
        self.inputs = dict(inputs or {})
        unknown = sorted(set(self.inputs) - set(modules))
        if unknown:
            raise PipelineError(
                f"inputs names {unknown}, which are not sharded modules of the model; its sharded modules are "
                f"{sorted(modules) or 'none (this pipeline does not intercept them)'}"
            )
        if streams is None:
            streams = Streams.create(device, self.all_roles())
        self.context = StepContext(self, streams, modules, self.inputs, max_batches_ahead)
        self.steps_ahead = steps_ahead
        self._ahead = StepsAhead(steps_ahead, streams.compute)
        if sources and modules:  # learned by another pipeline: input dists run in the order it found
            self.context.modules = {fqn: modules[fqn] for fqn in sources}
            self.context.sources = dict(sources)
        self.last_loss: torch.Tensor | None = None
        self.last_is_padding = False
        # Speed features applied to this pipeline and its model (recpipe.speedups), for repr.
        self.applied: list[Any] = []
        # Step functions wrapped by speed features or studies (wrap_step), in the order applied.
        self._wrappers: dict[str, list[Callable[[Callable], Callable]]] = {}
        # Step functions of its evaluations' eval schedule wrapped by speed features (wrap_eval_step).
        self.eval_wrappers: dict[str, list[Callable[[Callable], Callable]]] = {}
        self._extra_steps: dict[str, Callable[[StepContext, InFlight], None]] = {}  # replace_schedule's
        self._on_detached: list[Callable[[], None]] = []  # speed features' (on_detached)
        self._slots: list[InFlight | None] = [None] * self.schedule.depth
        self._recent: OrderedDict[int, InFlight] = OrderedDict()  # for delta=-1 waits and the rate limiter
        self._exhausted = False  # no rank has data left (agreed)
        self._local_done = False  # this rank's iterator has ended
        self._fetched = 0
        self._last_host: Any = None
        # Shapes for padding batches when this rank has had no batch of its own yet
        # (e.g. resumed past the end of its data while other ranks still train).
        self.padding_template: Any = None
        self._end_of_data = _EndOfData(control_group(), always_wait=uneven_data == "error")
        self._depth = self.schedule.depth
        # Compiled schedules, by id (built on the first progress(), once subclasses are set up).
        self._plans: dict[int, tuple[Schedule, list[_Op], dict[str, _Op]]] = {}
        self._ambient: Stream = None  # the current stream during progress() if it is compute
        self.attached = False
        self.attach()

    @property
    def streams(self) -> Streams:
        return self.context.streams

    @property
    def last_fetched(self) -> Any:
        """The last host batch this rank fetched of its own (None before the first): the
        template of its padding batches."""
        return self._last_host

    # ------------------------------------------------------------ user hooks
    def on_batch_fetched(self, batch: Any) -> None: ...

    def before_forward(self, batch: Any) -> None: ...

    def after_backward(self, batch: Any, loss: torch.Tensor) -> None: ...

    def after_optimizer_step(self, batch: Any) -> None: ...

    # --------------------------------------------- for speed features and studies
    def wrap_step(self, name: str, wrapper: Callable[[Callable], Callable]) -> None:
        """Run step ``name`` as ``wrapper(fn)(ctx, batch)``, ``fn`` being the step's
        function so far (a speed feature: ``recpipe.speedups.cache_fill``; a study: a clock
        around a step). Before the first ``progress()``, with no batch in flight."""
        if name not in {s.name for sched in self.schedules() for s in sched.steps}:
            raise PipelineError(f"{self.name}: no step {name!r} to wrap in its schedules")
        self._check_idle("wrap a step")
        self._wrappers.setdefault(name, []).append(wrapper)
        self._plans.clear()

    def wrap_eval_step(self, name: str, wrapper: Callable[[Callable], Callable]) -> None:
        """Run step ``name`` of this pipeline's evaluations through its eval schedule
        (``recpipe.pipelines.evaluation``) as ``wrapper(fn)(ctx, batch)``: a speed feature that
        speeds up the eval forward too (``recpipe.speedups.step_graph.EvalGraph``). The plain loop runs none."""
        self.eval_wrappers.setdefault(name, []).append(wrapper)

    def replace_schedule(self, schedule: Schedule, functions: Mapping[str, Callable[[StepContext, InFlight], None]],
                         *, intercepts: bool) -> None:
        """Run ``schedule`` from now on, its steps without a function of this pipeline
        taken from ``functions`` (``recpipe.speedups.step_graph``: the whole training step
        as one CUDA graph). ``intercepts``: whether its steps hand sharded modules their
        prepared inputs (False: the model's sharded modules run their own forward)."""
        self._check_idle("change its schedule")
        missing = [s.name for s in schedule.steps if s.name not in functions and s.name not in steps.STEPS]
        if missing:
            raise PipelineError(f"{self.name}: schedule {schedule.name} has steps {missing} without a function")
        if self.attached:
            self.detach()
        ctx = self.context
        self.schedule = schedule
        self._extra_steps = dict(functions)
        ctx.modules = ctx.modules if intercepts else {}
        ctx.sources = None if ctx.modules else {}
        ctx.streams = Streams.create(self.device, self.all_roles() | schedule.roles)
        self._ahead = StepsAhead(self.steps_ahead, ctx.streams.compute)
        self._slots = [None] * schedule.depth
        self._depth = schedule.depth
        self._plans.clear()
        self.attach()

    def on_detached(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` whenever a ``detached()`` block ends, after ``after_detached_run``
        (a speed feature drops the state a forward outside the pipeline left)."""
        self._on_detached.append(fn)

    def _check_idle(self, what: str) -> None:
        if self.in_flight():
            raise PipelineError(f"{self.name}: cannot {what} with batches in flight")

    # ------------------------------------------------------ for pipeline classes
    def all_roles(self) -> frozenset[str]:
        return frozenset().union(*(s.roles for s in self.schedules()))

    def schedules(self) -> list[Schedule]:
        """Every schedule this pipeline may run (pipelines with phases override)."""
        return [self.schedule]

    def schedule_for(self, batch: InFlight) -> Schedule:
        """The schedule of the call that trains ``batch`` (pipelines with phases override)."""
        return self.schedule

    def step_function(self, name: str) -> Callable[[StepContext, InFlight], None]:
        """The function of step ``name`` (pipeline classes override it for their own steps).
        Resolved once per schedule, on the first ``progress()`` (after every subclass
        ``__init__`` has run)."""
        return self._extra_steps.get(name) or steps.STEPS[name]

    def _step_function(self, name: str) -> Callable[[StepContext, InFlight], None]:
        fn = self._extra_steps.get(name) or self.step_function(name)
        for wrapper in self._wrappers.get(name, ()):
            fn = wrapper(fn)
        return fn

    def sharded_forward(self, batch: InFlight, fqn: str, module: Any) -> Any:
        """What sharded module ``fqn`` returns inside this pipeline's forward of ``batch``."""
        return steps.sharded_forward(self.context, batch, fqn, module)

    def own_forward(self, batch: InFlight, fqn: str, module: Any, features: Any) -> Any:
        """The first batch's call of a sharded module: its own forward (``discovering``)."""
        return type(module).forward(module, features)

    # ------------------------------------------------------------- public
    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Train one batch and return the model's output for it; raise
        StopIteration once every batch has been trained."""
        if not self.attached:
            self.attach()
        ctx = self.context
        self._ambient = ctx.stream = ctx.streams.ambient()
        if not self.in_flight():
            ctx.streams.start_pass()
        if ctx.sources is None:
            return self._progress_discovering(dataloader_iter)
        self._fill(dataloader_iter)
        head = self._slots[0]
        if head is None:
            self._drained()
        self._run_ops(self._plan(self.schedule_for(head))[1], dataloader_iter)
        return self._finish_step(head)

    def _run_ops(self, ops: list["_Op"], it: Iterator[Any]) -> None:
        slots = self._slots
        for op in ops:
            batch = slots[op.step.offset]
            if batch is None and op.step.name == "h2d" and not self._exhausted:
                batch = slots[op.step.offset] = self._fetch(it)
            if batch is not None:
                self._run(op, batch)

    def _drained(self) -> None:
        """No batch left: the next call starts a new pass over data (new epoch or
        segment, or the same iterator object handing out more)."""
        self._exhausted = self._local_done = False
        raise StopIteration

    def _finish_step(self, head: InFlight) -> Any:
        assert head.loss_value is not None or head.forwarded, \
            f"{self.name}: schedule finished without a forward for batch {head.index}"
        del self._slots[0]
        self._slots.append(None)
        self.last_loss, self.last_is_padding = head.loss_value, head.is_padding
        # The step is queued: its batch's copies go back to the allocators once the device has
        # run it (the record_streams of its steps); _recent keeps only its events.
        head.host = head.device = None
        self._ahead.step_queued()
        return head.output

    def _progress_discovering(self, it: Iterator[Any]) -> Any:
        """The first call of the pipeline's life: learn every module's input source.

        Batch 0 enters slot 0 with only its copy (its input dist, lookup and prefetch
        steps are skipped: in this forward the sharded modules run their own forward,
        so batch 0 trains exactly as in the plain loop). The schedule's steps of
        batch 0 up to its forward run; then the other slots fill and every remaining
        step of the call runs in schedule order. Steps for later batches that the
        schedule lists before the forward run after it instead, which changes no
        number: they touch only those batches, and keep their order relative to
        batch 0's backward and optimizer (semi_sync's stale lookup of batch 1 still
        precedes backward(0))."""
        batch = self._fetch(it)
        if batch is None:
            self._drained()
        needs = ("to", "record_stream") if self.device.type == "cuda" else ("to",)
        missing = [m for m in needs if not callable(getattr(batch.host, m, None))]
        if missing:
            raise PipelineError(
                f"{self.name}: the batch ({type(batch.host).__name__}) has no {' or '.join(missing)} method; pipelines "
                "copy batches ahead on their own streams, so a batch must be a torchrec Pipelineable: "
                "to(device, non_blocking) -> batch and record_stream(stream) (docs/models.md)"
            )
        self._slots[0] = batch
        schedule, ops, by_name = self._plan(self.schedule_for(batch))
        self._run(by_name["h2d"], batch)
        upto = next(i for i, op in enumerate(ops) if op.step.name in ("forward", "forward_eval"))
        head_ops = [op for op in ops[: upto + 1] if op.step.offset == 0]
        ctx = self.context
        ctx.discovering = True
        try:
            self._run_ops(head_ops, it)
        finally:
            ctx.discovering = False
        found, ctx.found_sources = ctx.found_sources, {}
        # Input dists run in the order the model calls the modules, as in the plain loop.
        ctx.modules = {fqn: ctx.modules[fqn] for fqn in found}
        ctx.sources = found
        self._fill(it)
        self._run_ops([op for op in ops if op not in head_ops], it)
        return self._finish_step(batch)

    def describe(self) -> str:
        """Each sharded module and where its input comes from (known after the first batch)."""
        ctx = self.context
        if not ctx.modules:
            return f"{self.name}: no sharded module is intercepted (the model runs its own forward)"
        if ctx.sources is None:
            return f"{self.name}: inputs not known yet (learned on the first batch): {', '.join(ctx.modules)}"
        return "\n".join(f"{fqn} <- {ctx.sources[fqn]}" for fqn in ctx.modules)

    @property
    def host_waits(self) -> int:
        """Steps after which the host had queued ``steps_ahead`` steps the device had not run
        yet, and waited: the device, not the host or its loader, set the pace then."""
        return self._ahead.waited

    @property
    def host_wait_s(self) -> float:
        """The host's seconds in those waits (``host_waits``)."""
        return self._ahead.waited_s

    def in_flight(self) -> int:
        return sum(b is not None for b in self._slots)

    def batch_ahead(self, slot: int) -> InFlight | None:
        """The batch ``slot`` places ahead of the one being trained (None: none, e.g. draining)."""
        return self._slots[slot] if slot < len(self._slots) else None

    def recent_batch(self, index: int) -> InFlight | None:
        """Batch ``index`` while it is in flight or was trained lately (``StepContext.recent``)."""
        return self._recent.get(index)

    def attach(self) -> None:
        if not self.attached:
            sharded.install(self.context, self.context.modules)
            self.attached = True

    def detach(self) -> None:
        """Restore the sharded modules' own forward. Only with no batch in flight."""
        if self.in_flight():
            raise PipelineError(
                f"{self.name}: cannot detach with {self.in_flight()} batches in flight; "
                "call progress() until StopIteration first"
            )
        sharded.remove(self.context.modules)
        sharded.remove_splits_only(self.context.modules)
        self.context.splits_fused = False
        self.attached = False

    def abandon(self) -> None:
        """Drop the batches in flight (a pass left before its end: an error, or the caller
        stopped reading); the engine is not used again. The current stream first waits for
        their side-stream work (a prefetch that no forward will wait for)."""
        self.streams.join()
        self._slots = [None] * self._depth
        self._recent.clear()

    @contextlib.contextmanager
    def detached(self):
        """Run the model outside the pipeline (evaluation) with no batch in flight."""
        self.detach()
        try:
            yield self.model
        finally:
            self.after_detached_run()
            for fn in self._on_detached:
                fn()
            self.attach()

    def after_detached_run(self) -> None:
        """Called when a ``detached()`` block ends (prefetch releases cache locks here)."""

    def __repr__(self) -> str:
        modules = self.context.modules
        lines = [f"{type(self).__name__}(schedule={self.schedule.name}, depth={self.schedule.depth})"]
        lines += [f"  {fqn}: {vars(m).get('forward', 'own forward')!r}" for fqn, m in modules.items()]
        lines += [f"  input all-to-all: {vars(d).get('forward', 'own forward')!r}" for d in sharded.kjt_all_to_alls(modules)]
        lines += [f"  {line}" for applied in self.applied for line in repr(applied).splitlines()]
        return "\n".join(lines)

    # ------------------------------------------------------------ internals
    def _plan(self, schedule: Schedule) -> tuple[Schedule, list[_Op], dict[str, _Op]]:
        """``schedule`` compiled for this pipeline: (schedule, ops in order, ops by name)."""
        plan = self._plans.get(id(schedule))
        if plan is not None and plan[0] is schedule:
            return plan
        mixed = [s.name for s in self.schedules() if not s.same_stages(self.schedules()[0])]
        assert not mixed, f"{self.name}: schedules {mixed} move batches unlike {self.schedules()[0].name}"
        streams_of = self.streams.by_role
        # A step's stream, over every schedule this pipeline may run (a delta=-1 wait
        # reads the event of the previous batch, which may have run another schedule).
        streams: dict[str, list[Stream]] = {}
        for sched in [*self.schedules(), schedule]:
            for step in sched.steps:
                streams.setdefault(step.name, []).append(streams_of(step.stream))

        def same_stream(dep: str, stream: Stream) -> bool:
            return all(s is stream for s in streams[dep])

        # Record after a step only if a fence on another stream waits for it (and the
        # max_batches_ahead fence in h2d, on the memcpy stream, waits for "optimizer").
        waited = {"optimizer"} if self.max_batches_ahead is not None else set()
        for sched in [*self.schedules(), schedule]:
            for step in sched.steps:
                here = streams_of(step.stream)
                waited.update(dep for dep, _ in step.waits if not same_stream(dep, here))
        ops = []
        for step in schedule.steps:
            stream = streams_of(step.stream)
            fences = tuple((dep, delta) for dep, delta in step.waits if not same_stream(dep, stream))
            takes_batch = ("h2d", 0) in fences
            ops.append(_Op(step, self._step_function(step.name), stream, fences,
                           step.name in waited and stream is not None, takes_batch))
        plan = (schedule, ops, {op.step.name: op for op in ops})
        self._plans[id(schedule)] = plan
        return plan

    def step_stream(self, batch: InFlight, name: str) -> Stream:
        """The stream step ``name`` runs on in the schedule that trains ``batch``."""
        return self._plan(self.schedule_for(batch))[2][name].stream

    def _fill(self, it: Iterator[Any]) -> None:
        """Bring batches into the slots a new pipeline (or one after a drain) needs."""
        for slot in range(self._depth - 1):
            if self._slots[slot] is not None:
                continue
            if self._exhausted:
                return
            batch = self._fetch(it)
            if batch is None:
                return
            self._slots[slot] = batch
            by_name = self._plan(self.schedule)[2]
            for step in self.schedule.catch_up(slot):
                self._run(by_name[step.name], batch)

    def _run(self, op: _Op, batch: InFlight) -> None:
        ctx = self.context
        stream = op.stream
        for dep, delta in op.fences:
            source = batch if delta == 0 else self._recent.get(batch.index - 1)
            if source is not None:
                fence(stream, source.events.get(dep))
        if op.takes_batch:
            hand_off(batch.device, stream)
        ctx.stream = stream  # the current stream while the step runs (steps skip switching to it)
        # Under torch.profiler each step is a named range ("recpipe.input_dist", ...), so a
        # trace shows host time per phase; otherwise not even the range object is made.
        ranged = compat_torch.profiler_enabled()
        if ranged:
            scope = torch.profiler.record_function(op.label)
            scope.__enter__()
        try:
            if stream is None or stream is self._ambient:  # already the current stream
                op.fn(ctx, batch)
            else:
                with use_stream(stream):
                    op.fn(ctx, batch)
        finally:
            ctx.stream = self._ambient
            if ranged:
                scope.__exit__(None, None, None)
        if op.record:
            batch.events[op.step.name] = record_event(stream)

    def _fetch(self, it: Iterator[Any]) -> InFlight | None:
        host: Any = None
        zero_loss = False
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
                raise PipelineError(
                    f"{self.name}: this rank ran out of data after {self._fetched} batches while {have} of "
                    f"{total} ranks still have data; give every rank the same number of batches or set "
                    "pipeline.uneven_data=pad (ranks that run out then train zero-weight padding batches)"
                )
            zero_loss = not hasattr(template, "as_padding")
            host = template if zero_loss else template.as_padding()
        elif have is not None and have < total and self.uneven_data == "error":
            raise PipelineError(
                f"{self.name}: {total - have} of {total} ranks ran out of data at batch {self._fetched} while this "
                "rank still has data; give every rank the same number of batches or set pipeline.uneven_data=pad"
            )
        else:
            self._last_host = host
            self.on_batch_fetched(host)
        batch = InFlight(index=self._fetched, host=host, is_padding=is_padding, zero_loss=zero_loss)
        self._fetched += 1
        self._recent[batch.index] = batch
        while len(self._recent) > self._depth + (self.max_batches_ahead or 0) + 1:
            self._recent.popitem(last=False)
        return batch


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
        # One flag tensor, reused: at most one all-reduce is in flight (the previous
        # one is waited for before the next starts), so it is free again by then.
        self._flag = torch.zeros(1, dtype=torch.int64)
        self._pending: Any = None  # the in-flight all-reduce's Work

    def __call__(self, has_batch: bool) -> int | None:
        """Ranks that have a batch, or None when unknown (this rank has one, so >= 1)."""
        if self.pg is None:
            return int(has_batch)
        if self._pending is not None:  # the previous fetch's all-reduce; done by now
            self._pending.wait()
            self._pending = None
        flag = self._flag
        flag.fill_(int(has_batch))
        work = dist.all_reduce(flag, group=self.pg, async_op=True)
        if has_batch and not self.always_wait:
            self._pending = work
            return None
        work.wait()  # host sync: a Gloo round trip
        return int(flag.item())
