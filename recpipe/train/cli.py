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
import warnings

from torch.multiprocessing.spawn import ProcessException

from recpipe.config import RecpipeConfig, load_config
from recpipe.distributed import launch_local, under_torchrun
from recpipe.train.checkpoint import check_checkpoint_config
from recpipe.train.trainer import run_worker

EXIT_WORKER_FAILED = 1


def _check_memory_plan(cfg: RecpipeConfig) -> int | None:
    """The memory-planner gate: returns an exit code (3: the plan does not fit) to
    stop before anything is allocated, or None to go on. Not wired to the planner
    yet, so it lets every config through."""
    return None


def main_train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # ConfigError -> exit 2 (recpipe.cli)
    check_checkpoint_config(cfg.checkpoint)
    refused = _check_memory_plan(cfg)
    if refused is not None:
        return refused
    if under_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
        if cfg.distributed.nproc not in (1, world_size):
            warnings.warn(
                f"distributed.nproc={cfg.distributed.nproc} is ignored under torchrun, which started "
                f"WORLD_SIZE={world_size} ranks"
            )
        run_worker(cfg)  # a failure raises, and torchrun reports the rank that failed
        return 0
    try:
        launch_local(run_worker, cfg.distributed.nproc, cfg)
    except ProcessException as err:
        print(f"recpipe train: rank {err.error_index} failed:\n{err}", file=sys.stderr)
        return EXIT_WORKER_FAILED
    return 0
