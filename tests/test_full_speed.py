"""Training fed by producer processes at full speed equals training fed in the loop, bit for
bit, across a checkpoint resume (CPU, one rank; the GPU twin, with the host ahead of the
device: tests/test_full_speed_gpu.py). And the comparison would see a batch whose memory is
reused while the batch is still in flight: a receiver that recycles two buffers makes it fail."""

from __future__ import annotations

import torch

from benchmarks.studies.full_speed import config, differences, train, train_resumed
from recpipe.data import processes

BASE = [
    "train.device=cpu", "distributed.nproc=1", "distributed.backend=gloo",
    "model.num_embeddings_per_feature=[400,400,300,300,200,200,100,100]", "model.embedding_dim=8",
    "model.dense_arch_layer_sizes=[16,8]", "model.over_arch_layer_sizes=[32,1]",
    "data.source=synthetic", "data.batch_size=128", "data.synthetic.num_eval_batches=4",
    "sharding.default={type: table_wise, kernel: fused}", "sharding.tables={}",
    "optimizer.embedding.lr=0.05", "optimizer.dense.lr=0.05", "pipeline.name=sparse_dist",
    "train.log_every=25", "checkpoint.every=60", "train.deterministic=true",
]
STEPS, SPLIT = 120, 60
PRODUCERS = ["data.num_workers=2", "data.workers_kind=process"]


def test_producer_processes_train_like_batches_made_in_the_loop(tmp_path):
    slow = train(config(BASE, tmp_path / "slow", [f"train.steps={STEPS}", "data.num_workers=0"]), lockstep=True)
    fast = train_resumed(BASE, tmp_path / "fast", PRODUCERS, STEPS, SPLIT)
    assert len(slow.losses) == STEPS and torch.isfinite(slow.losses).all()
    assert differences(fast, slow) == []
    # the runs' train.deterministic ended with them: later code in this process keeps torch's choice
    assert not torch.are_deterministic_algorithms_enabled()


def test_a_batch_reused_in_flight_is_seen(tmp_path, monkeypatch):
    """The control: the receiver copies each batch into one of two buffers in turn, which the
    batches queued and in flight (up to the queue's 2 and the schedule's 3) still view."""
    ring = {}

    def recycled(size: int, pin: bool) -> torch.Tensor:
        turn = ring.setdefault("turn", 0)
        ring["turn"] = 1 - turn
        if ring.get(turn) is None or ring[turn].numel() < size:
            ring[turn] = torch.empty(size, dtype=torch.uint8)
        return ring[turn][:size]

    slow = train(config(BASE, tmp_path / "slow", [f"train.steps={SPLIT}", "data.num_workers=0"]), lockstep=True)
    monkeypatch.setattr(processes._Child, "_buffer", staticmethod(recycled))
    reused = train(config(BASE, tmp_path / "reused", [f"train.steps={SPLIT}", *PRODUCERS]))
    assert differences(reused, slow), "a batch overwritten in flight trained like the original"
