"""``train.deterministic``: the same bits on every run of the same config, whoever feeds it how fast.

Two kernels a recommendation model trains with sum in an order that depends on how the
GPU schedules their thread blocks, so the same steps can round differently from run to
run, more often when other streams' work (the next batches' copies and all-to-alls, which
a pipeline overlaps with the step) shares the GPU:

* FBGEMM's TBE backward splits an id that occurs more than 1024 times in a batch over
  several thread blocks, which add their partial gradients with float atomics
  (``max_segment_length_per_cta`` in its ``embedding_backward_split_template.cu``). Skewed
  ids reach that in large batches (one id per sample in 65536-sample batches of Zipf ids).
  Under ``torch.use_deterministic_algorithms`` it sums each id in one block.
* cuBLAS picks its reduction by the workspace it finds; ``CUBLAS_WORKSPACE_CONFIG`` fixes it
  (``:4096:8``, unless the user set it; read when CUDA starts, so it is set first).

torch's other kernels with a deterministic variant use it, and torch warns once about any
that has none (``warn_only``: the run goes on). Off by default: the deterministic kernels
make a step of the Criteo-sized DLRM markedly longer, graphed or eager, and the runs it
makes reproducible differ from run to run only in the last bits of the sums those atomics
make. Memory that torch allocates without
initializing is not filled (``torch.utils.deterministic.fill_uninitialized_memory`` off):
nothing here reads memory before writing it, and the fill is a kernel per allocation.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

__all__ = ["CUBLAS_ENV", "apply_deterministic", "kept"]

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
_CUBLAS_FIXED = ":4096:8"


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """This process's kernel choice as it was before the block, whatever the block applied (a
    process that runs several trainings, as tests and studies do: a run's
    ``train.deterministic`` must not reach what runs after it)."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.utils.deterministic.fill_uninitialized_memory = saved[2]


def apply_deterministic(enabled: bool) -> None:
    """Make this process's kernels deterministic (``enabled``) or torch's default. Call it
    before CUDA starts (the cuBLAS setting is read then); later it still applies the rest."""
    if enabled and CUBLAS_ENV not in os.environ and not torch.cuda.is_initialized():
        os.environ[CUBLAS_ENV] = _CUBLAS_FIXED
    torch.use_deterministic_algorithms(enabled, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
