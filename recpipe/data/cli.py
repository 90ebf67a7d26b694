"""``recpipe data convert | verify | bench``.

* ``convert --config PATH --out DIR [--workers N] [--skip-malformed N] [--hashing H] FILE...``:
  TSV files -> binary dataset (``recpipe.data.convert``); layout and table sizes
  from the config's ``model`` section (and ``data.multi_hot_sizes``); ids hashed by
  recpipe's rule or TorchRec's (``--hashing torchrec``).
* ``verify DIR``: every part converted, every file of its manifest size and
  SHA-256 (``--sizes-only`` skips the checksums).
* ``bench --config PATH``: samples/s of the configured loader (``data.source``,
  ``data.num_workers``, ``data.workers_kind``, ``data.batch_size``) for rank 0 of
  ``distributed.nproc``, on this machine; batches are made and dropped (no model).
  It also prints the CPU this process spent per batch (what a training process
  pays for its loader), the CPU its producer or worker processes spent per batch,
  and both together per sample: the cores a rank's loader needs at a given rate.
  The last line is ``<N> samples/s``.

Exit codes: 0; 2 bad arguments or config; 5 malformed or damaged data
(``recpipe.exit_codes``).
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from typing import Any

from recpipe.config import ConfigError, RecpipeConfig, load_config
from recpipe.data.spec import DataSpec
from recpipe.errors import DataError, report
from recpipe.exit_codes import EXIT_OK
from recpipe.help_format import HelpFormatter, add_command

__all__ = ["add_data_parser", "main_data"]


def add_data_parser(sub: argparse._SubParsersAction, add_config_args, parents: list | None = None) -> None:
    data = add_command(sub, "data", parents=parents or [],
                       help="convert TSV click logs to the binary format; verify it; time the loader",
                       description="Convert Criteo-layout TSV click logs (plain or gzip) into recpipe's binary "
                                   "format once, check a converted dataset, or time the configured loader.")
    cmds = data.add_subparsers(dest="data_command", required=True, metavar="DATA_COMMAND")
    convert = cmds.add_parser("convert", help="TSV files (plain or .gz) -> a binary dataset directory",
                              description="Convert TSV files into a binary dataset directory, one process per "
                                          "file; layout and table sizes come from the config's model section. "
                                          "Re-running the same command resumes an interrupted conversion.",
                              formatter_class=HelpFormatter)
    add_config_args(convert)
    convert.add_argument("--out", required=True, help="dataset directory (created; re-running resumes)")
    convert.add_argument("--workers", type=int, default=None, help="files converted at once (default: one per core)")
    convert.add_argument("--skip-malformed", type=int, default=0, metavar="N",
                         help="skip up to N malformed lines per file, counted and reported (default 0: stop at the first)")
    convert.add_argument("--hashing", choices=("recpipe", "torchrec"), default="recpipe",
                         help="id of hex value v in a table of R rows: recpipe = 1 + v mod (R - 1) (the criteo_tsv "
                              "reader's), torchrec = v mod R (TorchRec's Criteo .npy tooling); an empty field is "
                              "id 0 under both (default: %(default)s)")
    convert.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    convert.add_argument("files", nargs="+", metavar="FILE", help="TSV files, in row order")
    verify = cmds.add_parser("verify", help="check a binary dataset: complete, file sizes, SHA-256 checksums",
                             description="Check a binary dataset: every part converted, every file of its "
                                         "manifest size and SHA-256.",
                             formatter_class=HelpFormatter)
    verify.add_argument("directory", help="a dataset directory written by 'recpipe data convert'")
    verify.add_argument("--sizes-only", action="store_true", help="skip the checksums (fast)")
    bench = cmds.add_parser("bench", help="samples/s of the configured loader on this machine (no GPU needed)",
                            description="Time the configured loader for rank 0 (batches are made and dropped, no "
                                        "model): its sustained samples/s and the CPU this process spends per batch. "
                                        "The batches the producers made ahead while the loader started are not "
                                        "timed; the timed batches' second half gives the rate (its first half's "
                                        "is printed beside it). The last line is '<N> samples/s'.",
                            formatter_class=HelpFormatter)
    add_config_args(bench)
    bench.add_argument("--batches", type=int, default=1000, help="timed batches (across epochs if the data is short)")
    bench.add_argument("--warmup", type=int, default=None,
                       help="untimed batches first (>= 1); default: what the producers hold made ahead, plus 5")


# The commands' modules are imported where they run: every `recpipe` command builds this parser,
# and `recpipe --version`, `plan` and `schedule` load neither numpy nor torch.


def main_data(args: argparse.Namespace) -> int:
    from recpipe.data.binary_format import BinaryDataError

    try:
        if args.data_command == "convert":
            return _convert(args)
        if args.data_command == "verify":
            return _verify(args)
        if args.data_command == "bench":
            return _bench(args)
    except (BinaryDataError, ValueError, FileNotFoundError) as err:
        if isinstance(err, ConfigError):
            raise
        return report(f"data {args.data_command}", DataError(str(err)), debug=args.debug)
    raise AssertionError(f"unhandled data command {args.data_command}")


def _config(args: argparse.Namespace) -> RecpipeConfig:
    cfg = load_config(args.config, args.overrides)
    if cfg.model.factory is not None:
        raise ConfigError(f"model.factory={cfg.model.factory!r}: the binary format needs the built-in model's "
                          "layout (model.num_dense_features, model.num_embeddings_per_feature)")
    return cfg


def _convert(args: argparse.Namespace) -> int:
    from recpipe.data.binary_format import Layout
    from recpipe.data.convert import convert

    cfg = _config(args)
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers={args.workers} must be >= 1")
    if args.skip_malformed < 0:
        raise ConfigError(f"--skip-malformed={args.skip_malformed} must be >= 0")
    missing = [f for f in args.files if not os.path.isfile(f)]
    if missing:
        raise ConfigError(f"input files not found: {missing}")
    report = convert(Layout.from_spec(DataSpec.from_config(cfg)), args.files, args.out, workers=args.workers,
                     skip_malformed=args.skip_malformed, progress=args.progress, hashing=args.hashing)
    print("\n".join(report.lines()))
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    from recpipe.data.binary_format import VERIFIED, BinaryDataError, read_manifest, record_verified, verify_dataset

    problems = verify_dataset(args.directory, checksums=not args.sizes_only)
    if len(problems) == 1:
        raise BinaryDataError(problems[0])
    if problems:  # one line each, as a config's problems (recpipe.errors.report)
        raise BinaryDataError(f"{args.directory}: {len(problems)} problems:\n" + "\n".join(f"  {p}" for p in problems))
    manifest = read_manifest(args.directory)
    what = "sizes" if args.sizes_only else "sizes and SHA-256"
    note = ""
    if not args.sizes_only and not record_verified(manifest):
        note = f"; {VERIFIED} cannot be written there, so `recpipe train` will still say it was never verified"
    print(f"{args.directory}: {manifest.num_rows:,} rows in {len(manifest.sources)} parts, {what} as in the manifest "
          f"(format version {manifest.version}, ids hashed by {manifest.hashing}'s rule){note}")
    return EXIT_OK


def made_ahead(cfg: RecpipeConfig) -> int:
    """Batches the loader can hold made ahead of the consumer: each producer's slots and the one it
    is making, and the ready queue (recpipe.data.processes / stream)."""
    from recpipe.data.processes import READY, SLOTS

    return cfg.data.num_workers * (SLOTS + 1) + READY


def _children_cpu() -> float:
    """CPU seconds of this process's ended and reaped child processes (its producers)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _close(batches: Any) -> None:
    """End an iterator's producers now (a DataLoader's iterator ends its workers when dropped)."""
    close = getattr(batches, "close", None)
    if close is not None:
        close()


