"""``train.accumulate_steps`` on CUDA: N micro-batches per optimizer step train as one batch of
N x ``data.batch_size`` (tests/test_accumulation.py on CPU says what equals it), through every
synchronous pipeline whose steps act on one batch, and with the dense modules compiled
(``pipeline.compile``: against the large batch through the same compiled modules).
(``pipeline.cuda_graphs`` is refused with accumulation: through the captured dense part the
losses differ from the large batch's beyond float rounding; docs/pipelines.md.)

Tolerance: cuBLAS picks its kernels by the GEMMs' shapes, so the large batch's GEMMs sum in
another order than the micro-batches'; float32 rounding, a few ulps of the 0.1-sized updates."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipeline_harness import RunResult, small_config, train
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from test_accumulation import N, SGD, accumulated, all_data_parallel, compare, concat, micro_batches

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU CI: every test skips cleanly
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

RTOL, ATOL = 1e-4, 1e-5
PIPELINES = ("base", "sparse_dist", "fused_sparse_dist")


def _close(reference: RunResult, got: RunResult, what: str) -> None:
    for x, y in zip(reference.losses, got.losses, strict=True):
        torch.testing.assert_close(x, y, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}, loss: {m}")
    for key in reference.state:
        torch.testing.assert_close(reference.state[key], got.state[key], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what}, {key}: {m}")


def _worker(cfg) -> None:
    device = init_process_group(cfg)
    rank, ranks = dist.get_rank(), dist.get_world_size()
    # every table data_parallel (the whole model steps once per N micro-batches), and fused
    # tables whose rows no two micro-batches of a step share (each row gets one update)
    for case, c, disjoint in (("data_parallel", all_data_parallel(cfg), False), ("fused", cfg, True)):
        large = c.model_copy(update={"data": c.data.model_copy(update={"batch_size": N * c.data.batch_size})})
        micro = micro_batches(c, rank, disjoint)
        reference = train(large, "base", [concat(micro[i:i + N]) for i in range(0, len(micro), N)], device=device)
        plain = train(c, "base", micro, device=device)
        for name in PIPELINES:
            what = f"{name}, {case} tables, {ranks} rank(s)"
            got = accumulated(c, name, micro, device=device)
            assert compare(plain, got, ("dense_arch", "over_arch")) > 100 * ATOL, f"{what}: one step per micro-batch"
            _close(reference, got, what)
            if rank == 0 and name == "sparse_dist":
                print(f"{what}: max |model - large batch| {compare(reference, got, ('',)):.3g}")


@pytest.mark.parametrize("nproc", [1, 2])
def test_accumulated_micro_batches_train_as_one_large_batch_on_cuda(nproc):
    launch_local(_worker, nproc, small_config(nproc, ["train.device=cuda", *SGD]))


def _compiled_worker(cfg) -> None:
    device = init_process_group(cfg)
    rank = dist.get_rank()
    c = all_data_parallel(cfg)
    large = c.model_copy(update={"data": c.data.model_copy(update={"batch_size": N * c.data.batch_size})})
    micro = micro_batches(c, rank, False)
    reference = accumulated(large, "base", [concat(micro[i:i + N]) for i in range(0, len(micro), N)], steps=1,
                            device=device, compiled=True)
    for name in ("base", "sparse_dist"):
        _close(reference, accumulated(c, name, micro, device=device, compiled=True), f"{name}, compiled")


def test_compiled_micro_batches_train_as_one_large_batch_on_cuda():
    launch_local(_compiled_worker, 1, small_config(1, ["train.device=cuda", *SGD]))
