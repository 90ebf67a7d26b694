"""The whole training step as one CUDA graph: ``pipeline.step_graph``, applied from outside.

With the dense part graphed (``pipeline.cuda_graphs``) a step at 8192 samples is still
the host's time: torchrec's input dist, lookups and awaitables, FBGEMM's TBE calls and
the autograd engine launch a few hundred kernels one by one. When every batch has the
same shapes (Criteo: one id per feature; MLPerf DLRM-DCNv2: a fixed number of ids per
feature), the step can be captured once and replayed: NVIDIA's MLPerf DLRM submissions
capture their whole iteration for that reason.

:func:`apply_step_graph` turns a pipeline that runs one batch's whole step in one call
(``recpipe.capabilities.ONE_BATCH_PER_STEP``: ``base``, ``sparse_dist``) into a two-step
schedule (``step_graph.SCHEDULE``): the next batch's host-to-device copy
on the memcpy stream, as before, and ``train_step``: the batch copied into the graph's
static input buffers, then one replay of the captured step: input dist (one rank:
nothing to exchange; several ranks: the id all-to-all with splits known from the
shapes, :mod:`recpipe.speedups.fixed_splits`), TBE lookups, output dist, the dense forward and
backward (the compiled modules when ``pipeline.compile`` is on), the output dist
backward, the TBE backward with its fused update, the dense gradients' all-reduce and
the dense optimizer. The step's outputs (loss, logits, labels, weights) are copied out
of the graph's buffers for the metrics.

Life of a pipeline with a step graph:

1. The first steps run eagerly (the same steps as ``base``): at least ``WARMUP_STEPS``,
   which create what first calls create lazily (torchrec's input dists, cuBLAS
   workspaces, optimizer state), and until the first ``capacity_batches`` batches have
   been fetched, whose ids per feature are counted.
2. Capacity: a feature listed in ``capacity`` holds that many ids a batch; the others
   as many as the measured batches had, if they all had the same (fixed shapes: nothing
   is padded), else the largest times ``headroom``. Where a capacity is above a batch's
   ids, the batch is padded (:func:`pad_features`): every feature gets one more bag, the
   padding bag, holding its missing ids (copies of the feature's own ids); the sharded
   modules' pooled output loses that bag's row again before the model reads it
   (:class:`DropPaddingBag`), so its gradient is zero and no table row moves: pooling
   over padded entries adds nothing. EmbeddingCollection (sequence) outputs have no
   bag to drop: models with them need fixed shapes.
   Row-wise tables on several ranks (``row_wise``; ``table_row_wise`` within a host)
   send each rank the ids of its rows, a number that varies with the ids even where a
   feature's ids per batch do not. Such a feature's capacity is one per rank (its
   bucket: the largest measured count times ``headroom``, or ``capacity`` split evenly),
   the same on every rank, and every batch's buckets are padded to it (the padding
   ids of a bucket are the bucket's own ids, or its first row where it has none), so
   the captured all-to-all's splits hold for every batch. The host counts each
   bucket's ids as torchrec's bucketization will (:class:`~recpipe.speedups.fixed_splits.Buckets`).
3. The next batch that fits is copied into static buffers and the step captured
   (``torch.cuda.graph``); every later batch with the same shapes is a copy and a
   replay. A batch over capacity (or of other shapes: a last, smaller batch) trains
   eagerly on its own, unpadded: counted in ``eager_steps``, named once in a warning,
   and in ``summary()`` (``speedups.step_graph`` in the trainer's summary.json). On several ranks the ranks agree,
   so all take the same path: each rank's verdict leaves at the batch's fetch (one Gloo all-reduce a step, which
   runs while the host goes on) and is read at its ``train_step``, a step later. A rank that padded a batch some
   other rank could not take copies it again as it came, so that batch trains unpadded on every rank.

Evaluation: a step-graph pipeline evaluates with ``base``'s eval schedule
(``recpipe.pipelines.evaluation``), whose eager forward is the host's time as the eager
step is (torchrec's input dist, the TBE lookups, the dense forward). :class:`EvalGraph`
wraps its two steps (``Pipeline.wrap_eval_step``; the plain loop,
``train.eval_pipelined=false``, runs none):

* ``h2d``, on the host at fetch: the batch fitted as a training batch is
  (:meth:`StepGraph.fitted`: padded to the capacity, with the padding bag that
  :class:`DropPaddingBag` drops), and whether it replays, agreed by every rank at once (one
  Gloo all-reduce a batch): it fits on every rank and has the shapes of the first that did.
* ``forward_eval``: such a batch is copied into the graph's static input buffers and the
  captured forward (the model in eval mode, under ``torch.no_grad()``) replayed; what the
  model returned is copied out of the graph's buffers for the metrics. The first such batch
  runs eagerly, padded, in the captured layout (the warm-up), the second is captured; the
  graph serves every later evaluation.

A batch that does not fit (over capacity; other shapes: a partial last batch, an uneven
rank's padding batch), and every batch before the training step is captured, runs eagerly,
unpadded: counted in ``eager``, and those that do not fit in ``over_capacity``
(``speedups.step_graph.eval`` in the trainer's summary.json). A pooled embedding is a sum per
bag, so a padded batch's real bags are the unpadded batch's: a replayed eval batch gives the
eager forward's outputs bit for bit (tests/test_eval_graph.py, tests/test_eval_graph_gpu.py).

Learning rates (``optimizer.*.schedule``): the dense optimizer reads a scheduled rate
from a device tensor (``recpipe.train.learning_rates``), so replays follow it. FBGEMM's
TBE backward reads the embedding rate on the host (``learning_rate_tensor.item()``), so
a captured step keeps the rate of its capture: a step whose embedding rate differs from
the captured one runs eagerly (``lr_steps`` in ``summary()``), and a new graph is captured
once the rate holds from one step to the next. A warm-up or a polynomial decay of the
embedding rate changes it every step, so those steps run eagerly; a constant rate, a
step decay's plateaus and the steps after a decay replay.

Exactness: a replay launches the captured kernels on the same buffers, so a graphed
step trains bit-identically to the same pipeline run eagerly on the same (padded)
batches (GPU tests). The host state the captured step changes is kept as the eager
step keeps it: the dense optimizer's step counts (Adagrad's, +1 a step) and FBGEMM's
device ``iter`` counter (captured), so checkpoints are the eager ones.

Refused, with the setting to change (the config rules of ``recpipe.speedups.defs.step_graph``,
run by ``recpipe.preflight``): pipelines that do not offer ``ONE_BATCH_PER_STEP`` (their
overlap of two batches is not one step), UVM-cached tables (the
rows a prefetch moves vary per batch), data_parallel tables (torchrec trains them through
DDP), grid_shard tables, an embedding optimizer whose FBGEMM kernel reads the
host step count (Adam), a dense Adam (torch computes its bias corrections on the host
from the step count), DDP (its gradient hooks belong to the default stream),
``pipeline.cuda_graphs`` beside it (the step graph holds the dense part already), a
pipeline subclass with per-step hooks (they run on the host each step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import warnings
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist
from torchrec.distributed.types import Awaitable, LazyAwaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from recpipe.capabilities import ONE_BATCH_PER_STEP
from recpipe.compat import torch as compat_torch
from recpipe.errors import PipelineError
from recpipe.groups import control_group, graph_holds_collectives
from recpipe.runtime import sharded, steps
from recpipe.runtime.engine import Pipeline
from recpipe.runtime.schedule import Schedule, Step
from recpipe.speedups.defs.step_graph import StepGraphOptions
from recpipe.speedups.fixed_splits import Buckets, FixedBuckets, fixed_splits_installed, row_buckets
from recpipe.speedups.recat_cache import RecatCache
from recpipe.speedups.optimizer_graph import HOST_STATE, fused_optimizers, torch_optimizers

if TYPE_CHECKING:
    from recpipe.runtime.context import StepContext

__all__ = ["DropPaddingBag", "EvalGraph", "SCHEDULE", "StepGraph", "StepGraphOptions", "apply", "apply_step_graph", "pad_features"]

# Eager steps before the capture: the first creates what first calls create lazily (torchrec's
# input dists, cuBLAS workspaces), the second runs with all of it in place, as the capture will.
WARMUP_STEPS = 2

SCHEDULE = Schedule(
    "step_graph",
    (
        Step("h2d", "memcpy", 1),
        Step("train_step", "compute", 0, waits=(("h2d", 0),)),
    ),
    doc="pipeline.step_graph: the next batch's copy overlaps a replay of the whole captured step.",
).validate()


# ----------------------------------------------------------------- batches
def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor of a batch, in a fixed order (a KJT's values, lengths and weights: its
    offsets are computed from the lengths by the step, and a KJT may cache them or not)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, KeyedJaggedTensor):  # not its offsets: derived from the lengths, inside the step
        return [t for t in (obj.values(), obj.lengths(), obj.weights_or_none()) if t is not None]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _tensors(item)]
    if dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__"):
        return [t for item in vars(obj).values() for t in _tensors(item)]
    return []


def _kjts(obj: Any) -> list[KeyedJaggedTensor]:
    if isinstance(obj, KeyedJaggedTensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [k for item in obj for k in _kjts(item)]
    if isinstance(obj, dict):
        return [k for item in obj.values() for k in _kjts(item)]
    if dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__") and not isinstance(obj, torch.Tensor):
        return [k for item in vars(obj).values() for k in _kjts(item)]
    return []


def signature(batch: Any) -> tuple:
    """What a captured step bakes in of its batch: every tensor's shape and dtype, and
    each KJT's keys, stride and ids per key (torchrec reads them on the host)."""
    return (tuple((tuple(t.shape), t.dtype) for t in _tensors(batch)),
            tuple((tuple(k.keys()), k.stride(), tuple(k.length_per_key())) for k in _kjts(batch)))


