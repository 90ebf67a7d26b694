"""``recpipe train --config PATH [--set KEY=VALUE ...]``.

The config is loaded and validated here, in the launching process, so a bad config
exits with code 2 before any process starts. Then:

* under torchrun (RANK, WORLD_SIZE, MASTER_ADDR set; any number of machines): this
  process is one rank and trains directly;
* otherwise: ``distributed.nproc`` processes are started on this machine
  (``launch_local``), one rank each, and this process waits for them.
"""

from __future__ import annotations

import argparse
import os
import sys

from torch.multiprocessing.spawn import ProcessException

import torch

from recpipe.exit_codes import EXIT_DOES_NOT_FIT, EXIT_WORKER_FAILED
from recpipe.config import RecpipeConfig, check_device, load_config
from recpipe.data import check_data
from recpipe.distributed import launch_local, torchrun_overrides, under_torchrun
from recpipe.sharding import check_model_config
from recpipe.train.checkpoint import check_checkpoint_config
from recpipe.train.trainer import run_worker



def _check_memory_plan(cfg: RecpipeConfig, world_size: int, on_cuda: bool, verbose: bool) -> int | None:
    """Print the planner's per-rank memory summary; on CUDA, return 3 (and say why)
    when the plan does not fit the GPU, before anything is allocated. On CPU the
    tables live in host memory, so the estimate is printed for information only.
    Every rank evaluates it (a pure function), so under torchrun all refuse together."""
    from recpipe.planner import check_fits, plan_from_config, summary

    plan = plan_from_config(cfg, world_size=world_size)
    if verbose:
        if not on_cuda:
            print("(this run trains on CPU; the plan below is what the config would need on GPUs)")
        print(summary(plan), flush=True)
    problem = check_fits(plan)
    if problem is None or not on_cuda:
        return None
    if verbose:
        print(f"recpipe train: refusing to start, the configuration does not fit in GPU memory:\n{problem}", file=sys.stderr)
    return EXIT_DOES_NOT_FIT


def main_train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, [*args.overrides, *torchrun_overrides()])  # ConfigError -> exit 2
    check_checkpoint_config(cfg.checkpoint)
    cuda = torch.cuda.is_available()
    check_device(cfg, cuda)  # ConfigError -> exit 2
    check_data(cfg)  # missing TSV files: ConfigError -> 2; a damaged binary dataset: BinaryDataError -> 4
    on_cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and cuda)
    # The model's tables (a model.factory model's are known only now, built on meta)
    # against sharding.*: ConfigError -> exit 2, before any process starts.
    check_model_config(cfg, device_type="cuda" if on_cuda else "cpu")
    world_size = cfg.distributed.nproc  # WORLD_SIZE under torchrun (torchrun_overrides)
    first = int(os.environ.get("RANK", "0")) == 0  # under torchrun every rank runs this
    refused = _check_memory_plan(cfg, world_size, on_cuda, verbose=first)
    if refused is not None:
        return refused
    if under_torchrun():
        run_worker(cfg)  # a failure raises, and torchrun reports the rank that failed
        return 0
    try:
        launch_local(run_worker, cfg.distributed.nproc, cfg)
    except ProcessException as err:
        print(f"recpipe train: rank {err.error_index} failed:\n{err}", file=sys.stderr)
        return EXIT_WORKER_FAILED
    return 0
