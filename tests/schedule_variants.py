"""Schedule variants of recpipe's pipelines that the tests run: orders that lost or tied in
measurements, so they are not options of the product.

Each is a named :class:`~recpipe.runtime.schedule.Schedule` that moves batches like its
pipeline's own schedule, so it runs as ``Pipeline(model, optimizer, device, schedule=X)``
(same steps, same offsets: the engine checks it) and trains the same numbers
(tests/test_pipelines.py runs every one against the plain loop). Why each is not the
product's schedule, measured on one H100:

* ``PREFETCH_WAIT_BEFORE_FORWARD``: TorchRec's order for the prefetch pipeline: the host
  sync on batch i+1's splits comes before forward(i) is queued, so the tensors
  all-to-all of i+1, and its prefetch, start earlier; but while the host waits the GPU
  has only backward(i-1) and the optimizer queued, and idles once they are done:
  1.10-1.17x its GPU busy time at 32768 samples (configs/bench/uvm_caching.yaml)
  against 0.96-1.0x for the product's order, 2-3 ms a step.
* ``PREFETCH_EARLY_SPLITS``: TorchRec's wait, with each batch's splits all-to-all launched
  right after its copy, two steps ahead of its forward: for prefetches longer than
  forward(i) (an all-to-all over NCCL on several GPUs); on one GPU there is no splits
  all-to-all, so it equals the wait-before-forward order there.
* ``FUSED_LOOKUP_ON_DIST`` / ``FUSED_LOOKUP_ON_OWN_STREAM``: fused_sparse_dist's lookup of
  batch i+1 on the input-dist stream (TorchRec's ``data_dist``) or on a stream of its
  own, fenced on backward(i): at 65536 samples the compute stream (the product's) was 4 %
  faster than ``data_dist`` with 2 % less reserved memory.
"""

from __future__ import annotations

from recpipe.pipelines.defs import fused_sparse_dist
from recpipe.runtime.schedule import Schedule, Step

PREFETCH_WAIT_BEFORE_FORWARD = Schedule(
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
    doc="TorchRec's order: host sync on batch i+1's splits before forward(i) is queued.",
).validate()

PREFETCH_EARLY_SPLITS = Schedule(
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
    doc="Splits all-to-all launched right after the batch's copy; host sync on batch i+1's splits before "
        "forward(i) is queued.",
).validate()


def _fused_with_lookup_on(role: str, name: str) -> Schedule:
    steps = tuple(Step(s.name, role, s.offset, s.waits) if s.name == "lookup" else s
                  for s in fused_sparse_dist.SCHEDULE.steps)
    return Schedule(name, steps, doc=f"fused_sparse_dist with the lookup of batch i+1 on the {role} stream "
                                     "role, fenced on backward(i).").validate()


FUSED_LOOKUP_ON_DIST = _fused_with_lookup_on("dist", "fused_sparse_dist_lookup_on_dist")
FUSED_LOOKUP_ON_OWN_STREAM = _fused_with_lookup_on("lookup", "fused_sparse_dist_lookup_on_own_stream")

VARIANTS = {
    "prefetch": (PREFETCH_WAIT_BEFORE_FORWARD, PREFETCH_EARLY_SPLITS),
    "fused_sparse_dist": (FUSED_LOOKUP_ON_DIST, FUSED_LOOKUP_ON_OWN_STREAM),
}
