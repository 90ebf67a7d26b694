"""At full speed, on CUDA: producer processes keeping up and the host steps ahead of the device
(a model whose GPU step, about 12 ms on one H200, is long against its host step), every
pipeline and speed feature trains bit for bit as the same configuration fed by
``data.num_workers: 0`` with the host waiting for the device after every step, over 200 steps
and across a checkpoint resume at step 100 (losses of every step and the final eval metrics).
``host_waits`` proves the host was ahead: it waited for the device after most steps.

A step graph's replay once read its batch's device copy on the compute stream without
handing it over from the memcpy stream, so a later batch's copy reused the memory first;
fed slowly it trained right, at full speed on other batches' data. These runs catch that."""

from __future__ import annotations

import pytest
import torch

from benchmarks.studies.full_speed import config, differences, train, train_resumed

# host_bound: on a host busy with other tests' compiles and producers the host falls behind
# the device, and the runs prove nothing (scripts/gpu_suite.py runs these with the host to themselves)
pytestmark = [pytest.mark.gpu, pytest.mark.host_bound,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BASE = [
    "train.device=cuda", "distributed.backend=nccl",
    "model.num_embeddings_per_feature=[4000,4000,2000,2000,1000,1000,500,500]", "model.embedding_dim=64",
    "model.dense_arch_layer_sizes=[256,64]", "model.over_arch_layer_sizes=[4096,4096,4096,1]",
    "data.source=synthetic", "data.batch_size=4096", "data.synthetic.mean_pooling_factors=1.0",
    "data.synthetic.num_eval_batches=8", "sharding.default={type: table_wise, kernel: fused}", "sharding.tables={}",
    "optimizer.embedding.lr=0.05", "optimizer.dense.lr=0.01", "train.log_every=50", "checkpoint.every=100",
    # ids of these small tables occur over 1024 times in a batch: FBGEMM's backward would add their
    # gradients with atomics, in an order that varies from run to run, fed fast or slowly
    "train.deterministic=true",
]
STEPS, SPLIT = 200, 100
PRODUCERS = ["data.num_workers=4", "data.workers_kind=process"]
CACHED = ["sharding.default={type: table_wise, kernel: fused_uvm_caching, cache_load_factor: 0.2}",
          "sharding.uvm_host_mapped=true"]
CASES = {
    "base": ["pipeline.name=base"],
    "sparse_dist": ["pipeline.name=sparse_dist"],
    "fused_sparse_dist": ["pipeline.name=fused_sparse_dist"],
    "semi_sync": ["pipeline.name=semi_sync"],
    "prefetch": ["pipeline.name=prefetch", *CACHED],
    "sparse_dist+cuda_graphs": ["pipeline.name=sparse_dist", "pipeline.cuda_graphs=true"],
    "base+step_graph": ["pipeline.name=base", "pipeline.step_graph=true"],
    "sparse_dist+step_graph+compile": ["pipeline.name=sparse_dist", "pipeline.step_graph=true",
                                       "pipeline.compile.enabled=true"],
}


# base: its host never got steps_ahead steps ahead of the device (0 waits in 100 steps on one
# H200, where every other case waited after most steps); it must still train exactly
IN_STEP = {"base"}
# sparse_dist on several ranks: torchrec's input dist reads each batch's splits on the host,
# so the host waits for the device inside every step (0 waits in 100 steps on two H200s);
# the step graph's fixed splits take that wait away
IN_STEP_ON_RANKS = {"sparse_dist"}


@pytest.mark.parametrize("case", list(CASES))
def test_full_speed_trains_like_slow_feeding(tmp_path, case):
    _check(tmp_path, 1, CASES[case], ahead=case not in IN_STEP)


@pytest.mark.parametrize("case", ["sparse_dist", "sparse_dist+step_graph+compile"])
@pytest.mark.parametrize("nproc", [2])
def test_full_speed_trains_like_slow_feeding_on_ranks(tmp_path, nproc, case):
    _check(tmp_path, nproc, CASES[case], ahead=case not in IN_STEP_ON_RANKS)


def _check(tmp_path, nproc: int, overrides: list[str], ahead: bool = True) -> None:
    base = [*BASE, f"distributed.nproc={nproc}"]
    slow = train(config(base, tmp_path / "slow", [*overrides, f"train.steps={STEPS}", "data.num_workers=0"]),
                 lockstep=True)
    fast = train_resumed(base, tmp_path / "fast", [*overrides, *PRODUCERS], STEPS, SPLIT)
    assert len(slow.losses) == STEPS and torch.isfinite(slow.losses).all()
    if ahead:
        assert fast.host_waits > (STEPS - SPLIT) // 2, f"the host waited for the device after {fast.host_waits} steps"
    assert differences(fast, slow) == []
