"""Example trainer script: extend a recpipe pipeline through its hooks, train it with
recpipe's trainer.

``ClippedSparseDist`` subclasses ``SparseDistPipeline`` to clip the dense gradient norm
after every backward and to count steps and samples; recpipe trains it with the
configured options and speed features, evaluation, checkpoints, preemption, TensorBoard
and the non-finite check, on ``distributed.nproc`` processes or under torchrun:

    .venv/bin/python scripts/custom_pipeline.py --config configs/quickstart.yaml --set train.steps=20

or, without this script's ``main``, from any YAML (the class is imported by name in
every rank):

    recpipe train --config configs/quickstart.yaml --set pipeline.name=sparse_dist \\
        --set pipeline.class=scripts.custom_pipeline:ClippedSparseDist

The hooks are the whole extension surface (see recpipe.runtime.engine.Pipeline):
``on_batch_fetched(host_batch)``, ``before_forward(batch)``,
``after_backward(batch, loss)`` and ``after_optimizer_step(batch)``; ``self.context``
is what they may use of the engine (recpipe.runtime.context.StepContext).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from recpipe.config import load_config
from recpipe.pipelines import SparseDistPipeline
from recpipe.runtime.steps import dense_params
from recpipe.train import train


class ClippedSparseDist(SparseDistPipeline):
    """sparse_dist with dense gradient-norm clipping and counters; rank 0 reports every
    ``report_every`` steps."""

    max_grad_norm = 1.0
    report_every = 10

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.samples = 0
        self.steps = 0
        self.grad_norms: list[torch.Tensor] = []

    def on_batch_fetched(self, batch) -> None:
        self.samples += batch.batch_size  # host batch (fetched ahead of its step): no device sync

    def after_backward(self, batch, loss) -> None:
        # A device tensor: read at the report, not a host sync per step.
        self.grad_norms.append(torch.nn.utils.clip_grad_norm_(dense_params(self.context.optimizer), self.max_grad_norm))

    def after_optimizer_step(self, batch) -> None:
        self.steps += 1
        if self.steps % self.report_every == 0 and dist.get_rank() == 0:
            norms = torch.stack(self.grad_norms).cpu()  # host sync, once a report
            self.grad_norms.clear()
            print(f"ClippedSparseDist: {self.steps} steps, {self.samples} samples fetched on rank 0 (batches are "
                  f"fetched ahead of their step); dense grad norm "
                  f"before clipping: median {norms.median().item():.3f}, max {norms.max().item():.3f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    cfg = load_config(args.config, [*args.overrides, "pipeline.name=sparse_dist"])
    return train(cfg, pipeline_class=ClippedSparseDist)


if __name__ == "__main__":  # the ranks import this module by name: only the script runs main()
    sys.exit(main())
