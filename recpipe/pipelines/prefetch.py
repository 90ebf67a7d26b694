"""``prefetch``: UVM-cache prefetch of batch i+1 between forward(i) and backward(i).

For ``fused_uvm_caching`` tables built with FBGEMM's ``prefetch_pipeline`` (LRU,
cache-line locking), FBGEMM's contract is: prefetch(i) -> fwd(i) -> prefetch(i+1)
-> bwd(i) -> prefetch(i+2), exactly one prefetch per forward, each prefetched
batch followed by its backward (which unlocks its cache lines). This schedule is
that order: forward(i) is queued, the host waits for batch i+1's splits while the
GPU runs it (as in sparse_dist), launches i+1's tensors all-to-all, and queues the
prefetch of i+1 on the prefetch stream; FBGEMM's backward hooks serialize the TBE
backward(i) against it. TorchRec's order, with the host wait before forward(i), left
the GPU idle while the host waited: on one H100 (configs/bench/uvm_caching.yaml,
32768 samples) 1.10-1.17x its GPU busy time against 0.96-1.0x in this order, 2-3 ms a
step (tests/schedule_variants.py keeps that order as a test schedule).

Fixes of TorchRec's PrefetchTrainPipelineSparseDist by construction:
* forward(i) waits for the prefetch of batch i itself (an event on the prefetch
  stream), and the inputs the prefetch reads are recorded on the prefetch and
  compute streams: the race of TorchRec PR #4191 (its forward waits on the
  data-dist stream, and nothing orders that stream after the prefetch) cannot
  happen. So the input all-to-all of i+2 needs no fence on the prefetch of i+1:
  such a fence made the next step's host sync on the splits wait for the prefetch
  to finish on the GPU;
* ``forward_stream`` given to FBGEMM is the real compute stream;
* one fill path, so no duplicate prefetch on refill (PR #4503);
* after an evaluation outside the pipeline (``detached()``), the cache-line locks
  the eval forwards took are released (FBGEMM locks on every prefetch, and an eval
  forward has no backward to unlock).
Without cached tables (CPU CI) the prefetch step is a no-op and the schedule is
numerically ``sparse_dist``.

UVM-cached tables are built with FBGEMM's cache-line locking (``prefetch_pipeline``)
when, and only when, this pipeline runs them (``Options.locks_cache_lines``); its
cache insert is recpipe's by default (``pipeline.cache_fill``,
``recpipe.speedups.cache_fill``), and FBGEMM's backward pre-hook work of batch i runs
on the prefetch stream after prefetch(i+1) (``recpipe.speedups.cache_bookkeeping``).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from recpipe.pipelines import sharded
from recpipe.errors import job_warning
from recpipe.pipelines.definition import PipelineDef
from recpipe.pipelines.engine import Pipeline
from recpipe.pipelines.options import PipelineOptions
from recpipe.pipelines.schedule import Schedule, Step
from recpipe.speedups import cache_bookkeeping
from recpipe.speedups.cache_fill import CacheFillOptions

if TYPE_CHECKING:
    from recpipe.config import RecpipeConfig

SCHEDULE = Schedule(
    "prefetch",
    (
        Step("zero_grad", "compute", 0),
        Step("h2d", "memcpy", 2),
        Step("forward", "compute", 0, waits=(("h2d", 0), ("prefetch", 0))),
        Step("input_dist_wait", "dist", 1),
        Step("prefetch", "prefetch", 1, waits=(("input_dist_wait", 0),)),
        Step("backward", "compute", 0),
        Step("optimizer", "compute", 0),
        Step("input_dist", "dist", 2, waits=(("h2d", 0),)),
    ),
    doc="Prefetch of batch i+1 after forward(i), before backward(i); the host waits for i+1's splits "
        "while the GPU runs forward(i); forward(i+1) waits for the prefetch.",
).validate()

# One prefetch per forward, in order (FBGEMM's forward pops the prefetched cache locations):
# the training order without backward and optimizer. The eval forwards' cache-line locks are
# released when the evaluation ends (after_detached_run).
EVAL_SCHEDULE = Schedule(
    "prefetch_eval",
    (
        Step("h2d", "memcpy", 2),
        Step("forward_eval", "compute", 0, waits=(("h2d", 0), ("prefetch", 0))),
        Step("input_dist_wait", "dist", 1),
        Step("prefetch", "prefetch", 1, waits=(("input_dist_wait", 0),)),
        Step("input_dist", "dist", 2, waits=(("h2d", 0),)),
    ),
    doc="Evaluation: prefetch of batch i+1 after forward(i) is queued; forward(i+1) waits for it.",
).validate()

def cached_tbes(model: torch.nn.Module, locked: bool = True) -> list:
    """FBGEMM TBEs with a UVM cache and cache-line locking (``locked=False``: every
    TBE with a UVM cache; the bench reads their cache statistics)."""
    marker = "lxu_cache_locking_counter" if locked else "lxu_cache_weights"
    return [m for m in sharded.all_modules(model)
            if isinstance(getattr(m, marker, None), torch.Tensor) and getattr(m, marker).numel() > 0]


class Options(PipelineOptions):
    name: Literal["prefetch"]
    # recpipe's UVM-cache insert in the prefetch step (recpipe/speedups/cache_fill.py).
    cache_fill: CacheFillOptions = CacheFillOptions()

    locks_cache_lines: ClassVar[bool] = True


def check(cfg: "RecpipeConfig") -> list[str]:
    """An explicit ``pipeline.cache_fill`` needs cache rows in the weights' precision."""
    fill = cfg.pipeline.cache_fill
    if "cache_fill" not in cfg.pipeline.model_fields_set or not fill.enabled:
        return []
    problems = []
    for name, t in cfg.table_sharding().items():
        if t.kernel == "fused_uvm_caching" and t.cache_precision not in (None, t.weights_precision or "fp32"):
            problems.append(
                f"pipeline.cache_fill copies rows as they are, but sharding table {name} has "
                f"cache_precision={t.cache_precision!r} and weights_precision={t.weights_precision or 'fp32'!r}; "
                "make them equal or set pipeline.cache_fill=false (FBGEMM's insert)"
            )
    return problems


