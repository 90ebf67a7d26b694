"""What the studies share: their command line, the run of a study beside ``recpipe bench``'s
rows, every rank's GPU name, and how their reports are written (files, plots, MiB).

A study runs as a script (``python benchmarks/studies/X.py``, the command its published report
names) and is imported as ``benchmarks.studies.X`` by the tests; as a script it first puts the
repository root on ``sys.path``, in its own two lines, then imports this module.

A study that measures beside the bench's rows passes a :data:`recpipe.bench.runner.Sections`
to :func:`run_study`: an object that ``launch_local`` can pickle (a frozen dataclass defined at
module level), called on every rank after the rows, returning its ``bench.json`` sections and
its markdown.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from recpipe.cli import add_bench_arguments
from recpipe.errors import exit_code_of, report

__all__ = ["MiB", "ROOT", "bench_parser", "command", "config_parser", "gpu_names", "mib", "run_study", "write_plot",
           "write_report"]

ROOT = Path(__file__).resolve().parents[2]
MiB = float(1 << 20)


def config_parser(doc: str, config_default: str | None = None, config_required: bool = True) -> argparse.ArgumentParser:
    """``--config`` (required unless ``config_default`` or ``config_required=False``) and ``--set``;
    the study adds its own flags."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=config_required and config_default is None, default=config_default,
                        help="YAML config (see configs/bench/)" + (f"; default {config_default}" if config_default
                                                                    else ""))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any YAML key, e.g. --set train.steps=50 (repeatable)")
    return parser


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """``--config``, ``--set`` and every ``recpipe bench`` flag; the study adds its own."""
    parser = config_parser(doc)
    add_bench_arguments(parser)
    return parser


def command(name: str, argv: list[str] | None) -> str:
    """The study's command line for its record: ``python benchmarks/studies/<name>.py`` and its
    arguments (``argv``; None: this process's)."""
    return " ".join(["python", f"benchmarks/studies/{name}.py", *(sys.argv[1:] if argv is None else argv)])


def run_study(name: str, argv: list[str] | None, args: argparse.Namespace, sections: Callable[[], Any],
              default_pipelines: tuple[str, ...] = ()) -> int:
    """``recpipe bench`` with the study's ``sections()`` after the rows (built inside the
    error handling: a bad flag is exit 2 with one line, as for ``recpipe bench``). Without
    ``--pipelines`` the study runs ``default_pipelines`` (none: only its own measurement).
    ``argv``: the study's arguments (None: this process's), for the record's command."""
    from recpipe.bench.runner import main_bench

    try:
        return main_bench(args, sections(), default_pipelines, command=command(name, argv))
    except Exception as err:
        if exit_code_of(err) is None:
            raise  # a bug: keep the traceback
        return report(name, err, debug=False)


def gpu_names(device: torch.device) -> list[str]:
    """Every rank's device name ('cpu' off CUDA), as ``recpipe.bench.report.environment`` takes them (collective)."""
    from recpipe.bench.run import gather

    return gather(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")


def mib(n_bytes: float | None) -> str:
    """Bytes as MiB in a report's table; '-' for None."""
    return "-" if n_bytes is None else f"{n_bytes / MiB:,.1f}"


def write_report(out: Path, stem: str, record: dict[str, Any], lines: list[str]) -> None:
    """``OUT/<stem>.json`` (the record) and ``OUT/<stem>.md`` (the lines), ``out`` created."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")


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