def _clone(obj: Any) -> Any:
    """A deep copy of a device batch with its own buffers (the graph's static inputs)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, KeyedJaggedTensor):
        w = obj.weights_or_none()
        return KeyedJaggedTensor(keys=obj.keys(), values=obj.values().clone(), lengths=obj.lengths().clone(),
                                 weights=None if w is None else w.clone(), stride=obj.stride(),
                                 length_per_key=obj.length_per_key(), offset_per_key=obj.offset_per_key())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(item) for item in obj)
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: _clone(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
    if hasattr(obj, "__dict__"):
        copy = object.__new__(type(obj))
        copy.__dict__.update({k: _clone(v) for k, v in vars(obj).items()})
        return copy
    return obj


# ----------------------------------------------------------------- padding
@dataclass(frozen=True)
class _Segments:
    """What :func:`pad_features` needs of its capacities and buckets, made once per layout:
    each key's segments (its buckets, or the key itself), in key order."""

    block: torch.Tensor  # per key: a bucket's rows (bucketed keys), else a bound no id reaches
    count: torch.Tensor  # per key: its segments (buckets; 1 if not bucketed)
    first: torch.Tensor  # per key: its first segment
    key: torch.Tensor  # per segment: its key
    capacity: torch.Tensor  # per segment: the ids a padded batch holds there
    fill: torch.Tensor  # per segment: the padding id where it has no ids (the bucket's first row, or row 0)


