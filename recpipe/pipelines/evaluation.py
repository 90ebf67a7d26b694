"""Evaluation through a pipeline's schedule: :class:`Evaluation`.

Each pipeline states its eval schedule beside its training ones (``eval_schedule`` of its
engine class; ``recpipe schedule NAME`` prints it): the training order without
zero_grad, backward and optimizer, its forward ``forward_eval`` (the model in eval mode
under ``torch.no_grad()``). The copy of batch i+2, the input all-to-all of batch i+1 and,
where the pipeline has them, the lookup or the UVM-cache prefetch of batch i+1 overlap the
forward of batch i, as in TorchRec's ``EvalPipelineSparseDist``; the same engine runs it.

Beside training, not inside it: the training pipeline is detached for the evaluation
(``Pipeline.detached``, as for any run of the model outside it; it has no batch in
flight then, the trainer evaluates between segments), and a second engine,
:class:`EvalPipeline`, runs the eval schedule on the same model. It has its own slots,
batch count and end-of-data agreement, so nothing of the training pipeline's state
moves: its batch index (which picks semi_sync's warm-up schedule), padding template,
compiled plans and its speed features' step wrappers (a step graph pads the host batch
in ``h2d``; recpipe's cache insert wraps ``prefetch``). Training after an evaluation
continues exactly as after the plain loop (tests/test_eval_pipeline.py). It shares two
things: the training pipeline's streams, so its batches reuse the blocks the caching
allocator keeps for those streams (new streams would reserve pools of their own), and
the input sources the training pipeline learned on its first batch (else it learns
them on its first eval batch, as training does).

What does not run in an evaluation: the user's hooks (``before_forward``, ...), the
speed features' training step wrappers (the prefetch step runs FBGEMM's cache insert), CUDA
graphs and compiled modules (they run their module's own forward in eval mode or under
no_grad: nothing captured for training is replayed). A pipeline whose model runs its own
sharded forward (``base``; a step graph, whose schedule hands the modules nothing)
evaluates with ``base``'s eval schedule: the next batch's copy overlaps the forward.

What a speed feature wraps for evaluations (``Pipeline.wrap_eval_step``) runs in the eval
schedule (not in the plain loop): a step graph's :class:`recpipe.speedups.step_graph.EvalGraph`
pads each eval batch at its fetch as training batches are, the ranks agree per batch, and
replays one captured forward (eval mode, no_grad) for every batch that fits; the others run
eagerly. Its metrics are the eager evaluation's bit for bit (tests/test_eval_graph.py,
tests/test_eval_graph_gpu.py).

Uneven data: the training pipeline's ``uneven_data`` rule, agreed per batch over all
ranks as in training: a rank whose eval data ran out feeds padding batches (its last
batch with every weight 0, or its training pipeline's last batch if it had none) while
others still have some, so every rank runs the same forwards and collectives.

UVM-cached tables with cache-line locking (``prefetch``): one prefetch per forward, in
order, as FBGEMM's forward expects (it pops the prefetched cache locations; without one
it prefetches inline). An eval forward has no backward to release the lines its prefetch
locked: they stay locked until the evaluation ends, when the training pipeline's
``after_detached_run`` releases them and drops any prefetched locations an interrupted
pass left; the plain loop's forwards lock them alike (FBGEMM's prefetch inside forward).

The plain loop (``train.eval_pipelined: false``) is the same engine on
:data:`PLAIN_SCHEDULE`: one batch at a time, copied and evaluated on the compute stream
(``model(batch.to(device))``), with the same end-of-data agreement (the loop over the
loader alone would hang where ranks have different batch counts: a rank that ran out
leaves the collectives of the others' forwards).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from recpipe.errors import PipelineError
from recpipe.pipelines.defs import base
from recpipe.runtime.engine import Pipeline
from recpipe.runtime.schedule import Schedule, Step
from recpipe.runtime.streams import Streams

__all__ = ["PLAIN_SCHEDULE", "EvalPipeline", "Evaluation", "eval_schedule_of"]

# The copy of batch i+1 is queued after forward(i) on the same stream: the stream order of
# ``for batch in batches: model(batch.to(device))``, the loader read one batch ahead.
PLAIN_SCHEDULE = Schedule(
    "plain_eval",
    (
        Step("forward_eval", "compute", 0, waits=(("h2d", 0),)),
        Step("h2d", "compute", 1),
    ),
    doc="train.eval_pipelined=false: one batch at a time, copied and evaluated on the compute stream.",
).validate()


def eval_schedule_of(pipeline: Pipeline) -> Schedule:
    """The eval schedule of ``pipeline``: its definition's, or ``base``'s copy-only one where
    its model runs its own sharded forward (``base``, a step graph) or it states none."""
    own = pipeline.definition.eval_schedule
    if own is None or not pipeline.context.modules:
        return base.EVAL_SCHEDULE
    return own


def _streams_for(train: Pipeline, schedule: Schedule) -> Streams | None:
    """The training pipeline's streams if they have every role ``schedule`` uses (on CPU
    every stream is None: nothing to share)."""
    streams = train.streams
    if streams.compute is None or all(streams.by_role(r) is not None for r in schedule.roles):
        return streams
    return None


class EvalPipeline(Pipeline):
    """The engine on an eval schedule, for the model of a (detached) training pipeline.

    ``progress()`` evaluates one batch under ``torch.no_grad()`` (the lookups and prefetches
    ahead of the forward too) and returns all the model returned for it; ``last_is_padding``
    says whether it was a padding batch. Built per evaluation (see :class:`Evaluation`)."""

    def __init__(self, train: Pipeline, schedule: Schedule) -> None:
        intercepts = any(s.name == "input_dist" for s in schedule.steps)
        # Where each module's input is: the training pipeline learned it (else the first eval batch does).
        super().__init__(train.model, train.optimizer, train.device, definition=train.definition, schedule=schedule,
                         uneven_data=train.uneven_data, steps_ahead=train.steps_ahead,
                         inputs=train.inputs if intercepts else None,
                         streams=_streams_for(train, schedule),
                         intercepts=intercepts, sources=train.context.sources if intercepts else None)
        self.name = f"{train.name} eval"
        if schedule is not PLAIN_SCHEDULE:  # the speed features that run in an evaluation (wrap_eval_step)
            names = {s.name for s in schedule.steps}  # base's copy-only schedule has no input_dist
            for name, wrappers in train.eval_wrappers.items():
                for wrapper in wrappers if name in names else ():
                    self.wrap_step(name, wrapper)
        last = train.last_fetched
        self.padding_template = last if last is not None else train.padding_template

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        with torch.no_grad():
            return super().progress(dataloader_iter)



class Evaluation:
    """Evaluate ``pipeline``'s model through its eval schedule (``pipelined``) or the plain
    loop, batch by batch: ``for output, is_padding in Evaluation(pipe).run(batches)``.

    Collective: every rank runs the same pass (the end of data is agreed per batch). The
    model is in eval mode for the pass and back in its mode after it."""

    def __init__(self, pipeline: Pipeline, pipelined: bool = True) -> None:
        self.pipeline = pipeline
        self.pipelined = pipelined

    @property
    def schedule(self) -> Schedule:
        return eval_schedule_of(self.pipeline) if self.pipelined else PLAIN_SCHEDULE

    def run(self, batches: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
        """Yield ``(what the model returned, is_padding)`` for every batch of ``batches`` and
        every padding batch this rank feeds; the training pipeline is detached meanwhile."""
        train, model = self.pipeline, self.pipeline.model
        it = iter(batches)
        was_training = model.training
        with train.detached():
            engine = EvalPipeline(train, self.schedule)
            done = False
            try:
                model.eval()
                while True:
                    try:
                        output = engine.progress(it)
                    except StopIteration:
                        done = True
                        return
                    except PipelineError as err:
                        if not self.pipelined:
                            raise
                        raise PipelineError(f"{err} (in the evaluation through schedule {engine.schedule.name}; "
                                            "train.eval_pipelined=false evaluates one batch at a time, the model "
                                            "running its own forward)") from err
                    yield output, engine.last_is_padding
            finally:
                if not done:
                    engine.abandon()
                engine.detach()
                model.train(was_training)
