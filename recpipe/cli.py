"""The ``recpipe`` command line: train, plan, schedule, bench, data, configs, report, checkpoint, export.

Each subcommand lives with its component (``recpipe.train.cli``,
``recpipe.plan_cli``, ``recpipe.pipelines.registry``, ``recpipe.data.cli``,
``recpipe.checkpoint.integrity``, ``recpipe.export``); this file only parses. A user error (a bad config,
bad data, a directory in use, ...) prints one line and exits with its code
(``recpipe.exit_codes``); ``--debug`` adds the traceback. Parsing imports nothing heavy:
``--version``, ``--help``, ``schedule`` and ``plan`` load neither torchrec nor FBGEMM
(tests/test_cli.py checks it).
"""

from __future__ import annotations

import argparse
import signal
import sys

# Only what main() needs before it installs the signal handlers: a SIGTERM or Ctrl-C in the
# command's first moments ends it with one line and 128 + signal (tests/test_signals.py sends
# one 0.3 s after start). Every other module is imported after, where it is used.
from recpipe import exit_codes as codes, shipped_configs
from recpipe.errors import StopRequested, exit_code_of, report
from recpipe.help_format import HelpFormatter, add_command
from recpipe.stop_requests import SIGNALS, defer_requests, install_signal_handlers

# The commands that load torchrec and FBGEMM: the installed fbgemm-gpu build is checked first.
NEEDS_FBGEMM = ("train", "bench", "export")

# recpipe export --tables: recpipe.serving.export_program's tables.
PROGRAM_TABLES = ("fp32", "fp16", "int8", "int4")

DESCRIPTION = (
    "recpipe: train sharded recommendation models (TorchRec modules, FBGEMM embeddings) with pipelines "
    "that are schedule tables; plan their memory, print their schedules and benchmark them beside TorchRec's."
)