@functools.lru_cache(maxsize=8)
def _segments(capacity: tuple[tuple[int, ...], ...], buckets: tuple[Buckets | None, ...]) -> _Segments:
    block, count, caps, fill = [], [], [], []
    for cap, b in zip(capacity, buckets):
        if b is None:
            block, count, caps, fill = block + [2**62], count + [1], caps + [sum(cap)], fill + [0]
            continue
        rowless = [r for r, c in enumerate(cap) if c and b.first_row(r) is None]
        if len(cap) != b.count or rowless:
            raise ValueError(f"pad_features: capacities {list(cap)} for {b}: one per bucket, 0 for a bucket "
                             "without table rows")
        block.append(b.block)
        count.append(b.count)
        caps += cap
        fill += [b.first_row(r) or 0 for r in range(b.count)]  # a bucket without rows: capacity 0, never filled
    first = [0, *itertools.accumulate(count)][:-1]
    key = [k for k, n in enumerate(count) for _ in range(n)]
    return _Segments(*(torch.tensor(x, dtype=torch.int64) for x in (block, count, first, key, caps, fill)))


def _by_segment(values: torch.Tensor, counts: list[int], plan: _Segments) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The positions of ``values`` grouped by segment, each segment's in their order (None
    where each key is one segment: ``values`` are grouped already), and each segment's ids."""
    lengths = torch.tensor(counts)
    if len(plan.key) == len(counts):
        return None, lengths
    if len(set(counts)) == 1:  # as many ids per key: a (key, id) view, the per-key values broadcast
        ids = values.long().view(len(counts), -1)
        block, count, first = plan.block.view(-1, 1), plan.count.view(-1, 1), plan.first.view(-1, 1)
    else:
        ids = values.long()
        block, count, first = (torch.repeat_interleave(t, lengths, output_size=len(values))
                               for t in (plan.block, plan.count, plan.first))
    # each id's segment: its key's first + its bucket (FBGEMM's block bucketization)
    bucket = ids // block
    beyond = bucket >= count  # ids past the table's blocks go to id % count (no valid id does)
    if bool(beyond.any()):
        bucket = torch.where(beyond, ids % count, bucket)
    # a stable sort of small integers: the narrowest type that holds them sorts fastest
    narrow = torch.uint8 if len(plan.key) <= 256 else torch.int16 if len(plan.key) <= 2**15 else torch.int64
    segment = bucket.add_(first).view(-1).to(narrow)
    return torch.sort(segment, stable=True).indices, torch.bincount(segment, minlength=len(plan.key))


def _padding(values: torch.Tensor, order: torch.Tensor | None, held: torch.Tensor, missing: torch.Tensor,
             fill: torch.Tensor) -> torch.Tensor:
    """Each segment's padding ids, segment after segment: its j-th is the (j mod n)-th of
    its n ids (``values[order]``, grouped by segment), its fill id where it has none."""
    n, m = held.tolist(), missing.tolist()
    if all(a <= b for a, b in zip(m, n)):  # each segment's first ids (every batch near its capacity)
        first = [(order if order is not None else values)[s:s + a] for s, a in zip(itertools.accumulate([0, *n]), m)]
        return torch.cat(first) if order is None else values[torch.cat(first)]
    of_pad = torch.repeat_interleave(torch.arange(len(m)), missing)
    j = torch.arange(len(of_pad)) - (torch.cumsum(missing, 0) - missing)[of_pad]
    pads = fill.to(values.dtype)[of_pad]
    if not len(values):
        return pads
    own = held[of_pad]
    at = ((torch.cumsum(held, 0) - held)[of_pad] + j % own.clamp(min=1)).clamp(max=len(values) - 1)
    return torch.where(own > 0, values[at if order is None else order[at]], pads)


def _interleave(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t for pair in zip(a, b) for t in pair])


def pad_features(kjt: KeyedJaggedTensor, capacity: list[int | list[int]],
                 buckets: list[Buckets | None] | None = None) -> KeyedJaggedTensor | None:
    """``kjt`` (on the host) with each key's ids padded to ``capacity`` in one extra bag
    per key (stride + 1); None if a key has more ids than its capacity. A key with
    ``buckets`` (a row-wise table on several ranks) has a capacity per bucket, and each
    bucket is padded to its own. The padding ids are copies of the key's own ids (of
    the bucket's, for a bucketed key; its first row where the bucket has none; row 0 for
    a key without ids), so no row is touched that the batch does not touch, but for
    such a first row, which gets a zero gradient; their per-id weights are 0.

    Every key and bucket (a segment) at once: the host pads a batch each step, in a few
    tensor ops whatever its keys and buckets."""
    counts, stride, values = kjt.length_per_key(), kjt.stride(), kjt.values()
    plan = _segments(tuple((c,) if isinstance(c, int) else tuple(c) for c in capacity),
                     tuple(buckets or [None] * len(counts)))
    order, held = _by_segment(values, counts, plan)
    missing = plan.capacity - held
    if bool((missing < 0).any()):
        return None
    pads = _padding(values, order, held, missing, plan.fill)
    per_key = torch.zeros(len(counts), dtype=torch.int64).index_add_(0, plan.key, missing)
    pad_counts = per_key.tolist()
    w = kjt.weights_or_none()
    lengths = kjt.lengths().view(len(counts), stride)
    return KeyedJaggedTensor(
        keys=kjt.keys(), values=_interleave(values.split(counts), pads.split(pad_counts)),
        lengths=torch.cat([lengths, per_key.to(lengths.dtype).view(-1, 1)], dim=1).view(-1),
        weights=None if w is None else _interleave(w.split(counts), w.new_zeros(len(pads)).split(pad_counts)),
        stride=stride + 1, length_per_key=[n + p for n, p in zip(counts, pad_counts)])


