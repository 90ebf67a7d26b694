"""Example trainer script: extend a recpipe pipeline through its hooks.

Subclasses ``SparseDistPipeline`` to clip the dense gradient norm after every
backward and to count samples and steps, then trains with it on the data, model
and sharding of any recpipe config:

    .venv/bin/python scripts/custom_pipeline.py --config configs/quickstart.yaml --set train.steps=20

The hooks are the whole extension surface (see recpipe.pipelines.engine.Pipeline):
``on_batch_fetched(host_batch)``, ``before_forward(batch)``,
``after_backward(batch, loss)`` and ``after_optimizer_step(batch)``.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.distributed as dist

from recpipe.config import load_config
from recpipe.data import make_dataloader
from recpipe.distributed import init_process_group, launch_local, shutdown_process_group, under_torchrun
from recpipe.models import make_model
from recpipe.pipelines import SparseDistPipeline
from recpipe.pipelines.steps import dense_params
from recpipe.sharding import shard_model


class ClippedSparseDist(SparseDistPipeline):
    """sparse_dist with dense gradient-norm clipping and counters."""

    def __init__(self, *args, max_grad_norm: float = 1.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_grad_norm = max_grad_norm
        self.samples = 0
        self.steps = 0
        self.grad_norms: list[torch.Tensor] = []

    def on_batch_fetched(self, batch) -> None:
        self.samples += batch.batch_size  # host batch: no device sync

    def after_backward(self, batch, loss) -> None:
        # Returns a device tensor; reading it later avoids a host sync per step.
        self.grad_norms.append(torch.nn.utils.clip_grad_norm_(dense_params(self.optimizer), self.max_grad_norm))

    def after_optimizer_step(self, batch) -> None:
        self.steps += 1


def worker(cfg) -> None:
    device = init_process_group(cfg)
    torch.manual_seed(cfg.train.seed)
    sharded = shard_model(make_model(cfg), cfg, device)
    pipe = ClippedSparseDist(sharded.model, sharded.optimizer, device, max_grad_norm=1.0)
    loader = make_dataloader(cfg, rank=dist.get_rank(), world_size=dist.get_world_size(), split="train")
    batches = itertools.islice(iter(loader), cfg.train.steps)
    losses = []
    while True:
        try:
            loss, _logits, _labels, _weights = pipe.progress(batches)
        except StopIteration:
            break
        losses.append(loss)
    if dist.get_rank() == 0:
        norms = torch.stack(pipe.grad_norms).cpu()
        print(
            f"trained {pipe.steps} steps, {pipe.samples} samples on rank 0; "
            f"loss {losses[0].item():.4f} -> {losses[-1].item():.4f}; "
            f"dense grad norm before clipping: median {norms.median().item():.3f}, max {norms.max().item():.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    if cfg.distributed.nproc > 1 and not under_torchrun():
        launch_local(worker, cfg.distributed.nproc, cfg)
    else:  # one process, or one rank under torchrun
        try:
            worker(cfg)
        finally:
            shutdown_process_group()


if __name__ == "__main__":
    main()
