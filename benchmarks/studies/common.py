"""What the studies that run ``recpipe bench`` share: its command line plus theirs, and the
run (the bench's rows, then the study's own measurement on every rank, in one record).

A study's measurement is a :data:`recpipe.bench.runner.Sections`: an object that
``launch_local`` can pickle (a frozen dataclass defined at module level), called on every
rank after the rows, returning its ``bench.json`` sections and its markdown.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the repository's recpipe and benchmarks packages
    sys.path.insert(0, str(ROOT))

from recpipe.cli import add_bench_arguments  # noqa: E402
from recpipe.errors import exit_code_of, report  # noqa: E402

__all__ = ["ROOT", "bench_parser", "run_study", "write_plot"]


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """``--config``, ``--set`` and every ``recpipe bench`` flag; the study adds its own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config (see configs/bench/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any YAML key, e.g. --set train.steps=50 (repeatable)")
    add_bench_arguments(parser)
    return parser


def run_study(name: str, argv: list[str] | None, args: argparse.Namespace, sections: Callable[[], Any],
              default_pipelines: tuple[str, ...] = ()) -> int:
    """``recpipe bench`` with the study's ``sections()`` after the rows (built inside the
    error handling: a bad flag is exit 2 with one line, as for ``recpipe bench``). Without
    ``--pipelines`` the study runs ``default_pipelines`` (none: only its own measurement).
    ``argv``: the study's arguments (None: this process's), for the record's command."""
    from recpipe.bench.runner import main_bench

    try:
        command = " ".join(["python", f"benchmarks/studies/{name}.py", *(sys.argv[1:] if argv is None else argv)])
        return main_bench(args, sections(), default_pipelines, command=command)
    except Exception as err:
        if exit_code_of(err) is None:
            raise  # a bug: keep the traceback
        return report(name, err, debug=False)


def write_plot(path: Path, draw: Callable[[Any, Path], Any]) -> dict[str, Any]:
    """``draw(pyplot, path)`` with matplotlib's Agg backend; ``{"written": [...], "reason": ...}``
    as the bench's ``plots`` section (a plot never fails the study)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        return {"written": [], "reason": f"matplotlib not importable: {err}"}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        draw(plt, path)
        return {"written": [path.name], "reason": ""}
    except Exception as err:  # noqa: BLE001 - the measurements stay
        return {"written": [], "reason": f"plotting failed: {type(err).__name__}: {err}"}
    finally:
        plt.close("all")