class DropPaddingBag:
    """Stands in for a sharded EmbeddingBagCollection's ``forward`` in padding mode: a
    KJT with the padded stride gives its pooled output without the last (padding) row."""

    def __init__(self, fqn: str, module: Any, padded_stride: int) -> None:
        self.fqn, self.module, self.padded_stride = fqn, module, padded_stride

    def __repr__(self) -> str:
        return f"DropPaddingBag({self.fqn!r}, padded stride {self.padded_stride}; recpipe.speedups.step_graph)"

    def __call__(self, features: KeyedJaggedTensor) -> Any:
        out = type(self.module).forward(self.module, features)
        if features.stride() != self.padded_stride:
            return out
        if isinstance(out, (LazyAwaitable, Awaitable)):
            out = out.wait()
        if not isinstance(out, KeyedTensor) or out.key_dim() != 1:
            raise PipelineError(
                f"pipeline.step_graph pads features in one extra bag, but sharded module {self.fqn!r} returns "
                f"{type(out).__name__}, which has no bag to drop (an EmbeddingCollection); give its features fixed "
                "lengths (pipeline.step_graph.capacity equal to their ids per batch)"
            )
        return KeyedTensor(keys=out.keys(), length_per_key=out.length_per_key(),
                           values=out.values()[: self.padded_stride - 1], key_dim=1)


# ----------------------------------------------------------------- capture
Capture = Callable[[Callable[[], None]], Callable[[], None]]


def capture_with_torch(step: Callable[[], None]) -> Callable[[], None]:
    """Capture ``step()`` (``torch.cuda.graph``: the device is synchronized once, the
    capture runs on a side stream); returns the graph's replay, on the current stream."""
    graph = torch.cuda.CUDAGraph()
    with compat_torch.graph_capture(graph):
        step()
    if dist.is_initialized() and dist.get_world_size() > 1:
        graph_holds_collectives(graph)  # its all-to-alls: reset before the groups go
    return graph.replay


def _host_step_counts(optimizer: Any) -> list[torch.Tensor]:
    """The dense optimizers' host-side step counts a replay does not advance (Adagrad's)."""
    counts = []
    for opt in torch_optimizers(optimizer):
        keys = HOST_STATE.get(type(opt), ())
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state.get(p, {})
                counts += [state[k] for k in keys if isinstance(state.get(k), torch.Tensor)
                           and state[k].device.type == "cpu"]
    return counts