class PrefetchPipeline(Pipeline):
    name = "prefetch"
    schedule = SCHEDULE
    eval_schedule = EVAL_SCHEDULE

    def __init__(self, model, optimizer, device, **options) -> None:
        super().__init__(model, optimizer, device, **options)
        self.tbes = cached_tbes(model)
        if not self.tbes:
            job_warning(
                "prefetch pipeline: the model has no UVM-cached table with prefetch_pipeline, so the prefetch "
                "step does nothing (the schedule still runs, as in CPU tests)",
                stacklevel=2,
            )

    def after_detached_run(self) -> None:
        """Release cache locks taken by forwards outside the pipeline.

        With no batch in flight every legitimate lock has been released by its
        backward, so any count left comes from eval/no-grad forwards: zero it."""
        assert not self.in_flight()
        for tbe in cached_tbes(self.model):
            tbe.lxu_cache_locking_counter.zero_()
            tbe.lxu_cache_locations_list.clear()
            tbe.timesteps_prefetched.clear()
            cache_bookkeeping.clear(tbe)


def memory_facts(options: Options) -> dict:
    """What the planner cannot read off the schedule: who inserts the missed rows (recpipe's
    insert where ``pipeline.cache_fill`` is on and Triton can run, ``recpipe.speedups.cache_fill``;
    checked without importing Triton, which a plan does not need) and where FBGEMM's backward
    pre-hook work runs (the prefetch stream, ``recpipe.speedups.cache_bookkeeping``)."""
    recpipe_insert = options.cache_fill.enabled and importlib.util.find_spec("triton") is not None
    return {"cache_insert": "recpipe" if recpipe_insert else "fbgemm", "cache_bookkeeping_stream": "prefetch"}


PIPELINE = PipelineDef("prefetch", PrefetchPipeline, Options,
                       "FBGEMM's UVM-cache prefetch of batch i+1 between forward(i) and backward(i)",
                       schedules=(SCHEDULE,), schedule_of=lambda options: SCHEDULE, check=check,
                       extra_facts=memory_facts,
                       torchrec="PrefetchTrainPipelineSparseDist",
                       torchrec_options=lambda options: ({"execute_all_batches": True}, []))
