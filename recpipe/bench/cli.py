"""``recpipe bench``'s command line (argparse only, so ``recpipe --help`` stays light);
the command itself is :func:`recpipe.bench.runner.main_bench`."""

from __future__ import annotations

import argparse
from typing import Any, Callable

__all__ = ["TRACE_STEPS", "add_bench_arguments", "add_bench_parser"]

TRACE_STEPS = 5  # default --trace-steps


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """``recpipe bench``'s flags (after ``--config`` / ``--set``); studies add theirs."""
    p.add_argument("--pipelines", default=None,
                   help="comma-separated pipeline names (default: all five); a variant with its own pipeline options: "
                        "name:key=value+key=value, e.g. semi_sync:output_dist_wait=early (recpipe only); a dotted "
                        "key sets any other config key but data.* for that run, e.g. "
                        "sparse_dist:sharding.default.weights_precision=fp16 (TorchRec's pipelines too)")
    p.add_argument("--with-torchrec", action="store_true",
                   help="also run TorchRec's counterpart of each (and TrainPipelinePT2 when pipeline.compile is on); "
                        "default: off")
    p.add_argument("--steps", type=int, default=100, help="timed steps per run (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before timing (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every run R times, interleaved; P50/P90 over all rounds, paired ratios per round "
                        "(default: %(default)s)")
    p.add_argument("--trace-steps", type=int, default=TRACE_STEPS,
                   help="profile N more steps after the timed ones: GPU busy time, GPU time by kernel class, host "
                        "time by phase, host syncs, cache work; 0 = off (default: %(default)s)")
    p.add_argument("--profile", action="store_true",
                   help="also print GPU time by kernel class and write the traced steps' op tables to "
                        "OUT/profile.txt (default: off)")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG plots (default: plots on)")
    p.add_argument("--out", default=None, help="directory for bench.json and bench.md (default: logging.run_dir)")


def add_bench_parser(sub: Any, add_config_args: Callable[[argparse.ArgumentParser], None], **kwargs: Any) -> None:
    bench = sub.add_parser("bench", help="time every pipeline on the same batches (recpipe's and TorchRec's)",
                           description="Time every pipeline on the same batches, recpipe's "
                           "and (--with-torchrec) TorchRec's; what each number means: docs/bench.md.", **kwargs)
    add_config_args(bench)
    add_bench_arguments(bench)