@dataclass
class StepGraph:
    """The ``train_step`` of a pipeline with ``pipeline.step_graph`` (see the module docstring)."""

    options: StepGraphOptions
    capture: Capture = capture_with_torch
    # row-wise features on several ranks -> how torchrec splits their ids among the ranks
    buckets: dict[str, Buckets] = field(default_factory=dict)
    capacity: list[list[int]] | None = None  # per key of the batch's first KJT, per bucket, once known
    keys: list[str] = field(default_factory=list)
    padded: bool = False  # batches get the padding bag
    padded_stride: int = 0  # a padded batch's stride: its samples and the padding bag
    eager_steps: int = 0  # steps that could not replay (before the capture, over capacity, a new embedding rate)
    over_capacity: int = 0
    lr_steps: int = 0  # eager steps whose embedding rate was not the captured one
    replays: int = 0
    _counts: list[list[int]] = field(default_factory=list)  # ids per (key, bucket) of the measured batches
    _replay: Callable[[], None] | None = None
    _static: Any = None
    _shapes: tuple | None = None  # the signature of the first batch admitted on this rank: what replays hold
    _verdicts: dict[int, "_Verdict"] = field(default_factory=dict)  # by batch index: the agreements in flight
    _outputs: dict[str, Any] = field(default_factory=dict)
    _host_counts: list[torch.Tensor] = field(default_factory=list)
    _host_next: list[torch.Tensor] = field(default_factory=list)  # their values after the next replay
    _dropping: list[DropPaddingBag] = field(default_factory=list)
    _recat: RecatCache = field(default_factory=RecatCache)
    _warned: bool = False
    _captured_lrs: tuple = ()  # the embedding rates the graph holds
    _previous_lrs: tuple | None = None  # the embedding rates of the previous step
    evaluation: "EvalGraph | None" = None  # the evaluations' captured forward

    def __repr__(self) -> str:
        state = "captured" if self._replay is not None else "not captured yet"
        cap = "measuring" if self.capacity is None else (f"capacity {self._capacity_by_key()}"
                                                          f"{', padded' if self.padded else ''}")
        return (f"StepGraph({state}; {cap}; {self.replays} replays, {self.eager_steps} eager steps, "
                f"{self.over_capacity} over capacity, {self.lr_steps} at a new embedding rate)")

    @property
    def ready(self) -> bool:
        """Whether the step is captured: steps from here on replay (the trainer's start-up ends)."""
        return self._replay is not None

    def summary(self) -> dict[str, Any]:
        return {"replays": self.replays, "eager_steps": self.eager_steps, "over_capacity": self.over_capacity,
                "lr_steps": self.lr_steps, "padded": self.padded, "capacity": self._capacity_by_key(),
                **({"eval": self.evaluation.summary()} if self.evaluation is not None else {})}

    def _capacity_by_key(self) -> dict[str, int | list[int]]:
        """Ids per batch of each feature; a list (ids per rank's bucket) for a row-wise one."""
        return {k: c if k in self.buckets else c[0] for k, c in zip(self.keys, self.capacity or [])}

    def _bucketing(self) -> list[Buckets | None]:
        return [self.buckets.get(k) for k in self.keys]

    # ------------------------------------------------ on the host, at fetch
    def h2d(self, fn: Callable) -> Callable:
        """Wraps the ``h2d`` step: measure, then pad the host batch before its copy."""

        def h2d(ctx: Any, b: Any) -> None:
            kjts = _kjts(b.host)
            if kjts:
                kjts[0].length_per_key()  # on the host: the device copy carries it (else a host sync to read it)
                self._see(ctx, kjts[0])
                if self.capacity is not None:
                    self._admit(b, kjts[0])
            fn(ctx, b)

        return h2d

    def _admit(self, b: Any, kjt: KeyedJaggedTensor) -> None:
        """Whether batch ``b`` may replay, asked here, with the batch still on the host, of
        every rank at once (the step's one agreement, a Gloo all-reduce that runs while the
        host goes on; :meth:`_admitted_by_all` reads it at ``train_step``, a step later; the
        rest of the decision there is the same on every rank): on each rank it fits the
        captured step (:meth:`fitted`), is no zero-loss padding batch and has the shapes of
        the first such batch (a last, smaller one has not). A batch that fits here is copied
        padded; one that some rank cannot take trains eagerly as it is on every rank
        (torchrec's pooled all-to-all needs the same batch size on every rank)."""
        fitted = None if b.zero_loss else self.fitted(kjt)
        host, ok = b.host, fitted is not None
        if ok:
            padded = with_features(b.host, kjt, fitted)
            shapes = signature(padded)
            self._shapes = self._shapes or shapes
            ok = shapes == self._shapes
        self._verdicts[b.index] = _Verdict(_agree_async(ok), host)
        if ok:
            b.host = with_features(b.host, kjt, fitted, pin=True)

    def _admitted_by_all(self, ctx: Any, b: Any) -> bool:
        """Whether every rank admitted batch ``b`` at its fetch (:meth:`_admit`). Where they
        did not, a batch this rank copied padded is copied again as it came (on the current
        stream: a rare step, named in ``over_capacity``), so every rank trains it unpadded."""
        verdict = self._verdicts.pop(b.index, None)
        if verdict is None:  # fetched before the capacity was known
            return False
        if verdict.agreed():
            return True
        if b.host is not verdict.host:
            b.host = verdict.host
            b.device = b.host.to(ctx.device, non_blocking=True)
        return False

    def fitted(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor | None:
        """``kjt`` (a host batch's features, the capacity known) as a captured step takes it:
        padded to the capacity (padding mode; the padded stride of the training batches,
        which the :class:`DropPaddingBag` wrappers drop), or as it is where it has the
        measured ids per feature; None if it does not fit."""
        if self.padded:
            padded = pad_features(kjt, self.capacity, self._bucketing())
            return padded if padded is not None and padded.stride() == self.padded_stride else None
        return kjt if kjt.length_per_key() == [c[0] for c in self.capacity] else None

    def _see(self, ctx: Any, kjt: KeyedJaggedTensor) -> None:
        if self.capacity is not None:
            return
        self.keys = list(kjt.keys())
        per_key = kjt.values().split(kjt.length_per_key())
        self._counts.append([n for ids, b in zip(per_key, self._bucketing())
                             for n in (b.counts(ids) if b is not None else [ids.numel()])])
        given = set(self.keys) <= set(self.options.capacity)  # nothing to measure: padded from the first batch
        if len(self._counts) < self.options.capacity_batches and not given:
            return
        unknown = sorted(set(self.options.capacity) - set(self.keys))
        if unknown:
            raise PipelineError(f"pipeline.step_graph.capacity names features {unknown}, which the batches do not "
                                f"have; they have {self.keys}")
        # the same capacity on every rank (the ids all-to-all's splits follow from it): the largest
        # and smallest count of each feature (of each rank's bucket of it) over every rank's measured batches
        counts = torch.tensor(self._counts, dtype=torch.int64)
        most = iter(_over_ranks(counts.max(dim=0).values, "max").tolist())
        least = iter(_over_ranks(counts.min(dim=0).values, "min").tolist())
        self.capacity, varying = [], False
        for key, b in zip(self.keys, self._bucketing()):
            measured = [(next(most), next(least)) for _ in range(b.count if b is not None else 1)]
            varying |= any(hi != lo for hi, lo in measured)
            if key in self.options.capacity:  # the feature's ids per batch; a row-wise one's split evenly
                given = self.options.capacity[key]
                cap = [given] if b is None else [math.ceil(given / b.count)] * b.count
            else:
                cap = [hi if hi == lo else math.ceil(hi * self.options.headroom) for hi, lo in measured]
            if b is not None:  # a bucket without rows of the table never holds an id
                cap = [c if b.first_row(r) is not None else 0 for r, c in enumerate(cap)]
            varying |= any(c != hi for c, (hi, _) in zip(cap, measured))
            self.capacity.append(cap)
        # a row-wise feature's ids per bucket vary with the ids even where its ids per batch do not:
        # its buckets are always padded to their capacity (the splits the captured all-to-all holds)
        self.padded = varying or bool(self.buckets.keys() & set(self.keys))
        if self.padded:
            self.padded_stride = stride = kjt.stride() + 1
            for fqn, module in sharded.find_sharded_modules(ctx.model).items():
                if "forward" in vars(module):
                    raise PipelineError(f"pipeline.step_graph: sharded module {fqn!r} already has an instance "
                                        f"forward ({vars(module)['forward']!r})")
                module.forward = drop = DropPaddingBag(fqn, module, stride)
                self._dropping.append(drop)

    # ------------------------------------------------ on the compute stream
    def train_step(self, ctx: Any, b: Any) -> None:
        # The embedding rates are the same on every rank (a function of the step): no agreement needed.
        lrs, previous = _embedding_lrs(ctx.optimizer), self._previous_lrs
        self._previous_lrs = lrs
        if self._replay is not None and lrs != self._captured_lrs:
            self._replay = None  # FBGEMM read the captured rate on the host: this graph cannot train at this one
        new_rate = self._replay is None and lrs != previous and self.eager_steps >= WARMUP_STEPS
        admitted = self._admitted_by_all(ctx, b)  # the rest is the same on every rank
        fits = admitted and (self._replay is not None or self.eager_steps >= WARMUP_STEPS) and not new_rate
        if not fits:
            if self._replay is not None and not b.zero_loss:
                self.over_capacity += 1
                self._warn(b)
            self.lr_steps += new_rate
            self._eager(ctx, b)
            return
        if self._replay is None:
            self._capture(ctx, b)
            self._captured_lrs = lrs
        else:
            for dst, src in zip(_tensors(self._static), _tensors(b.device)):
                dst.copy_(src, non_blocking=True)
        self._replay()
        self.replays += 1
        if self._host_counts:  # after k replays: the values k eager steps leave (two calls, whatever the count)
            compat_torch.foreach_copy_(self._host_counts, self._host_next)
            compat_torch.foreach_add_(self._host_next, 1.0)
        loss, output = compat_torch.tree_map(
            lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (self._outputs["loss"], self._outputs["output"]))
        b.loss_value, b.output = loss.detach(), output

    def _eager(self, ctx: Any, b: Any) -> None:
        self.eager_steps += 1
        with self._recat.installed():
            steps.zero_grad(ctx, b)
            steps.forward(ctx, b)
            steps.backward(ctx, b)
            steps.optimizer(ctx, b)

    def _warn(self, b: Any) -> None:
        if self._warned:
            return
        self._warned = True
        kjts = _kjts(b.host)
        over = {}
        if kjts and list(kjts[0].keys()) == self.keys:
            per_key = kjts[0].values().split(kjts[0].length_per_key())
            for key, ids, cap, bk in zip(self.keys, per_key, self.capacity or [], self._bucketing()):
                n = bk.counts(ids) if bk is not None else [ids.numel()]
                if any(x > c for x, c in zip(n, cap)):
                    over[key] = (n, cap) if bk is not None else (n[0], cap[0])
        warnings.warn(f"pipeline.step_graph: batch {b.index} does not fit the captured step "
                      f"({'ids over capacity ' + str(over) if over else 'other shapes'}); such batches train eagerly "
                      "and are counted (step_graph.over_capacity in summary.json); raise "
                      "pipeline.step_graph.capacity or headroom", stacklevel=3)

    @contextlib.contextmanager
    def fixed_layout(self, ctx: Any) -> Iterator[None]:
        """The model's input dists with their splits known on the host (several ranks:
        :mod:`recpipe.speedups.fixed_splits`) and torchrec's recat indices made once."""
        rows = {k: c for k, c in zip(self.keys, self.capacity or []) if k in self.buckets}
        buckets = FixedBuckets(rows) if rows else None
        with fixed_splits_installed(sharded.find_sharded_modules(ctx.model), buckets), self._recat.installed():
            yield

    def _capture(self, ctx: Any, b: Any) -> None:
        model, optimizer = ctx.model, ctx.optimizer
        self._static = _clone(b.device)
        outputs = self._outputs

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss, output = model(self._static)
            torch.sum(loss).backward()
            optimizer.step()
            outputs["loss"], outputs["output"] = loss.detach(), output

        counts = _host_step_counts(optimizer)
        before = [t.clone() for t in counts]
        try:
            with self.fixed_layout(ctx):
                replay = self.capture(step)
        except Exception as err:
            for t, value in zip(counts, before):
                t.copy_(value)
            raise PipelineError(
                f"pipeline.step_graph: cannot capture the training step ({type(err).__name__}: {err}). A captured "
                "step must not synchronize with the host (.item(), .tolist(), data-dependent shapes) nor copy from "
                "pageable host memory; set pipeline.step_graph=false, or run with "
                "torch.cuda.set_sync_debug_mode('warn') to find the call"
            ) from err
        # After k replays the step counts are where k eager steps leave them: a capture runs the
        # step's host part once (+1, the first replay's), a replay none.
        self._host_counts, self._host_next = counts, [t + 1 for t in before]
        self._replay = self.replay_of(replay, ctx)

    def replay_of(self, replay: Callable[[], None], ctx: Any) -> Callable[[], None]:
        """What replays a capture by ``self.capture``: a real graph's replay calls no Python and
        needs nothing else; a stand-in capture that re-runs the step in Python (CPU tests) must
        see the fixed layout too."""
        if self.capture is capture_with_torch:
            return replay

        def run() -> None:
            with self.fixed_layout(ctx):
                replay()

        return run

    def remove(self) -> None:
        for drop in self._dropping:
            if vars(drop.module).get("forward") is drop:
                del drop.module.forward
        self._dropping = []


def _embedding_lrs(optimizer: Any) -> tuple:
    """The rates of torchrec's fused embedding optimizers (host values)."""
    return tuple(group["lr"] for opt in fused_optimizers(optimizer) for group in opt.param_groups)


def _over_ranks(values: torch.Tensor, how: str) -> torch.Tensor:
    """``values`` (host int64) reduced by ``how`` ("max" or "min") over every rank: one Gloo
    all-reduce on several ranks (a host round trip), none on one."""
    group = control_group()
    if group is None or dist.get_world_size(group) == 1:
        return values
    out = values.clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX if how == "max" else dist.ReduceOp.MIN, group=group)
    return out


