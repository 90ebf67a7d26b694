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
        "checkpoint (exit 143 / 130); a second signal stops at once. Exit codes: README, 'When things go wrong'.",
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

    from recpipe.bench.cli import add_bench_parser

    add_bench_parser(sub, _add_config_args, parents=[common])

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
