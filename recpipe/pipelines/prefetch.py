"""``prefetch``: UVM-cache prefetch of batch i+1 between forward(i) and backward(i).

For ``fused_uvm_caching`` tables built with FBGEMM's ``prefetch_pipeline`` (LRU,
cache-line locking), FBGEMM's contract is: prefetch(i) -> fwd(i) -> prefetch(i+1)
-> bwd(i) -> prefetch(i+2), exactly one prefetch per forward, each prefetched
batch followed by its backward (which unlocks its cache lines). This schedule is
that order: forward(i) is queued, the host waits for batch i+1's splits while the
GPU runs it (as in sparse_dist), launches i+1's tensors all-to-all, and queues the
prefetch of i+1 on the prefetch stream; FBGEMM's backward hooks serialize the TBE
backward(i) against it. TorchRec's order, with the host wait before forward(i), is
``input_dist_wait: before_forward`` (the GPU idles 2-3 ms a step at 32768 samples).

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
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from recpipe.pipelines import cache_bookkeeping as cache_bookkeeping_module
from recpipe.pipelines import cache_fill as cache_fill_module
from recpipe.pipelines.engine import Pipeline
from recpipe.pipelines.schedule import Schedule, Step

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

# input_dist_wait="before_forward" (TorchRec's order): the host sync on batch i+1's
# splits comes before forward(i) is queued, so the tensors all-to-all of i+1, and its
# prefetch, start earlier; but while the host waits the GPU has only backward(i-1) and
# the optimizer queued, and idles once they are done. Measured on one H100
# (configs/bench/uvm_caching.yaml, 32768 samples): 1.10-1.17x its GPU busy time
# against 0.96-1.0x with the default order, 2-3 ms per step
# (benchmarks/2026-11-23-h100x1-prefetch_sweep.md).
SCHEDULE_WAIT_BEFORE_FORWARD = Schedule(
    "prefetch_wait_before_forward",
    (
        Step("zero_grad", "compute", 0),
        Step("h2d", "memcpy", 2),
        Step("input_dist_wait", "dist", 1),
        Step("forward", "compute", 0, waits=(("h2d", 0), ("prefetch", 0))),
        Step("prefetch", "prefetch", 1, waits=(("input_dist_wait", 0),)),
        Step("backward", "compute", 0),
        Step("optimizer", "compute", 0),
        Step("input_dist", "dist", 2, waits=(("h2d", 0),)),
    ),
    doc="Variant (TorchRec's order): host sync on batch i+1's splits before forward(i) is queued.",
).validate()


# input_dist_wait="before_forward_early_splits": TorchRec's host wait before forward(i),
# but the splits all-to-all of each batch is launched right after its copy, at the start
# of the call two steps ahead of its forward (not at the end of the call before the
# wait): by the time the host waits for them, a whole step of GPU work has run, so the
# wait should not stall; the tensors all-to-all of i+1, and so its prefetch, still start
# before forward(i). For prefetches that take longer than forward(i), e.g. with an
# all-to-all over NCCL on several GPUs. Not measured yet.
SCHEDULE_EARLY_SPLITS = Schedule(
    "prefetch_early_splits",
    (
        Step("zero_grad", "compute", 0),
        Step("h2d", "memcpy", 2),
        Step("input_dist", "dist", 2, waits=(("h2d", 0),)),
        Step("input_dist_wait", "dist", 1),
        Step("forward", "compute", 0, waits=(("h2d", 0), ("prefetch", 0))),
        Step("prefetch", "prefetch", 1, waits=(("input_dist_wait", 0),)),
        Step("backward", "compute", 0),
        Step("optimizer", "compute", 0),
    ),
    doc="Variant: splits all-to-all launched right after the batch's copy; host sync on batch i+1's splits "
        "before forward(i) is queued.",
).validate()


def cached_tbes(model: torch.nn.Module, locked: bool = True) -> list:
    """FBGEMM TBEs with a UVM cache and cache-line locking (``locked=False``: every
    TBE with a UVM cache; the bench reads their cache statistics). torchrec hides
    them from ``named_modules`` (its sharded modules keep their lookups in a plain
    list), so walk registered children and lists of modules."""
    marker = "lxu_cache_locking_counter" if locked else "lxu_cache_weights"
    found, seen, todo = [], set(), [model]
    while todo:
        module = todo.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        counter = getattr(module, marker, None)
        if isinstance(counter, torch.Tensor) and counter.numel() > 0:
            found.append(module)
        todo.extend(m for m in module._modules.values() if m is not None)
        for value in vars(module).values():
            if isinstance(value, (list, tuple)):
                todo.extend(v for v in value if isinstance(v, torch.nn.Module))
    return found


class PrefetchPipeline(Pipeline):
    name = "prefetch"
    schedule = SCHEDULE
    every_schedule = (SCHEDULE, SCHEDULE_WAIT_BEFORE_FORWARD, SCHEDULE_EARLY_SPLITS)  # default first
    cache_fill_sms = 0  # cache_fill="triton": SMs of the row-moving kernel (0: FBGEMM's insert)
    _bookkept: tuple = ()  # cache_bookkeeping="prefetch_stream": TBEs whose hook work runs after the prefetch

    def __init__(self, model, optimizer, device, *, input_dist_wait: str = "after_forward", cache_fill: str = "triton",
                 cache_fill_sms: int = 4, cache_bookkeeping: str = "prefetch_stream", **options) -> None:
        variants = {"after_forward": SCHEDULE, "before_forward": SCHEDULE_WAIT_BEFORE_FORWARD,
                    "before_forward_early_splits": SCHEDULE_EARLY_SPLITS}
        if input_dist_wait not in variants:
            raise ValueError(f"input_dist_wait={input_dist_wait!r}: choose one of {sorted(variants)}")
        if cache_fill not in ("fbgemm", "triton"):
            raise ValueError(f"cache_fill={cache_fill!r}: choose 'fbgemm' or 'triton'")
        if cache_bookkeeping not in ("prefetch_stream", "backward"):
            raise ValueError(f"cache_bookkeeping={cache_bookkeeping!r}: choose 'prefetch_stream' or 'backward'")
        self.schedule = variants[input_dist_wait]
        super().__init__(model, optimizer, device, **options)
        tbes = cached_tbes(model)
        if not tbes:
            warnings.warn(
                "prefetch pipeline: the model has no UVM-cached table with prefetch_pipeline, so the prefetch "
                "step does nothing (the schedule still runs, as in CPU tests)",
                stacklevel=2,
            )
        # cache_fill="triton": FBGEMM's cache insert with the rows moved by a kernel on cache_fill_sms SMs
        # (recpipe.pipelines.cache_fill), inside this pipeline's prefetch step only.
        self.cache_fill_sms = cache_fill_sms if cache_fill == "triton" and tbes else 0
        if self.cache_fill_sms and cache_fill_module.available():
            warnings.warn(f"pipeline.cache_fill='triton' falls back to FBGEMM's cache insert: "
                          f"{cache_fill_module.available()}; set pipeline.cache_fill=fbgemm to silence this", stacklevel=2)
            self.cache_fill_sms = 0
        # cache_bookkeeping="prefetch_stream": FBGEMM's backward pre-hook work for batch i (lock
        # release, location recompute) on the prefetch stream after prefetch(i+1)
        # (recpipe.pipelines.cache_bookkeeping).
        if cache_bookkeeping == "prefetch_stream" and tbes:
            self._bookkept = tuple(t for t in tbes if cache_bookkeeping_module.install(t))
            if len(self._bookkept) < len(tbes):
                warnings.warn("pipeline.cache_bookkeeping='prefetch_stream': FBGEMM's backward pre-hook "
                              f"{cache_bookkeeping_module.FBGEMM_HOOK} was not found on {len(tbes) - len(self._bookkept)} "
                              "cached TBEs; they keep it; set pipeline.cache_bookkeeping=backward to silence this",
                              stacklevel=2)

    def step_function(self, name: str):
        fn = super().step_function(name)
        if name != "prefetch" or not (self.cache_fill_sms or self._bookkept):
            return fn
        sms, bookkept = self.cache_fill_sms, self._bookkept

        def prefetch_with(pipe, b) -> None:
            with cache_fill_module.routing(sms) if sms else contextlib.nullcontext():
                fn(pipe, b)
            for tbe in bookkept:
                cache_bookkeeping_module.after_prefetch(tbe)

        return prefetch_with

    def after_detached_run(self) -> None:
        """Release cache locks taken by forwards outside the pipeline.

        With no batch in flight every legitimate lock has been released by its
        backward, so any count left comes from eval/no-grad forwards: zero it."""
        assert not self.in_flight()
        for tbe in cached_tbes(self.model):
            tbe.lxu_cache_locking_counter.zero_()
            tbe.lxu_cache_locations_list.clear()
            tbe.timesteps_prefetched.clear()
            cache_bookkeeping_module.clear(tbe)