def _agree(fits: bool) -> bool:
    """All ranks take the same path (a graph replay or the eager step; a padded batch or the
    batch as it is): yes only if every rank says yes, waited for here. One rank: nothing to agree on."""
    return _agree_async(fits)()


@dataclass(frozen=True)
class _Verdict:
    """Every rank's answer on one batch, on its way (:func:`_agree_async`), and the batch
    as it was fetched (what a rank that padded it trains if the ranks disagree)."""

    agreed: Callable[[], bool]
    host: Any


def _agree_async(fits: bool) -> Callable[[], bool]:
    """:func:`_agree` started now, read later: the returned function waits for every rank's
    answer (a Gloo all-reduce, MIN, that runs while the host goes on). One rank: nothing to
    agree on, nothing to wait for."""
    group = control_group()
    if group is None or dist.get_world_size(group) == 1:
        return lambda: fits
    flag = torch.tensor([int(fits)], dtype=torch.int64)
    work = dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group, async_op=True)

    def agreed() -> bool:
        work.wait()
        return bool(flag.item())

    return agreed


def with_features(batch: Any, kjt: KeyedJaggedTensor, fitted: KeyedJaggedTensor, pin: bool = False) -> Any:
    """Host ``batch`` with its features ``kjt`` replaced by ``fitted`` (:meth:`StepGraph.fitted`);
    ``pin``: a padded KJT pinned where the loader pinned the batch (else its copy blocks the host)."""
    if fitted is kjt:
        return batch
    if pin and kjt.values().is_pinned():
        fitted = fitted.pin_memory()
    return _replace_kjt(batch, kjt, fitted)


