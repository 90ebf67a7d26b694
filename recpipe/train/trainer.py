"""The training loop of ``recpipe train``: one :class:`Trainer` per rank.

Build: choose the checkpoint to resume from (the newest intact one: its record says
where the data resumes), start the training batches' producers there, so that they
make the first batches while the rest is built; seed, build the model on meta, shard it
(DistributedModelParallel + the combined fused-embedding / dense optimizer), load the
checkpoint, wrap the model in the configured pipeline. The time from the command to the
first timed step is kept phase by phase (``recpipe.train.startup``): rank 0 prints it
once every speed feature is ready, and summary.json holds it (``startup``).

Train in segments. The trainer hands the pipeline ``islice(batches, n)``, where
``n`` runs up to the next evaluation (``train.eval_every``), checkpoint
(``checkpoint.every``) or ``train.steps``, and calls ``progress`` until
StopIteration: the pipeline then has trained every batch of the segment and has
none in flight. Only then does the trainer evaluate or save, so a checkpoint is
exactly the state after its step. An epoch ends when its data yields fewer batches
than the segment asked for (the pipeline's step count is agreed by all ranks, so
all ranks see the same end); the next segment reads epoch ``e + 1``.

Logging: every ``train.log_every`` steps the outputs of the steps since the last
log go into the metrics and every rank takes part in their all-reduce, all as
device work that the host does not wait for; the values are read one log interval
later (their TensorBoard step is still their own), when the device has long
finished them, so logging never drains the pipeline. Segment ends (evaluation,
checkpoint, the end) wait and publish everything. Rank 0 updates the tqdm bar and
the TensorBoard scalars (and the same ones in W&B with ``logging.wandb``). With ``train.on_nonfinite=skip_step`` a log point waits
for the non-finite check of its interval, whose skipped steps the metrics leave out. At the end rank 0 writes ``summary.json`` in ``logging.run_dir``
(also when the run stops early; its ``status`` says why; always strict JSON).

Faults: at every step boundary the ranks agree on whether a signal asked them to
stop (``preemption``: then the pipeline drains, a checkpoint is saved and
``Preempted`` is raised); the step's loss is kept for the non-finite check at log
points and before every evaluation and checkpoint (``nonfinite``); the step watchdog
notes the boundary, and ends the job when a rank stops making steps (``watchdog``).
None adds a host sync per step. ``summary.json`` says ``"running"`` from the first
step on, so a run killed without a word never leaves an earlier run's summary.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import resource
import threading
import time
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator, NoReturn, TypeVar

import fbgemm_gpu
import torch
import torch.distributed as dist
import torchrec
from tqdm import tqdm

from recpipe.checkpoint.store import (TrainPosition, checkpoint_path, choose_checkpoint, describe_newest, load_chosen,
                                      resume_settings, save_checkpoint)
from recpipe.compat import torch as compat_torch
from recpipe.config import RecpipeConfig
from recpipe.data import Batch, make_dataloader, no_eval_data, num_batches
from recpipe.data.loader import epoch_batches, spans_epochs, with_sized_workers, workers_description
from recpipe.distributed import init_process_group
from recpipe.errors import DataError, NonFiniteLossError, Preempted, data_errors
from recpipe.groups import control_group
from recpipe.models import make_model
from recpipe.builder import make_pipeline
from recpipe.pipelines.accumulation import GradientAccumulation
from recpipe.pipelines.evaluation import Evaluation
from recpipe.sharding import plan_summary, shard_model
from recpipe.train.clock import IntervalClock, LoaderWait, seconds
from recpipe.train.learning_rates import LearningRates
from recpipe.train.metrics import METRICS, ClickMetrics, PendingMetrics, click_outputs
from recpipe.train.nonfinite import (
    NonFiniteCheck,
    SkipNonFiniteSteps,
    check_finite_weights,
    finite_json,
    skip_step_caveats,
)
from recpipe.stop_requests import describe_request, signal_of
from recpipe.train.preemption import Preemption
from recpipe.train.run_dir import RunDir
from recpipe.train.startup import StartupClock
from recpipe.train.wandb_logger import WandbLogger
from recpipe.train.watchdog import StepWatchdog

__all__ = ["Trainer", "intra_op_threads", "run_worker", "start_rank"]

_GIB = 2**30
# A log interval whose host spent more than this share of its training time blocked on the
# loader's next() was paced by the loader: the device or the host's own work would have
# taken more of it (the trainer says so once, with what would help).
LOADER_BOUND = 0.2
T = TypeVar("T")


def run_worker(cfg: RecpipeConfig, startup: StartupClock | None = None) -> None:
    """One rank of ``recpipe train`` (module-level: ``launch_local`` pickles it); the
    caller leaves the process group (``recpipe.train.cli.run_rank``: at once, or, after a
    failure, as the process ends). ``startup``: the command's start-up clock."""
    device = start_rank(cfg, startup)
    Trainer(cfg, device, startup=startup).fit()


def start_rank(cfg: RecpipeConfig, startup: StartupClock | None = None) -> torch.device:
    """What a rank of ``recpipe train`` does before it builds its :class:`Trainer`,
    whoever launched it (``recpipe train`` itself or torchrun): quiet the libraries'
    own deprecation warnings, join the process group, set its intra-op threads
    (:func:`intra_op_threads`). Returns the rank's device."""
    if startup is not None:
        startup.lap("launch")
    _quiet_library_deprecations()
    device = init_process_group(cfg)
    threads = intra_op_threads(os.environ)
    if threads is not None:
        torch.set_num_threads(threads)
    if startup is not None:
        startup.lap("process_group")
    return device