def version() -> str:
    """recpipe's version (installed package metadata, else ``recpipe.__version__``) and its stack's."""
    from importlib import metadata

    import recpipe

    def installed(*names: str) -> str | None:
        for name in names:
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                continue
        return None

    ours = installed("recpipe") or recpipe.__version__
    stack = [(label, installed(*names)) for label, names in (
        ("torch", ("torch",)),
        ("torchrec", ("torchrec", "torchrec-nightly")),
        ("fbgemm-gpu", ("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-nightly", "fbgemm-gpu-genai")),
    )]
    found = ", ".join(f"{label} {v}" for label, v in stack if v)
    return f"recpipe {ours}" + (f" ({found})" if found else "")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, type=shipped_configs.resolve,
                   help="YAML config file, or the name of a shipped config (`recpipe configs` lists them), e.g. "
                        "quickstart")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any YAML key, e.g. --set train.steps=50; the value is read as YAML (repeatable)",
    )


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """``recpipe bench``'s flags after ``--config`` / ``--set`` (the studies in benchmarks/studies/ add theirs)."""
    p.add_argument("--pipelines", default=None,
                   help="comma-separated pipeline names (default: all five); a variant with its own pipeline options: "
                        "name:key=value+key=value, e.g. semi_sync:output_dist_wait=early or "
                        "sparse_dist:cuda_graphs=true+cuda_graphs.optimizer=false (recpipe only); a key that starts "
                        "with a config section sets that key (not data.*) for that run, e.g. "
                        "sparse_dist:sharding.default.weights_precision=fp16 (TorchRec's pipelines too)")
    p.add_argument("--with-torchrec", action="store_true",
                   help="also run TorchRec's counterpart of each (and TrainPipelinePT2 when pipeline.compile is on); "
                        "default: off")
    p.add_argument("--steps", type=int, default=100, help="timed steps per run (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before timing (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every run R times, interleaved; P50/P90 over all rounds, paired ratios per round "
                        "(default: %(default)s)")
    p.add_argument("--trace-steps", type=int, default=5,
                   help="profile N more steps after the timed ones: GPU busy time, GPU time by kernel class, host "
                        "time by phase, host syncs, cache work; 0 = off (default: %(default)s)")
    p.add_argument("--profile", action="store_true",
                   help="also print GPU time by kernel class and write the traced steps' op tables to "
                        "OUT/profile.txt (default: off)")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG plots (default: plots on)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip each recpipe row's check: the same run again with the host waiting for the device after "
                        "every step, whose every step's loss must equal the row's (default: check on; a row that "
                        "differs is marked and left out of the comparisons)")
    p.add_argument("--out", default=None, help="directory for bench.json and bench.md (default: logging.run_dir)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="recpipe",
        description=DESCRIPTION,
        epilog="Run 'recpipe COMMAND --help' for a command's options. Exit codes: "
        f"{codes.EXIT_OK} done, {codes.EXIT_WORKER_FAILED} a rank failed, {codes.EXIT_BAD_CONFIG} bad config or "
        f"arguments, {codes.EXIT_DOES_NOT_FIT} the memory plan does not fit, {codes.EXIT_NONFINITE_LOSS} non-finite "
        f"loss, {codes.EXIT_BAD_DATA} bad data, {codes.EXIT_CHECKPOINT} checkpoint damaged, or a directory or --out not "
        f"writable, "
        f"{codes.EXIT_DIR_IN_USE} directory in use by another run, {codes.EXIT_STALLED} a rank made no step within "
        f"train.step_timeout_s, {codes.EXIT_LAUNCHER_FAILED} the launcher lost the process that forks its ranks, "
        "128 + N stopped by signal N "
        f"({codes.EXIT_PREEMPTED} SIGTERM, {codes.EXIT_INTERRUPTED} SIGINT, {codes.EXIT_HANGUP} SIGHUP).",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=version(), help="print the versions and exit")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="print the traceback of user errors too")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = add_command(
        sub,
        "train",
        parents=[common],
        help="train the configured model (starts distributed.nproc processes)",
        description="Train the configured model: distributed.nproc processes on this machine, or one rank "
        "under torchrun. Prints the placement of the tables (on GPUs also the memory plan's per-rank summary, "
        "refusing with exit 3 a plan that does not fit), the eval metrics at every evaluation and the final eval "
        "AUC; writes TensorBoard scalars and summary.json to logging.run_dir. SIGTERM / SIGINT / SIGHUP "
        "stop every rank at a step boundary (an evaluation within train.stop_grace_s), after a checkpoint (exit "
        "143 / 130 / 129); a second signal, a second or more later, stops at once. Exit codes: "
        "docs/fault_tolerance.md.",
    )
    _add_config_args(train)

    plan = add_command(
        sub,
        "plan",
        parents=[common],
        help="estimate per-shard and per-rank memory (no GPU needed)",
        description="Estimate the memory of every shard and every rank for the config's sharding and pipeline, "
        "without a GPU or a process group. Exits with 3, naming the rank and what to change, when a rank "
        "does not fit.",
    )
    _add_config_args(plan)
    plan.add_argument("--format", choices=("table", "json"), default="table",
                      help="table: per-shard and per-rank tables; json: the whole plan as JSON")
    plan.add_argument(
        "--scaling",
        default=None,
        metavar="W1,W2,...",
        help="predict per-rank all-to-all volume and the step's hardware bound at these GPU counts (weak scaling)",
    )

    schedule = add_command(
        sub,
        "schedule",
        parents=[common],
        help="print a pipeline's schedule table",
        description="Print a pipeline's schedule: which step of which batch runs on which stream, and what it "
        "waits for.",
    )
    schedule.add_argument("name", help="a pipeline's name, or 'all' for every registered pipeline")

    bench = add_command(
        sub,
        "bench",
        parents=[common],
        help="time every pipeline on the same batches (recpipe's and TorchRec's)",
        description="Time recpipe's pipelines (and, with --with-torchrec, TorchRec's counterparts) on the same "
        "model, sharding and pre-generated batches, in interleaved rounds. Reports P50/P90 step time, "
        "samples/s, GPU busy time (by kernel class), host time and memory as OUT/bench.md, bench.json and PNG "
        "plots; what each number means: docs/benchmarking.md.",
    )
    _add_config_args(bench)
    add_bench_arguments(bench)

    from recpipe.data.cli import add_data_parser

    add_data_parser(sub, _add_config_args, parents=[common])

    add_command(sub, "configs", help="list the shipped configs (--config takes them by name)",
                description="List the configs that ship with recpipe, each with what it is for; --config takes "
                "them by name (e.g. --config quickstart) where the working directory holds no such file.")

    report = add_command(
        sub, "report", parents=[common], help="plot a run: loss, eval AUC / NE, samples/s, memory (PNGs)",
        description="Write PNG plots of a training run from the TensorBoard scalars in its logging.run_dir, against "
        "the step: loss.png (training loss), eval.png (eval AUC and NE), throughput.png (samples/s) and "
        "memory.png (rank 0's memory), each where the run recorded its scalars. Prints the files written.")
    report.add_argument("run_dir", help="a run's logging.run_dir (its newest TensorBoard run is plotted)")
    report.add_argument("--out", default=None, help="directory for the PNGs (default: the run directory)")

    torchrun = add_command(
        sub, "torchrun", add_help=False,
        help="torchrun, ending on a signal or a failed rank with one line and an exit code (no traceback)",
        description="torchrun (torch.distributed.run) with its own arguments, e.g. recpipe torchrun --standalone "
        "--nproc-per-node 2 -m recpipe train --config quickstart. torchrun's agent raises a traceback when it is "
        "signalled (SignalException) or a rank fails (ChildFailedError); this says it in one line and exits "
        "128 + signal, or the first failed rank's exit code (docs/fault_tolerance.md).")
    torchrun.add_argument("torchrun_args", nargs=argparse.REMAINDER, help="torchrun's arguments (recpipe torchrun "
                          "--help: torchrun's help)")

    checkpoint = add_command(
        sub,
        "checkpoint",
        parents=[common],
        help="check checkpoints; convert them to and from TorchRec's",
        description="Check a checkpoint directory by hand, or convert a checkpoint between TorchRec's layout and "
        "recpipe's (docs/fault_tolerance.md).",
    )
    checkpoint_sub = checkpoint.add_subparsers(dest="action", required=True, metavar="ACTION")
    # --debug after the action too; not given there, it leaves the one given before alone
    action_common = argparse.ArgumentParser(add_help=False)
    action_common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                               help="print the traceback of user errors too")
    verify = add_command(checkpoint_sub, "verify", parents=[action_common], help="every file's size and checksum",
                         description="Check every checkpoint in a directory: every file's size and CRC-32 against "
                         "metadata.json, and that DCP's metadata reads as data.")
    verify.add_argument("dir", help="a checkpoint.dir, or one step_* checkpoint in it")
    convert = add_command(
        checkpoint_sub, "convert", parents=[action_common], help="a TorchRec DCP checkpoint to recpipe's, or back",
        description="Convert a torch.distributed.checkpoint of TorchRec's DistributedModelParallel ({'model': "
        "dmp.state_dict(), 'optimizer': optimizer.state_dict()} of a KeyedOptimizer) into a recpipe checkpoint that "
        "`recpipe train` resumes, or a recpipe checkpoint into one TorchRec loads. Weights and optimizer states are "
        "copied bit for bit; needs no model and no process group.")
    direction = convert.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from", dest="from_format", choices=("torchrec",),
                           help="SRC is TorchRec's DCP directory; DST a checkpoint.dir that gets step_N/")
    direction.add_argument("--to", dest="to_format", choices=("torchrec",),
                           help="SRC is a recpipe checkpoint (or a checkpoint.dir: its newest), verified first; DST a "
                                "new directory for TorchRec's dcp.load")
    convert.add_argument("--step", type=int, default=None,
                         help="--from torchrec: the step the converted checkpoint is at, where training and the "
                              "learning-rate schedule continue (default: 0); the data starts at its first batch")
    convert.add_argument("src", metavar="SRC", help="the checkpoint to convert")
    convert.add_argument("dst", metavar="DST", help="where to write the converted checkpoint")

    export = add_command(
        sub, "export", parents=[common],
        help="a sharded checkpoint -> one unsharded state_dict file (for serving, plain PyTorch)",
        description="Write the model state of a checkpoint as one unsharded state_dict (torch.save), loadable with "
        "model.load_state_dict(torch.load(FILE, weights_only=True)) into the config's model built on CPU "
        "(docs/export.md). Reads table by table; needs no GPU and no process group.",
    )
    _add_config_args(export)
    export.add_argument("--checkpoint", required=True,
                        help="a checkpoint.dir (its newest complete checkpoint) or one step_* checkpoint in it")
    export.add_argument("--out", required=True, help="the state_dict file to write (replaced atomically)")
    export.add_argument("--fp16-tables", action="store_true",
                        help="store the embedding tables in float16 (default: off, every tensor in the config's "
                             "model's dtype, float32 for the built-in model)")
    export.add_argument("--format", choices=("state_dict", "program"), default="state_dict",
                        help="state_dict: the state dict only; program: also a servable torch.export program of the "
                             "model beside it, FILE with the suffix .pt2, whose inputs are plain tensors (the built-in "
                             "model: dense features, KJT values and lengths; a model.factory model: its serve "
                             "method's) and which loads without recpipe (default: %(default)s)")
    export.add_argument("--tables", choices=PROGRAM_TABLES, default="fp32",
                        help="--format program: the program's tables: fp32, fp16, or TorchRec's quantized int8 / int4 "
                             "(FBGEMM's inference kernels; load after `import fbgemm_gpu`) (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    # First, before anything heavy is imported: from here on a SIGTERM, SIGINT or SIGHUP ends the
    # command with one line and 128 + signal, or stops training at a step boundary.
    words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
    command = " ".join(words[:2]) if words[:1] == ["data"] else words[0] if words else ""
    install_signal_handlers(command)
    try:
        return _run(argv)
    except StopRequested as stop:
        return report(command, stop)
    finally:
        defer_requests()  # the command is over: a later signal is recorded, and forgotten by the next run
        if argv is None:
            # This process is the command, and it is ending: its outcome is decided. At
            # interpreter shutdown Python restores the default handlers (a signal would then
            # kill it with 128 + signal after it succeeded); ignored ones it leaves alone.
            for sig in SIGNALS:
                signal.signal(sig, signal.SIG_IGN)


def _run(argv: list[str] | None) -> int:
    # A command's module is imported when the command runs, after the signal handlers (see the
    # imports at the top): --version, --help, plan and schedule load neither torch nor torchrec,
    # and --version nothing it does not use.
    raw = sys.argv[1:] if argv is None else argv
    if raw[:1] == ["torchrun"]:  # every argument is torchrun's (--help included)
        from recpipe.torchrun import main_torchrun

        return main_torchrun(raw[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command in NEEDS_FBGEMM:
            from recpipe.fbgemm_build import check_fbgemm_build

            check_fbgemm_build()
        if args.command == "train":
            from recpipe.launch_preload import start_server, under_torchrun

            if not under_torchrun():
                start_server()  # its imports for the ranks run while this process imports for its checks
            from recpipe.train.cli import main_train

            return main_train(args)
        if args.command == "plan":
            from recpipe.plan_cli import main_plan

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
        if args.command == "configs":
            print(shipped_configs.listing())
            return codes.EXIT_OK
        if args.command == "report":
            from recpipe.train.report import main_report

            return main_report(args)
        if args.command == "checkpoint" and args.action == "convert":
            from recpipe.checkpoint.convert import main_convert

            return main_convert(args)
        if args.command == "checkpoint":
            from recpipe.checkpoint.integrity import main_checkpoint

            return main_checkpoint(args)
        if args.command == "export":
            from recpipe.export import main_export

            return main_export(args)
    except Exception as err:
        if exit_code_of(err) is None:
            raise  # a bug: keep the traceback
        name = f"data {args.data_command}" if args.command == "data" else args.command
        return report(name, err, debug=args.debug)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