def _replace_kjt(batch: Any, old: KeyedJaggedTensor, new: KeyedJaggedTensor) -> Any:
    """``batch`` with ``old`` (its first KJT) replaced by ``new`` (a shallow copy)."""
    if batch is old:
        return new
    if dataclasses.is_dataclass(batch):
        return dataclasses.replace(batch, **{f.name: _replace_kjt(getattr(batch, f.name), old, new)
                                             for f in dataclasses.fields(batch)})
    if isinstance(batch, (list, tuple)):
        return type(batch)(_replace_kjt(item, old, new) for item in batch)
    if isinstance(batch, dict):
        return {k: _replace_kjt(v, old, new) for k, v in batch.items()}
    if hasattr(batch, "__dict__") and not isinstance(batch, torch.Tensor):
        copy = object.__new__(type(batch))
        copy.__dict__.update({k: _replace_kjt(v, old, new) for k, v in vars(batch).items()})
        return copy
    return batch


@dataclass(eq=False)
class EvalGraph:
    """The wrapped ``h2d`` and ``forward_eval`` of a step-graph pipeline's evaluations (see the
    module docstring); its counts are for all evaluations of the pipeline."""

    graph: "StepGraph"  # the training step's: its capacity, padding and fixed layout
    train_ctx: Any  # the training pipeline's step context (its model)
    replays: int = 0
    eager: int = 0  # eval batches run eagerly: before the training step's capture, not fitting, the warm-up
    over_capacity: int = 0  # ... of them, those that did not fit the captured forward
    _replay: Callable[[], None] | None = None
    _warm: bool = False  # the warm-up batch ran
    _static: Any = None
    _shapes: tuple | None = None  # the signature of the first admitted eval batch: what replays hold
    _outputs: dict[str, Any] = field(default_factory=dict)
    _admitted: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # in-flight batches every rank admitted

    def __repr__(self) -> str:
        state = "captured" if self._replay is not None else "not captured yet"
        return f"EvalGraph({state}; {self.replays} replays, {self.eager} eager, {self.over_capacity} over capacity)"

    def summary(self) -> dict[str, int]:
        return {"replays": self.replays, "eager": self.eager, "over_capacity": self.over_capacity}

    # ------------------------------------------------ on the host, at fetch
    def h2d(self, fn: Callable) -> Callable:
        def h2d(ctx: Any, b: Any) -> None:
            kjts = _kjts(b.host)
            if kjts and self.graph.ready:  # the same on every rank: the training step was captured at the same step
                self._admit(b, kjts[0])
            fn(ctx, b)

        return h2d

    def _admit(self, b: Any, kjt: KeyedJaggedTensor) -> None:
        fitted = self.graph.fitted(kjt)
        ok = fitted is not None
        if ok:
            shapes = signature(with_features(b.host, kjt, fitted))
            ok = self._shapes is None or shapes == self._shapes
        if not _agree(ok):
            return
        self._shapes = self._shapes or shapes
        b.host = with_features(b.host, kjt, fitted, pin=True)
        self._admitted.add(b)

    # ------------------------------------------------ on the compute stream
    def forward_eval(self, fn: Callable) -> Callable:
        def forward_eval(ctx: Any, b: Any) -> None:
            if b not in self._admitted:
                self.eager += 1
                self.over_capacity += self.graph.ready
                fn(ctx, b)
                return
            self._admitted.discard(b)
            if not self._warm:  # what the capture runs, eagerly: lazy first calls happen outside it
                self._warm = True
                self.eager += 1
                with self.graph.fixed_layout(self.train_ctx):
                    fn(ctx, b)
                return
            if self._replay is None:
                self._capture(b)
            else:
                for dst, src in zip(_tensors(self._static), _tensors(b.device)):
                    dst.copy_(src, non_blocking=True)
            self._replay()
            self.replays += 1
            b.output = _clone(self._outputs["output"])
            b.forwarded = True

        return forward_eval

    def _capture(self, b: Any) -> None:
        model, outputs = self.train_ctx.model, self._outputs
        self._static = _clone(b.device)

        def forward() -> None:
            with torch.no_grad():
                outputs["output"] = model(self._static)

        try:
            with self.graph.fixed_layout(self.train_ctx):
                replay = self.graph.capture(forward)  # the training step's: a CUDA graph, or a stand-in
        except Exception as err:
            raise PipelineError(
                f"pipeline.step_graph: cannot capture the evaluation's forward ({type(err).__name__}: {err}). A "
                "captured forward must not synchronize with the host (.item(), .tolist(), data-dependent shapes) "
                "in eval mode; set pipeline.step_graph=false"
            ) from err
        self._replay = self.graph.replay_of(replay, self.train_ctx)