def _bench(args: argparse.Namespace) -> int:
    import torch

    from recpipe.data import check_data, make_dataloader
    from recpipe.data.loader import with_sized_workers, workers_description, workers_kind_of

    cfg = _config(args)
    cfg, sizing = with_sized_workers(cfg, rank=0, world_size=cfg.distributed.nproc)
    if sizing is not None:
        print(sizing.line(workers_description(cfg)))
    if args.warmup is None:
        args.warmup = made_ahead(cfg) + 5
    if args.batches < 2 or args.warmup < 1:
        raise ConfigError(f"--batches={args.batches} must be >= 2 and --warmup={args.warmup} >= 1")
    check_data(cfg)
    world, d = cfg.distributed.nproc, cfg.data
    kind = workers_description(cfg)
    print(f"source {d.source}, batch {d.batch_size}, num_workers {d.num_workers} ({kind}), rank 0 of {world}, "
          f"shuffle {d.shuffle}, pinned {d.pin_memory and torch.cuda.is_available()}, "
          f"torch threads {torch.get_num_threads()}")
    epoch, made, timed, started = 0, 0, 0, time.perf_counter()
    first_s = t0 = cpu0 = half = None
    children0 = _children_cpu()
    while timed < args.batches:
        count = 0
        batches = iter(make_dataloader(cfg, rank=0, world_size=world, split="train", epoch=epoch))
        for _ in batches:
            count += 1
            made += 1
            if first_s is None:
                first_s = time.perf_counter() - started
            if made == args.warmup:
                t0, cpu0 = time.perf_counter(), time.process_time()
            elif made > args.warmup:
                timed += 1
                if timed == args.batches // 2:
                    half = time.perf_counter()
                if timed == args.batches:
                    break
        end, cpu1 = time.perf_counter(), time.process_time()
        _close(batches)  # ends and reaps the producer processes: their CPU is counted from here on
        batches = None  # a DataLoader's iterator ends its workers when dropped
        if count == 0:
            raise ConfigError("the configured train split has no batches")
        epoch += 1
    seconds, cpu = end - t0, cpu1 - cpu0
    producers = _children_cpu() - children0
    first_half = (args.batches // 2) * d.batch_size / (half - t0)
    rate = (timed - args.batches // 2) * d.batch_size / (end - half)
    producers_ran = d.num_workers and (d.source == "criteo_tsv" or workers_kind_of(cfg) == "process")
    print(f"first batch after {first_s:.3f} s; {args.warmup} untimed, then {timed} batches in {seconds:.3f} s over "
          f"{epoch} epoch(s)")
    print(f"CPU per batch: this process (the training process's share) {cpu / timed * 1e3:.2f} ms, "
          f"{cpu / seconds:.2f} cores busy; "
          + (f"worker processes {producers / made * 1e3:.2f} ms (over all {made} batches taken, the untimed ones "
             "included)" if producers_ran else "no worker processes"))
    total = cpu / timed + producers / made
    print(f"in all {total / d.batch_size * 1e6:.3f} us of CPU per sample ({d.batch_size / total:.0f} samples per "
          f"CPU-second); first half {first_half:.0f} samples/s, second half (sustained):")
    print(f"{rate:.0f} samples/s")
    return EXIT_OK