def intra_op_threads(env: Mapping[str, str]) -> int | None:
    """Intra-op threads of every rank, on CUDA and CPU, whoever launched it: 1, as
    torchrun gives each of several processes per node; None when the user set
    OMP_NUM_THREADS (theirs wins: torch has read it; more threads pay off only for
    large CPU ops on cores nothing else uses).

    torch starts an OpenMP team of one thread per core in every process, whose
    threads spin for a while after each parallel region. On CUDA a rank launches GPU
    work and computes little on its own CPU, and the team takes cores from the
    training thread, the data producers and NCCL's threads
    (benchmarks/results/h100x1/trainer_vs_bench.md; docs/data.md, "Loader processes and
    threads"). On CPU the ranks compute on these threads, but a team stalls at every
    barrier whenever one of its threads waits for a core, as soon as another process
    wants one (docs/fault_tolerance.md)."""
    return None if "OMP_NUM_THREADS" in env else 1


def _quiet_library_deprecations() -> None:
    """torch and torchrec warn about their own internals on every rank (torchrec's
    DDP arguments, ShardedTensor in DCP, deprecated collectives it calls, its
    is_fx_tracing checks): nothing a user of recpipe can act on, and it buries the
    metrics."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch")
    compat_torch.fx_trace_logger().setLevel(logging.ERROR)


class Trainer:
    """One rank's training: ``Trainer(cfg, device).fit()``. ``pipeline_class``: a subclass of
    the configured pipeline's class to train with (default: ``pipeline.class``, else the
    pipeline's own), built with the configured options and speed features."""

    def __init__(self, cfg: RecpipeConfig, device: torch.device, pipeline_class: type | None = None,
                 startup: StartupClock | None = None) -> None:
        # The command's start-up clock (recpipe.train.startup), else one from here.
        self.startup = startup if startup is not None else StartupClock(started_at=time.time())
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # data.num_workers: auto, sized here once for every loader of the run
        cfg, sizing = with_sized_workers(cfg, rank=self.rank, world_size=self.world_size)
        self.cfg, self.device = cfg, device
        if sizing is not None:
            self.startup.lap("data_sizing")
        # Rank 0's bar and lines (tqdm.write) are this process's own: tqdm's default lock adds
        # a multiprocessing lock, a named semaphore that a rank killed with SIGKILL would leave
        # behind (the resource tracker removes it with a "leaked semaphore" warning).
        tqdm.set_lock(threading.RLock())
        if sizing is not None:
            self._say(sizing.line(workers_description(cfg)))
        # Samples per optimizer step, over all ranks (train.accumulate_steps micro-batches each).
        self.global_batch = cfg.data.batch_size * self.world_size * cfg.train.accumulate_steps
        self.started = time.perf_counter()
        # Where training resumes is known before the model exists (the checkpoint's record),
        # so the training batches' producers start first and make the first batches while
        # the model is built and the checkpoint loaded.
        chosen = choose_checkpoint(cfg.checkpoint) if cfg.checkpoint.dir is not None and cfg.checkpoint.resume else None
        self.position = chosen.position if chosen is not None else TrainPosition(step=0, epoch=0, batch=0)
        self.start_step = self.position.step
        self.startup.lap("checkpoint_choice")
        self._first_batch_wait = 0.0  # the first step's wait for its first batch (start-up)
        self._epochs: Iterator[Iterator[Batch]] | None = None  # a loader spanning epochs, split by epoch
        self._started_batches = self._started_loader(self.position)
        self.startup.lap("data_start")
        # Same dense initialisation on every rank (DDP would broadcast rank 0's anyway).
        torch.manual_seed(cfg.train.seed)
        self.sharded = shard_model(make_model(cfg), cfg, device)
        self.startup.lap("model")
        self._say(plan_summary(self.sharded.plan, self.sharded.tables))
        if chosen is not None:
            load_chosen(chosen, self.sharded.model, self.sharded.optimizer)
            self._say(f"resumed from {chosen.path}: step {chosen.position.step}, epoch {chosen.position.epoch}, "
                      f"batch {chosen.position.batch}")
            self.startup.lap("checkpoint_load")
        self.pipeline = make_pipeline(cfg, self.sharded.model, self.sharded.optimizer, device, cls=pipeline_class)
        # train.accumulate_steps > 1: each step trains that many micro-batches (recpipe.pipelines.accumulation)
        self.accumulation = (GradientAccumulation(self.pipeline, cfg.train.accumulate_steps)
                             if cfg.train.accumulate_steps > 1 else None)
        self.rates = LearningRates(cfg.optimizer, self.sharded.optimizer, self.sharded.model)  # optimizer.*.schedule
        if not self.rates.constant:
            self._say(repr(self.rates))
        if self.position.batch > 0:
            # Resumed: this rank may be past its last batch while others are not;
            # its padding batches then take their shapes from its first batch, made here
            # (data.num_workers 0: no producers started and ended for one batch).
            one_batch = cfg.model_copy(update={"data": cfg.data.model_copy(update={"num_workers": 0})})
            first = make_dataloader(one_batch, rank=self.rank, world_size=self.world_size, split="train",
                                    epoch=self.position.epoch)
            self.pipeline.padding_template = next(iter(first), None)
        self.startup.lap("pipeline")
        # Training: TorchRec's window values over one log interval (train/<name>) and lifetime ones
        # (train/<name>_lifetime); evaluation: over the whole eval split.
        self.train_metrics = ClickMetrics(
            device, window_samples=cfg.train.log_every * cfg.data.batch_size * cfg.train.accumulate_steps)
        self.eval_metrics = ClickMetrics(device)
        self.evaluation = Evaluation(self.pipeline, pipelined=cfg.train.eval_pipelined)
        self.has_eval = num_batches(cfg, rank=self.rank, world_size=self.world_size, split="eval") != 0
        if not self.has_eval:
            self._say(f"no eval data ({no_eval_data(cfg.data)}): evaluation is skipped")
        # collective: StorageError (exit 6) on every rank if it cannot be written
        self.run_dir = RunDir(cfg, self.rank, resumed_from=self.start_step)
        if self.run_dir.note:
            self._say(self.run_dir.note)
        self.wandb = None  # rank 0, with logging.wandb: the same scalars as TensorBoard
        if self.rank == 0 and cfg.logging.wandb is not None:
            self.wandb = WandbLogger(cfg, resumed=self.start_step > 0)
        # The bar is rank 0's, and only on a terminal (tqdm's disable=None): in a log
        # file every refresh would be one more line; eval lines and TensorBoard remain.
        show_bar = self.rank == 0 and cfg.train.progress
        self.bar = tqdm(
            total=cfg.train.steps, initial=self.start_step, unit="step", disable=None if show_bar else True
        )
        # Steps since the last log: the loss of each non-padding step, and for models whose
        # output follows the metrics contract (docs/models.md) its logits, labels, weights.
        # One entry per batch (train.accumulate_steps per step): (loss, is_padding, (logits, labels,
        # weights) or None); and the optimizer steps they make.
        self._window: list[tuple[torch.Tensor, bool, tuple[torch.Tensor, ...] | None]] = []
        self._window_steps = 0
        self._has_clicks: bool | None = None  # known after the first step
        self._clock = IntervalClock(device)  # each log interval's training time, on the device
        self._waits = LoaderWait()  # the host's waits for the training batches
        self._sizing = sizing  # data.num_workers: auto's choice, for the loader-bound line
        self._said_loader_bound = False
        self._train_seconds = 0.0
        self._steady = [0, 0.0]  # steps and device seconds of the log intervals after the start-up
        # The last log point's values on their way to the host (published at the next): its step,
        # steps, training time (IntervalClock's stretches, read then), metrics, learning rates and
        # the host's (waited, trained) seconds (LoaderWait).
        self._pending_log: tuple[int, int, list, PendingMetrics, dict[str, float], tuple[float, float]] | None = None
        self.last_train: dict[str, float] = {}
        self._memory_peaks: list[dict[str, float]] | None = None  # each rank's, from the log points
        self.last_eval: dict[str, float] = {}
        self.last_eval_samples_per_s: float | None = None
        self.last_eval_loader_wait_s: float | None = None  # this rank's host time blocked on the eval loader
        self._eval_batches: Iterator[Batch] | None = None  # the next evaluation's, started early

    # ----------------------------------------------------------------- setup
    def _loader(self, position: TrainPosition) -> Iterable[Batch]:
        """The training batches from ``position`` on: to the end of its epoch, or, where the
        source can (``spans_epochs``), through the last epoch (one set of producers that run
        on across the epochs' starts)."""
        epochs = self.cfg.train.epochs - position.epoch if spans_epochs(self.cfg.data) else 1
        return make_dataloader(
            self.cfg,
            rank=self.rank,
            world_size=self.world_size,
            split="train",
            epoch=position.epoch,
            start_batch=position.batch,
            epochs=max(epochs, 1),
        )

    def _started_loader(self, position: TrainPosition) -> Iterable[Batch]:
        """The training batches from ``position`` on, their producers started now (``iter``). A
        loader that fails to start is returned as it is: training starts it again, where a data
        error is reported (``data_errors``)."""
        loader = self._loader(position)
        try:
            return iter(loader)
        except (ValueError, OSError):
            return loader

    def _train_batches(self, position: TrainPosition) -> Iterator[Batch]:
        """The training batches of ``position``'s epoch from ``position`` on: the first time
        those started while the trainer was built, then the next epoch's of the same loader
        where it spans epochs (:func:`~recpipe.data.loader.epoch_batches`), else a new loader."""
        if self._epochs is not None:
            batches = next(self._epochs)
        else:
            started, self._started_batches = self._started_batches, None
            batches = started if started is not None else self._loader(position)
            if spans_epochs(self.cfg.data):
                per_epoch = num_batches(self.cfg, rank=self.rank, world_size=self.world_size, split="train")
                self._epochs = epoch_batches(batches, per_epoch - position.batch, per_epoch)
                batches = next(self._epochs)
        return self._preemption.gate(data_errors(self._first_batch_timed(batches)), every=self.cfg.train.accumulate_steps)

    def _first_batch_timed(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """``batches``; until the start-up ends, the wait for the first is the start-up's ``first_batch``."""
        it = iter(batches)
        if not self.startup.finished:
            since = time.time()
            first = next(it, None)
            self._first_batch_wait = time.time() - since
            if first is None:
                return
            yield first
        yield from self._waits.timed(it)

    # ----------------------------------------------------------------- loop
    def fit(self) -> None:
        self._start_fault_handling()
        self.startup.lap("run_setup")
        try:
            self._fit()
        finally:
            self._close_eval_batches()  # an evaluation's producers started for an evaluation that did not come
            self._watchdog.close()

    def _fit(self) -> None:
        train, checkpointing = self.cfg.train, self.cfg.checkpoint.dir is not None
        # A run that ends without a word (killed) leaves this, not an earlier run's summary.
        self.run_dir.write_summary(finite_json({**self.summary(), "status": "running"}))
        batches = self._train_batches(self.position)
        evaluated_at = saved_at = None
        while self.position.step < train.steps and self.position.epoch < train.epochs:
            wanted = self._segment_length(checkpointing)
            end = self.position.step + wanted
            if _due(end, train.eval_every) or end >= train.steps:
                self._start_eval_batches()
            micro = self.cfg.train.accumulate_steps
            trained, batches_trained = self._train_segment(itertools.islice(batches, wanted * micro))
            p = self.position
            self.position = TrainPosition(p.step + trained, p.epoch, p.batch + batches_trained)
            if self._preemption.signum is not None:  # stays in this epoch: a resume past its end starts the next
                self._stop_preempted(saved_at)
            if batches_trained < wanted * micro:  # this epoch's data has ended
                if trained == 0 and p.batch == 0:  # agreed by all ranks: the epoch had no batch at all
                    self._no_training_data(p.epoch)
                self.position = TrainPosition(self.position.step, p.epoch + 1, 0)
                if self.position.epoch < train.epochs:
                    batches = self._train_batches(self.position)
            step = self.position.step
            self._check_nonfinite(step)  # never evaluate or save weights a non-finite step touched
            self._publish_log()
            if _due(step, train.eval_every) and evaluated_at != step:
                self.evaluate()
                evaluated_at = step
                if self._preemption.signum is not None:  # a stop request came during the evaluation
                    self._stop_preempted(saved_at)
            if checkpointing and _due(step, self.cfg.checkpoint.every) and saved_at != step:
                self._save()
                saved_at = step
        step = self.position.step
        if self._window:
            self._log_train(step, wait=True)
        self._check_nonfinite(step)
        if evaluated_at != step:
            self.evaluate()
        self._preemption.close()
        if self._preemption.evaluation_ended:  # a stop request ended the final evaluation
            self._stop_preempted(saved_at)
        if checkpointing and saved_at != step and step > self.start_step:
            self._save()
        self.bar.close()
        self._finish()

    def _save(self) -> None:
        """Collective: save a checkpoint of the state after this step, unless a weight
        is not finite (then NonFiniteLossError, exit 4: never a checkpoint of a
        diverged model). A rank that stops responding meanwhile ends the job (the watchdog)."""
        with self._watchdog.during(f"the checkpoint save of step {self.position.step}"):
            self._stop_if_diverged(lambda: check_finite_weights(self.sharded.model, self.position.step,
                                                                describe_newest(self.cfg.checkpoint.dir)))
            save_checkpoint(self.cfg.checkpoint, self.sharded.model, self.sharded.optimizer, self.position,
                            resume_settings(self.cfg))

    def _no_training_data(self, epoch: int) -> NoReturn:
        """Collective (every rank agreed the epoch had no batch): DataError, exit 5."""
        data = self.cfg.data
        if data.factory is not None:
            where = f"data.factory={data.factory!r} yielded no training batch"
        elif data.source == "criteo_tsv":
            where = f"data.criteo.train_files={list(data.criteo.train_files)} hold no line"
        elif data.source == "binary":
            where = f"data.binary.train_dir={data.binary.train_dir!r} holds no row"
        else:
            where = f"data.source={data.source!r} made no batch"
        self.bar.close()
        self._finish(status="no_training_data")
        raise DataError(f"no training data: {where} (epoch {epoch}, on any of the {self.world_size} ranks)")

    def _segment_length(self, checkpointing: bool) -> int:
        """Steps up to the next point that needs a drained pipeline."""
        step = self.position.step
        ends = [self.cfg.train.steps]
        intervals = [self.cfg.train.eval_every, self.cfg.checkpoint.every if checkpointing else 0]
        ends += [(step // every + 1) * every for every in intervals if every > 0]
        return min(ends) - step

    def _train_segment(self, batches: Iterator[Batch]) -> tuple[int, int]:
        """Train every batch of ``batches``; returns the number of optimizer steps and of
        batches (agreed by all ranks)."""
        if not self.startup.finished and self.position.step > self.start_step:
            self.startup.lap("segment_ends")  # evaluations and checkpoints before the first timed step
        self._watchdog.arm()
        try:
            return self._train_steps(batches)
        finally:
            self._watchdog.disarm()

    def _train_steps(self, batches: Iterator[Batch]) -> tuple[int, int]:
        trained = batches_trained = 0
        last = time.perf_counter()
        self._clock.start()
        self._waits.start()
        while True:
            self.rates.set_step(self.position.step + trained + 1)  # the rates of the step this call trains
            try:
                micro_batches = self._optimizer_step(batches)
            except StopIteration:
                self._count_time(last, synchronize=True)
                self._clock.stop()
                self._waits.stop()
                return trained, batches_trained
            trained += 1
            batches_trained += len(micro_batches)
            step = self.position.step + trained
            if not self.startup.finished:
                self._startup_step(step)
            self._watchdog.stepped(step)
            for output, loss, padding in micro_batches:
                self._record_step(output, loss, padding)
            self._window_steps += 1
            losses = [loss for _, loss, _ in micro_batches]
            self._after_step(losses[0] if len(losses) == 1 else torch.stack(losses).sum())
            self.bar.update(1)
            last = self._count_time(last, synchronize=False)
            if step % self.cfg.train.log_every == 0:
                self._clock.stop()
                self._waits.stop()
                self._log_train(step)
                last = time.perf_counter()  # the metrics' work is not training time
                self._clock.start()
                self._waits.start()

    def _optimizer_step(self, batches: Iterator[Batch]) -> list[tuple[object, torch.Tensor, bool]]:
        """Train one optimizer step: a batch, or train.accumulate_steps micro-batches; each
        as (output, loss, is_padding). StopIteration when the data has none left."""
        if self.accumulation is not None:
            return self.accumulation.step(batches)
        output = self.pipeline.progress(batches)
        return [(output, self.pipeline.last_loss, self.pipeline.last_is_padding)]

    def _startup_step(self, step: int) -> None:
        """After each step until the start-up ends: the run's first step is ``first_step`` (its wait
        for the first batch ``first_batch``), the steps until every speed feature is ready
        (captured, compiled) ``warm_up``; then the start-up is reported (no host sync: the
        host's clock; the device may still be working on the steps queued). A run whose speed
        features never get ready reports no first timed step."""
        if step == self.start_step + 1:
            self.startup.lap("first_step")
            self.startup.move(self._first_batch_wait, "first_step", "first_batch")
        else:
            self.startup.lap("warm_up")
        if not all(getattr(a, "ready", True) for a in getattr(self.pipeline, "applied", ())):
            return
        self.startup.done(step + 1)
        self._say(self.startup.line())

    def _record_step(self, output: object, loss: torch.Tensor, padding: bool) -> None:
        """Keep what the next log needs of this batch (device tensors: no host sync)."""
        if self._has_clicks is None:
            self._has_clicks = click_outputs(output) is not None
            if getattr(self.pipeline, "intercepts", True):  # base runs the model's own forward: nothing to say
                self._say(self.pipeline.describe())
            if not self._has_clicks:
                self._say("the model's output has no logits and labels (docs/models.md, 'Metrics'): only the loss is logged")
        clicks = click_outputs(output) if self._has_clicks else None
        if clicks is not None and clicks[2] is None:  # padding samples must not count
            logits, labels, _ = clicks
            clicks = (logits, labels, torch.full_like(labels, 0.0 if padding else 1.0, dtype=torch.float32))
        self._window.append((loss, padding, clicks))

    def _count_time(self, since: float, synchronize: bool) -> float:
        """Add the time since ``since`` to the run's training time (summary.json). At segment
        ends, first wait for the device (host sync), so that it includes the work the host
        had queued ahead of it. (A log interval's rate is the device's: ``IntervalClock``.)"""
        if synchronize and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self._train_seconds += now - since
        return now

    # ---------------------------------------------------------------- faults
    def _start_fault_handling(self) -> None:
        """Collective (on NCCL jobs it creates a Gloo group). The preemption
        agreement, the step watchdog, the non-finite loss check and, for skip_step, its hooks."""
        cfg = self.cfg
        self._control = control_group()  # host-side agreement and the log points' memory figures
        self._preemption = Preemption(self._control)
        self._watchdog = StepWatchdog(cfg.train.step_timeout_s, self.rank, self.world_size,
                                      lambda: describe_newest(cfg.checkpoint.dir), self._stalled)
        self._nonfinite = NonFiniteCheck(
            cfg.train.on_nonfinite, self.device, lambda: describe_newest(cfg.checkpoint.dir),
            max_skipped=cfg.train.max_skipped_steps, window=cfg.train.skipped_steps_window,
        )
        self._skip = None
        if cfg.train.on_nonfinite == "skip_step":
            for caveat in skip_step_caveats(cfg.optimizer) if self.rank == 0 else ():
                warnings.warn(f"train.on_nonfinite=skip_step is not exact here: {caveat}", stacklevel=2)
            self._skip = SkipNonFiniteSteps(self.sharded.model, self.device)

    def _after_step(self, loss: torch.Tensor) -> None:
        """Every rank, every step; no host sync (an exchange collects an all-reduce
        launched about 0.1 s before, long finished)."""
        self._nonfinite.record(loss)
        if self._preemption.after_step():  # just agreed
            ckpt = self.cfg.checkpoint
            then = ", then saving a checkpoint" if ckpt.dir is not None and ckpt.on_preempt else ""
            what = describe_request(self._preemption.signum)
            self._say(f"{what}: every rank stops after the batches in flight{then}")

    def _check_nonfinite(self, step: int, wait: bool = True) -> None:
        """Collective. With on_nonfinite=error, a non-finite loss found ends the run
        (summary.json written first); with skip_step it is reported. ``wait``: see
        ``NonFiniteCheck.check``."""
        skipped = self._stop_if_diverged(lambda: self._nonfinite.check(step, wait=wait))
        if skipped:
            self._say(f"non-finite loss at step(s) {skipped}: skipped, nothing updated "
                      f"({len(self._nonfinite.skipped)} skipped so far; train.on_nonfinite=skip_step)")
            self._write_scalars(step, {"train/skipped_steps": len(self._nonfinite.skipped)})

    def _stop_if_diverged(self, check: Callable[[], T]) -> T:
        """Run ``check``; if it raises NonFiniteLossError, write summary.json
        (``"status": "nonfinite_loss"``) first."""
        try:
            return check()
        except NonFiniteLossError:
            self._publish_log()
            self.bar.close()
            self._finish(status="nonfinite_loss")
            raise

    def _stalled(self, message: str) -> None:
        """The watchdog's last word on this rank, from its thread while the main thread waits:
        rank 0 records the stall in summary.json."""
        if self.rank == 0:
            self.run_dir.write_summary(finite_json({**self.summary(), "status": "stalled", "stalled": message or None}))

    def _finite_window(self, step: int) -> list:
        """The logged steps' outputs without the skipped steps (the window ends at ``step``;
        skip_step trains one batch a step: train.accumulate_steps 1)."""
        skipped = set(self._nonfinite.skipped)
        first = step - len(self._window) + 1
        return [entry for i, entry in enumerate(self._window) if first + i not in skipped]

    def _stop_preempted(self, saved_at: int | None) -> NoReturn:
        """Collective, once every rank agreed to stop and the pipeline has drained:
        save (checkpoint.on_preempt), write summary.json, raise Preempted."""
        step, ckpt = self.position.step, self.cfg.checkpoint
        if self._window:
            self._log_train(step, wait=True)
        self._check_nonfinite(step)  # never save weights a non-finite step touched
        self._preemption.close()
        if ckpt.dir is None:
            where = "nothing saved (checkpoint.dir is null)"
        elif not ckpt.on_preempt:
            where = f"not saved (checkpoint.on_preempt=false); {describe_newest(ckpt.dir)}"
        elif step == self.start_step:
            where = f"no step trained since the start; {describe_newest(ckpt.dir)}"
        else:
            if saved_at != step:
                self._save()
            where = f"checkpoint {checkpoint_path(ckpt, step)} saved; run the same command again to resume"
        self.bar.close()
        signum = self._preemption.signum
        self._finish(status="preempted", stopped_by=describe_request(signum))
        when = f"after step {step}"
        if self._preemption.evaluation_ended:
            when = (f"during the evaluation after step {step} (ended unfinished, "
                    f"train.stop_grace_s={self.cfg.train.stop_grace_s:g})")
        raise Preempted(f"stopped by {describe_request(signum)} {when}: {where}", signal_of(signum))

    # ------------------------------------------------------- metrics & eval
    def _log_train(self, step: int, wait: bool = False) -> None:
        """Collective. Metrics of the steps since the last log, over all ranks
        (without steps skipped for a non-finite loss). Queued on the device and
        published at the next log point, or now with ``wait``."""
        # skip_step: the metrics must leave the skipped steps out, so wait for the check.
        self._check_nonfinite(step, wait=wait or self.cfg.train.on_nonfinite == "skip_step")
        kept = self._finite_window(step)
        steps, stretches, waits = self._window_steps, self._clock.take(), self._waits.take()
        self._window.clear()
        self._window_steps = 0
        if kept:  # else every step since the last log was skipped (agreed by all ranks)
            if self._has_clicks:
                logits, labels, weights = (torch.cat(parts) for parts in zip(*(clicks for _, _, clicks in kept)))
                self.train_metrics.update(logits, labels, weights)
            # the mean loss over the ranks' non-padding steps, and the click metrics (all-reduces, queued)
            loss = self._mean_loss([loss for loss, padding, _ in kept if not padding])
            values = PendingMetrics({"loss": loss, **(self.train_metrics.compute_values() if self._has_clicks else {})})
            self._publish_log()
            self._pending_log = (step, steps, stretches, values, self.rates.scalars(step), waits)
        if wait:
            self._publish_log()

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Collective: the mean of the ranks' losses (device work only)."""
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        if losses:
            total[0] = torch.stack(losses).double().sum()
            total[1] = len(losses)
        dist.all_reduce(total)
        return total[0] / total[1].clamp(min=1)

    def _publish_log(self) -> None:
        """TensorBoard scalars and the bar's figures of the last log point (waits for them)."""
        if self._pending_log is None:
            return
        step, steps, stretches, values, rates, (waited, trained) = self._pending_log
        self._pending_log = None
        metrics = values.result()  # waits for the metrics, queued after the interval's last step
        interval_s = seconds(stretches)
        samples_per_s = steps * self.global_batch / max(interval_s, 1e-9)
        first_timed = self.startup.first_timed_step
        if first_timed is not None and step - steps >= first_timed - 1:  # the interval has no start-up step
            self._steady[0] += steps
            self._steady[1] += interval_s
        self.last_train = metrics
        scalars = {f"train/{name}": value for name, value in metrics.items()}
        scalars["throughput/samples_per_s"] = samples_per_s
        scalars["throughput/loader_wait_ms_per_step"] = 1e3 * waited / max(steps, 1)
        self._say_if_loader_bound(waited, trained, step, steps)
        memory = _memory_scalars(self.device)
        ranks = _ranks_memory(memory, self._control)
        self._keep_memory_peaks(ranks)
        self._write_scalars(step, {**scalars, **rates, **memory, **_per_rank_tags(ranks)})
        postfix = {name: f"{metrics[name]:.4f}" for name in ("loss", "auc") if name in metrics}
        self.bar.set_postfix({**postfix, "samples/s": f"{samples_per_s:,.0f}"}, refresh=False)
        if self.bar.disable:  # no bar (not a terminal, or train.progress=false): one line per log point
            shown = "  ".join(f"{name} {value}" for name, value in postfix.items())
            self._say(f"step {step}/{self.cfg.train.steps}  {shown}  {samples_per_s:,.0f} samples/s  "
                      f"{_memory_line(memory)}")

    def _keep_memory_peaks(self, ranks: list[dict[str, float]]) -> None:
        """Each rank's highest figures so far (summary.json's ``memory_per_rank``)."""
        peaks = self._memory_peaks or [{} for _ in ranks]
        self._memory_peaks = [{tag: max(value, peak.get(tag, value)) for tag, value in memory.items()}
                              for memory, peak in zip(ranks, peaks)]

    def _say_if_loader_bound(self, waited: float, trained: float, step: int, steps: int) -> None:
        """Once a run: the loader set the pace of the log interval that ended at ``step`` when the
        host spent more than LOADER_BOUND of its training time waiting for batches (rank 0's view)."""
        if self._said_loader_bound or trained <= 0 or waited / trained <= LOADER_BOUND:
            return
        self._said_loader_bound = True
        d = self.cfg.data
        waiting = (f"the loader bounded steps {step - steps + 1}-{step}: {1e3 * waited / max(steps, 1):.2f} ms a step "
                   f"waiting for a batch ({waited / trained:.0%} of their time)")
        if d.factory is not None:
            self._say(f"{waiting}; the batches are data.factory={d.factory!r}'s")
            return
        sized = f"auto chose {d.num_workers} on {self._sizing.cores} cores" if self._sizing is not None else "set"
        self._say(f"{waiting}; data.num_workers {d.num_workers} ({sized}, {workers_description(self.cfg)}). More "
                  "producers or cores per rank, or data that is cheaper to read (binary, criteo_npy: docs/data.md) "
                  "feed it faster")

    def _start_eval_batches(self) -> None:
        """Start the eval split's producers with the training segment that ends in an evaluation:
        they make its first batches (then wait, their slots full) while the segment trains, so
        the evaluation does not wait for them to start. A loader that fails to start is left to
        the evaluation, which reports its error."""
        if not self.has_eval or self._eval_batches is not None:
            return
        try:
            self._eval_batches = iter(make_dataloader(self.cfg, rank=self.rank, world_size=self.world_size,
                                                      split="eval"))
        except (ValueError, OSError):
            self._eval_batches = None

    def _close_eval_batches(self) -> None:
        batches, self._eval_batches = self._eval_batches, None
        close = getattr(batches, "close", None)
        if close is not None:
            close()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Collective. The click metrics (``METRICS``) on the eval split, through the pipeline's eval
        schedule (``train.eval_pipelined``; else one batch at a time), and its samples/s: the
        eval batches' samples over the time from the first fetch to the end of the last
        forward (one host sync, the count's all-reduce)."""
        if not self.has_eval:
            return {}
        loader, self._eval_batches = self._eval_batches, None
        if loader is None:
            loader = make_dataloader(self.cfg, rank=self.rank, world_size=self.world_size, split="eval")
        started, waits = time.perf_counter(), LoaderWait()
        evaluated = samples = 0
        with (self._watchdog.during(f"the evaluation after step {self.position.step}"),
              contextlib.closing(self.evaluation.run(data_errors(waits.timed(loader), "eval data"))) as outputs):
            for result, padding in outputs:
                clicks = click_outputs(result[1]) if isinstance(result, (tuple, list)) and len(result) == 2 else None
                if clicks is None:
                    self.has_eval = False
                    self._say("evaluation is skipped: in eval mode the model does not return (loss, output) with logits "
                              "and labels (docs/models.md, 'Metrics')")
                    break
                logits, labels, weights = clicks
                if padding:  # this rank's eval data ran out before another's: it counts for nothing
                    weights = torch.zeros_like(labels)
                else:
                    evaluated += 1
                    samples += labels.numel()
                self.eval_metrics.update(logits, labels, torch.ones_like(labels) if weights is None else weights)
                if self._preemption.end_evaluation(self.cfg.train.stop_grace_s):  # agreed: a stop request, its grace over
                    break
        if self._preemption.evaluation_ended:
            self.eval_metrics.reset()
            return {}
        if not self.has_eval:
            return {}
        evaluated, samples = _total([evaluated, samples], self.device)  # host sync: after the last forward
        samples_per_s = samples / max(time.perf_counter() - started, 1e-9)
        if evaluated == 0:  # a data.factory returning None for 'eval'
            self.has_eval = False
            self._say("evaluation is skipped: the eval split has no batches")
            return {}
        metrics = self.eval_metrics.compute()
        self.eval_metrics.reset()
        self.last_eval, self.last_eval_samples_per_s = metrics, samples_per_s
        self.last_eval_loader_wait_s = waits.total
        step = self.position.step
        self._write_scalars(step, {**{f"eval/{name}": value for name, value in metrics.items()},
                                   "eval/samples_per_s": samples_per_s, "eval/loader_wait_s": waits.total})
        self.run_dir.embedding_row_norms(step, self.sharded.model)
        shown = "  ".join(f"{name} {metrics[name]:.4f}" for name in METRICS)
        self._say(f"step {step}: eval {shown}  ({samples_per_s:,.0f} samples/s, {waits.total:.2f} s of it waiting "
                  "for batches)")
        if not math.isfinite(metrics["logloss"]):  # the same on every rank (all-reduced metrics)
            self._stop_if_diverged(lambda: self._nonfinite_eval(step, metrics["logloss"]))
        return metrics

    def _nonfinite_eval(self, step: int, logloss: float) -> NoReturn:
        raise NonFiniteLossError(
            f"non-finite eval loss after step {step} (eval logloss {logloss}): the weights have diverged although the training "
            f"losses were finite; nothing saved after step {step - 1}. {describe_newest(self.cfg.checkpoint.dir)}. "
            "Lower optimizer.dense.lr / optimizer.embedding.lr"
        )

    # ----------------------------------------------------------- reporting
    def _say(self, message: str) -> None:
        if self.rank == 0:
            tqdm.write(message)

    def _write_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self.run_dir.scalars(step, scalars)
        if self.wandb is not None:
            self.wandb.log(step, scalars)

    def _finish(self, status: str = "completed", **why: Any) -> None:
        """Close the TensorBoard writer; rank 0 writes summary.json (strict JSON: a
        non-finite number is written as null; ``why``: what ended the run, beside its
        status) and, when completed, the final line."""
        self.run_dir.close()
        if self.wandb is not None:
            self.wandb.finish(status)
        if self.rank != 0:
            return
        summary = {**self.summary(), "status": status, **why}
        path = self.run_dir.write_summary(finite_json(summary))
        if status != "completed":
            return
        auc = summary["eval_auc"]
        shown = "n/a (no eval data)" if auc is None else f"{auc:.4f}"
        print(f"final eval AUC {shown} after {summary['steps']} steps ({summary['samples']:,} samples); {path}", flush=True)

    def summary(self) -> dict:
        step = self.position.step
        trained_here = (step - self.start_step) * self.global_batch
        return {
            "steps": step,
            "samples": step * self.global_batch,
            "loss": self.last_train.get("loss"),
            **{f"train_{name}": self.last_train.get(name) for name in METRICS},  # the last log interval's
            **{f"eval_{name}": self.last_eval.get(name) for name in METRICS},  # the last evaluation's
            "eval_samples_per_s": self.last_eval_samples_per_s,  # of the last evaluation
            "eval_loader_wait_s": None if self.last_eval_loader_wait_s is None else round(self.last_eval_loader_wait_s, 3),
            "pipeline": self.cfg.pipeline.name,
            "epoch": self.position.epoch,
            "resumed_from_step": self.start_step if self.start_step else None,
            "wall_time_s": round(time.perf_counter() - self.started, 3),
            "train_time_s": round(self._train_seconds, 3),
            "samples_per_s": trained_here / self._train_seconds if self._train_seconds else None,
            # the log intervals after the start-up (no compile, capture or warm-up step in them), on
            # the device's clock: the rate to hold beside recpipe bench's
            "steady_samples_per_s": self._steady[0] * self.global_batch / self._steady[1] if self._steady[1] else None,
            "world_size": self.world_size,
            # each rank's peak memory at the log points (GiB): max_allocated / max_reserved on CUDA, peak_rss on CPU
            "memory_per_rank": None if self._memory_peaks is None else [
                {"rank": rank, **{tag.removeprefix("memory/"): round(v, 4) for tag, v in peaks.items()}}
                for rank, peaks in enumerate(self._memory_peaks)],
            "intra_op_threads": torch.get_num_threads(),
            "skipped_steps": self._nonfinite.skipped,  # train.on_nonfinite=skip_step
            "speedups": self._speedups(),
            # steps after which the host waited for the device (pipeline.steps_ahead): device-bound steps
            "host_waits": getattr(self.pipeline, "host_waits", None),
            # the host's time waiting for training batches (rank 0's), and the producers that made them
            "loader_wait_s": round(self._waits.total, 3),
            "num_workers": self.cfg.data.num_workers,
            "startup": self.startup.summary(),  # recpipe.train.startup
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "versions": {
                "torch": torch.__version__,
                "torchrec": torchrec.__version__,
                "fbgemm_gpu": fbgemm_gpu.__version__,
                "cuda": torch.version.cuda,
            },
        }

    def _speedups(self) -> dict[str, Any]:
        """What each speed feature applied to the pipeline did (``summary()``: the step
        graph's replays and eager steps, compiled and eager calls), else what it is."""
        return {_speedup_key(a): a.summary() if callable(getattr(a, "summary", None)) else repr(a)
                for a in getattr(self.pipeline, "applied", ())}


def _speedup_key(applied: Any) -> str:
    """``recpipe.speedups.step_graph.StepGraph`` -> ``step_graph``: the module's name, as the config key."""
    return type(applied).__module__.rsplit(".", 1)[-1]


def _total(counts: list[int], device: torch.device) -> list[int]:
    """Collective: each of ``counts`` summed over the ranks (every rank decides alike)."""
    total = torch.tensor(counts, dtype=torch.int64, device=device)
    dist.all_reduce(total)
    return total.tolist()


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def _memory_line(memory: dict[str, float]) -> str:
    """Rank 0's memory of :func:`_memory_scalars`, for the log line."""
    if "memory/max_allocated_gib" in memory:
        return (f"max allocated {memory['memory/max_allocated_gib']:.2f} GiB, "
                f"max reserved {memory['memory/max_reserved_gib']:.2f} GiB")
    return f"peak RSS {memory['memory/peak_rss_gib']:.2f} GiB"


def _memory_scalars(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {
            "memory/max_allocated_gib": torch.cuda.max_memory_allocated(device) / _GIB,
            "memory/max_reserved_gib": torch.cuda.max_memory_reserved(device) / _GIB,
        }
    # ru_maxrss is the peak resident set size, in KiB on Linux.
    return {"memory/peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / _GIB}


def _ranks_memory(memory: dict[str, float], group: dist.ProcessGroup | None) -> list[dict[str, float]]:
    """Collective on ``group`` (the Gloo control group; None: one process): every rank's
    :func:`_memory_scalars`, by rank. One all-gather of a few host floats at a log point,
    which waits for no device work."""
    if group is None:
        return [memory]
    mine = torch.tensor(list(memory.values()), dtype=torch.float64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [dict(zip(memory, values.tolist())) for values in gathered]


def _per_rank_tags(ranks: list[dict[str, float]]) -> dict[str, float]:
    """``memory/<name>`` of rank r as ``memory/rank<r>/<name>``."""
    return {f"memory/rank{rank}/{tag.removeprefix('memory/')}": value
            for rank, memory in enumerate(ranks) for tag, value in memory.items()}