_HOOKS = ("before_forward", "after_backward", "after_optimizer_step")


def apply_step_graph(ctx: "StepContext", options: StepGraphOptions, capture: Capture = capture_with_torch) -> StepGraph:
    """Run the training steps of the pipeline of ``ctx`` (its step context) as replays of one
    captured step (see the module docstring). CUDA only, except with a stand-in ``capture``
    (tests)."""
    pipeline = ctx.pipeline
    if capture is capture_with_torch and ctx.device.type != "cuda":
        raise PipelineError(f"pipeline.step_graph needs a CUDA device (this pipeline runs on {ctx.device})")
    if ONE_BATCH_PER_STEP not in ctx.offers:
        raise PipelineError(f"pipeline.step_graph captures one batch's whole step; pipeline {pipeline.name!r} does not "
                            f"offer {ONE_BATCH_PER_STEP} (it overlaps two batches' work)")
    hooked = [h for h in _HOOKS if getattr(type(pipeline), h) is not getattr(Pipeline, h)]
    if hooked:
        raise PipelineError(f"pipeline.step_graph: {type(pipeline).__name__} overrides {hooked}, which run on the "
                            "host every step; a replayed step runs none: set pipeline.step_graph=false")
    modules = sharded.find_sharded_modules(ctx.model)
    types = {fqn: {t for t, _ in sharded.shardings(m)} for fqn, m in modules.items()}
    replicated = [fqn for fqn, t in types.items() if "data_parallel" in t]
    if replicated:
        raise PipelineError(f"pipeline.step_graph: {replicated} hold data_parallel tables, which train through torchrec's "
                            "DistributedDataParallel, whose gradient hooks were made on the default stream and cannot "
                            "be captured; shard them table_wise")
    grid = [fqn for fqn, t in types.items() if "grid_shard" in t]
    if grid:
        raise PipelineError(f"pipeline.step_graph: {grid} hold grid_shard tables, whose input dist the step graph "
                            "cannot fix; shard them row_wise, table_row_wise or column_wise")
    graph = StepGraph(options, capture, buckets=row_buckets(modules))
    ctx.replace_schedule(SCHEDULE, {"train_step": graph.train_step}, intercepts=False)
    ctx.wrap_step("h2d", graph.h2d)
    graph.evaluation = evaluation = EvalGraph(graph, ctx)  # the eval schedule's forward, captured alike
    ctx.wrap_eval_step("h2d", evaluation.h2d)
    ctx.wrap_eval_step("forward_eval", evaluation.forward_eval)
    return graph


def apply(ctx: "StepContext", options: StepGraphOptions) -> StepGraph:
    """The speed feature's entry point (``recpipe.speedups.defs.step_graph``)."""
    return apply_step_graph(ctx, options)
