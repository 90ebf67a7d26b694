"""``recpipe`` command line: train, plan, schedule, bench, data, checkpoint.

Each subcommand lives with its component (``recpipe.train.cli``,
``recpipe.planner.cli``, ``recpipe.pipelines.schedule``, ``recpipe.data.cli``,
``recpipe.train.integrity``); this file only parses. A user error (a bad config,
bad data, a directory in use, ...) prints one line and exits with its code
(``recpipe.exit_codes``); ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import sys

from recpipe.errors import exit_code_of, report


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML config (see configs/)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any YAML key, e.g. --set train.steps=50 (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recpipe", description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="print the traceback of user errors too")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train",
        parents=[common],
        help="train the configured model (starts distributed.nproc processes)",
        description="Train the configured model. SIGTERM / SIGINT stop every rank at a step boundary, after a "
        "checkpoint (exit 143 / 130); a second signal, a second or more later, stops at once. Exit codes: "
        "docs/fault_tolerance.md.",
    )
    _add_config_args(train)

    plan = sub.add_parser("plan", parents=[common], help="estimate per-shard and per-rank memory (no GPU needed)")
    _add_config_args(plan)
    plan.add_argument("--format", choices=("table", "json"), default="table")
    plan.add_argument(
        "--scaling",
        default=None,
        metavar="W1,W2,...",
        help="predict per-rank all-to-all volume and the step's hardware bound at these GPU counts (weak scaling)",
    )

    schedule = sub.add_parser("schedule", parents=[common], help="print a pipeline's schedule table")
    schedule.add_argument("name", help="base, sparse_dist, fused_sparse_dist, semi_sync or prefetch")

    bench = sub.add_parser(
        "bench", parents=[common], help="time every pipeline on the same batches (recpipe's and TorchRec's)"
    )
    _add_config_args(bench)
    bench.add_argument("--pipelines", default=None,
                       help="comma-separated pipeline names (default: all five); a variant with its own pipeline "
                            "options: name:key=value+key=value, e.g. semi_sync:output_dist_wait=early (recpipe only); "
                            "a dotted key sets any other config key but data.* for that run, e.g. "
                            "sparse_dist:sharding.default.weights_precision=fp16 (TorchRec's pipelines too)")
    bench.add_argument("--with-torchrec", action="store_true", help="also run TorchRec's counterpart of each")
    bench.add_argument("--steps", type=int, default=100, help="timed steps per pipeline")
    bench.add_argument("--warmup", type=int, default=20, help="untimed steps before timing")
    bench.add_argument("--bound", action="store_true", help="also time each stage alone and report the hardware bound")
    bench.add_argument(
        "--multipass", default=None, metavar="P1,P2,...", help="sweep FBGEMM prefetch passes (UVM-caching configs)"
    )
    bench.add_argument("--sweep-cache", default=None, metavar="LF1,LF2,...",
                       help="prefetch vs sparse_dist at these cache load factors of the UVM-cached tables (CUDA)")
    bench.add_argument("--sweep-zipf", default=None, metavar="A1,A2,...",
                       help="... and at these Zipf alphas of the synthetic ids; with a recommendation of the pipeline")
    bench.add_argument("--baseline", default=None, metavar="BENCH_JSON", help="a bench.json from fewer GPUs: weak-scaling columns")
    bench.add_argument("--rounds", type=int, default=1,
                       help="repeat every run R times, interleaved; P50/P90 over all rounds, paired ratios per round")
    bench.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG plots")
    bench.add_argument("--trace-steps", type=int, default=5,
                       help="profile N more steps after the timed ones: GPU busy time, step / GPU busy, host time by "
                            "phase, host syncs by site, cache work (0 = off)")
    bench.add_argument("--profile", action="store_true", help="also write the traced steps' op tables -> OUT/profile.txt")
    bench.add_argument("--out", default=None, help="directory for bench.json and bench.md (default: logging.run_dir)")

    from recpipe.data.cli import add_data_parser

    add_data_parser(sub, _add_config_args, parents=[common])

    checkpoint = sub.add_parser("checkpoint", parents=[common], help="check checkpoints")
    checkpoint.add_argument("action", choices=("verify",), help="verify: every file's size and checksum")
    checkpoint.add_argument("dir", help="a checkpoint.dir, or one step_* checkpoint in it")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            from recpipe.train.cli import main_train

            return main_train(args)
        if args.command == "plan":
            from recpipe.planner.cli import main_plan

            return main_plan(args)
        if args.command == "schedule":
            from recpipe.pipelines import main_schedule

            return main_schedule(args)
        if args.command == "bench":
            from recpipe.bench.runner import main_bench

            return main_bench(args)
        if args.command == "data":
            from recpipe.data.cli import main_data

            return main_data(args)
        if args.command == "checkpoint":
            from recpipe.train.integrity import main_checkpoint

            return main_checkpoint(args)
    except Exception as err:
        if exit_code_of(err) is None:
            raise  # a bug: keep the traceback
        return report(args.command, err, debug=args.debug)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
