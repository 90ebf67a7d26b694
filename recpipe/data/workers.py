"""``data.num_workers: auto``: how many producers a rank's loader starts.

A rank that trains at R samples/s needs R x (the CPU time to make a sample) cores of
producers (docs/data.md, "Cores a rank's loader needs"). ``auto`` measures the time to
make a batch of the configured source in the rank's own process and sizes the producers
for :data:`TARGET_SAMPLES_PER_S`, within the cores the rank has: its share of the cores
this process may run on (``os.sched_getaffinity``), one of them left to the training loop.
A CPU rank's own math runs on its cores too: it gets half of them at most for producers.

torch-free: the measurement is the loader's (``recpipe.data.loader.resolved_workers``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

# Samples/s a rank's producers are sized for: 1.5 x the fastest step recpipe has published on
# one GPU (the Criteo-sized DLRM bf16 with the step graph + compile:
# benchmarks/results/h200x1/full_speed_criteo.md), so that the loader is not what bounds a
# step that fast.
TARGET_SAMPLES_PER_S = 8_000_000


@dataclass(frozen=True)
class WorkersSizing:
    """What ``auto`` chose and why (said at start, ``Trainer``)."""

    workers: int
    cores: int  # the rank's share of the host's cores
    batch_seconds: float | None  # measured time to make one batch in this process (None: not measured)
    needed: int  # producers for TARGET_SAMPLES_PER_S
    why: str = ""  # a bound on the choice other than the cores, said after the figures

    def line(self, kind: str) -> str:
        made = f"a batch takes {self.batch_seconds * 1e3:.1f} ms to make" if self.batch_seconds is not None else "no batch measured"
        return (f"data.num_workers auto: {self.workers} {kind} ({self.cores} cores for this rank; {made}, "
                f"{self.needed} would keep up with {TARGET_SAMPLES_PER_S / 1e6:.0f}M samples/s{self.why})")


def rank_cores(local_ranks: int) -> int:
    """The cores this rank may use: those of its affinity mask shared by the ranks of its host."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_ranks))


def size_workers(*, cores: int, batch_seconds: float | None, batch_size: int, on_cpu: bool) -> WorkersSizing:
    """Producers for a rank with ``cores`` whose batches of ``batch_size`` take ``batch_seconds``
    to make (None: unknown, as many as the cores allow)."""
    spare = cores // 2 if on_cpu else cores - 1  # the training loop's core; a CPU rank's math
    if batch_seconds is None:
        needed = spare
    else:
        needed = max(1, math.ceil(batch_seconds * TARGET_SAMPLES_PER_S / batch_size))
    return WorkersSizing(workers=max(0, min(spare, needed)), cores=cores, batch_seconds=batch_seconds, needed=needed)


# Producer threads of data.synthetic.device=cuda: each queues its batch's kernels on its own
# stream and waits (GIL released) for the copy to host, so two keep the GPU busy while one
# waits; more only queue more work on the same GPU, beside the training step's.
GPU_PRODUCERS = (2, 4)


def size_gpu_workers(*, cores: int, batch_seconds: float | None, batch_size: int) -> WorkersSizing:
    """Producer threads that make batches of ``batch_size`` on the rank's GPU, one in
    ``batch_seconds`` each (made, copied to host and waited for): the number that keeps up
    with TARGET_SAMPLES_PER_S, within :data:`GPU_PRODUCERS` whatever the cores."""
    low, high = GPU_PRODUCERS
    needed = low if batch_seconds is None else max(1, math.ceil(batch_seconds * TARGET_SAMPLES_PER_S / batch_size))
    why = (f"; {low} to {high} threads on the GPU: each waits for its own stream while another's batch is made, "
           "the cores are not what they use")
    return WorkersSizing(workers=min(high, max(low, needed)), cores=cores, batch_seconds=batch_seconds, needed=needed,
                         why=why)
