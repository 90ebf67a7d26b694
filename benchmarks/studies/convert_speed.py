"""TSV -> binary conversion speed: rows/s of ``recpipe data convert``, per core and in all.

    python benchmarks/studies/convert_speed.py --config configs/bench/dlrm_criteo.yaml \\
        --workers 2 --repeat 3 runs/tsv/day_0.tsv.gz runs/tsv/day_1.tsv.gz

Converts FILE... ``--repeat`` times, each into a fresh directory (removed after), with
``recpipe.data.convert.convert`` in this process (the interpreter's start and imports are
not timed: a day of Criteo 1TB takes hours, they take seconds) and ``--workers`` processes.
Per run: the wall time, the CPU time of this process and its workers (user + system), rows
per wall second, and rows per CPU-second (what one core converts; on a machine shared with
other jobs the figure to read). Prints every run and the best of each figure.

To time another version of the converter on the same files, run this script from that
version's checkout.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository's packages first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from recpipe.config import load_config  # noqa: E402
from recpipe.data.binary_format import Layout  # noqa: E402
from recpipe.data.convert import convert  # noqa: E402
from recpipe.data.spec import DataSpec  # noqa: E402


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def one_run(layout: Layout, files: list[str], workers: int, work: Path) -> tuple[int, float, float]:
    """(rows, wall seconds, CPU seconds) of one conversion of ``files``."""
    out = Path(tempfile.mkdtemp(dir=work))
    try:
        wall, cpu = time.perf_counter(), _cpu_seconds()
        report = convert(layout, files, out / "data", workers=workers, progress=False)
        return report.rows, time.perf_counter() - wall, _cpu_seconds() - cpu
    finally:
        shutil.rmtree(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the layout and table sizes (model section)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--work-dir", default=None, help="where the datasets are written (default: beside FILE)")
    parser.add_argument("files", nargs="+", metavar="FILE")
    args = parser.parse_args(argv)
    layout = Layout.from_spec(DataSpec.from_config(load_config(args.config, args.overrides)))
    work = Path(args.work_dir or Path(args.files[0]).resolve().parent)
    best_wall = best_cpu = 0.0
    for i in range(args.repeat):
        rows, wall, cpu = one_run(layout, args.files, args.workers, work)
        best_wall, best_cpu = max(best_wall, rows / wall), max(best_cpu, rows / cpu)
        print(f"run {i + 1}: {rows:,} rows in {wall:.2f} s wall, {cpu:.2f} s CPU: {rows / wall:,.0f} rows/s, "
              f"{rows / cpu:,.0f} rows per CPU-second", flush=True)
    print(f"best of {args.repeat}: {best_wall:,.0f} rows/s with {args.workers} worker(s), "
          f"{best_cpu:,.0f} rows per CPU-second")
    return 0


if __name__ == "__main__":
    sys.exit(main())
