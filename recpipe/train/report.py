"""``recpipe report RUN_DIR``: PNG plots of a run from the TensorBoard scalars it wrote.

Reads the newest TensorBoard run of ``RUN_DIR`` (``RUN_DIR`` itself or its newest
``rerun_<n>``, :func:`recpipe.train.run_dir.tensorboard_runs`) with TensorBoard's
``EventAccumulator``, which also drops what a resumed run logged again (``purge_step``), and
draws each figure whose scalars are there against the step: the training loss, the eval AUC
and NE, samples/s, and memory: each rank's (``memory/rank<r>/<name>``, one line a rank, the title
naming the rank that peaked), or rank 0's alone for a run that recorded no per-rank figures.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from recpipe.errors import ConfigError
from recpipe.train.run_dir import EVENT_FILES, tensorboard_runs

# rank 0's memory figures; every rank's are memory/rank<r>/<name> (name: the part after "memory/")
MEMORY = ("memory/max_allocated_gib", "memory/max_reserved_gib", "memory/peak_rss_gib")
_RANK_TAG = re.compile(r"memory/rank(\d+)/(\w+)")

# file name -> (title, y label, the scalar tags drawn in it)
FIGURES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "loss.png": ("training loss", "loss (mean of each log interval)", ("train/loss",)),
    "eval.png": ("evaluation", "AUC / NE", ("eval/auc", "eval/ne")),
    "throughput.png": ("throughput", "samples/s", ("throughput/samples_per_s", "eval/samples_per_s")),
    "memory.png": ("memory", "GiB", MEMORY),
}


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the newest TensorBoard run in ``run_dir``: ``{tag: [(step, value), ...]}``."""
    # TensorBoard and matplotlib (below): imported by the functions that read and draw, which
    # only `recpipe report` runs
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not run_dir.is_dir():
        raise ConfigError(f"recpipe report: {str(run_dir)!r} is not a directory (give a run's logging.run_dir)")
    used = [d for d in tensorboard_runs(run_dir) if any(d.glob(EVENT_FILES))]
    if not used:
        raise ConfigError(f"recpipe report: {str(run_dir)!r} holds no TensorBoard events ({EVENT_FILES}); "
                          "was the run trained with logging.tensorboard: false?")
    events = EventAccumulator(str(used[-1]), size_guidance={"scalars": 0}).Reload()  # 0: keep every point
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def memory_per_rank(scalars: dict[str, list[tuple[int, float]]]) -> dict[str, dict[int, list[tuple[int, float]]]]:
    """The per-rank memory series of ``scalars``: ``{name: {rank: [(step, value), ...]}}``, ranks in order."""
    found: dict[str, dict[int, list[tuple[int, float]]]] = {}
    for tag, points in scalars.items():
        if (m := _RANK_TAG.fullmatch(tag)) and points:
            found.setdefault(m[2], {})[int(m[1])] = points
    return {name: dict(sorted(ranks.items())) for name, ranks in sorted(found.items())}


def memory_peaks(per_rank: dict[str, dict[int, list[tuple[int, float]]]]) -> dict[str, tuple[int, float]]:
    """``{name: (rank, value)}``: for each memory figure, the rank that reached the highest value, and it."""
    return {name: max(((rank, max(v for _, v in points)) for rank, points in ranks.items()), key=lambda rv: rv[1])
            for name, ranks in per_rank.items()}


def _series(name: str, tags: tuple[str, ...], scalars: dict) -> tuple[str, str, list[tuple[str, list, dict]]]:
    """Who a figure's lines are of, a note for its title, and the lines ``(label, points, plot
    style)``: memory.png draws every rank's figures when the run recorded them (a colour a rank,
    a line style a figure), else rank 0's."""
    per_rank = memory_per_rank(scalars) if name == "memory.png" else {}
    if not per_rank:
        whose = ", rank 0" if name == "memory.png" else ""
        return whose, "", [(tag, scalars[tag], {}) for tag in tags if scalars.get(tag)]
    styles = ("-", "--", ":")
    lines = [(f"rank {rank} {figure}", points, {"linestyle": styles[i % len(styles)], "color": f"C{rank % 10}"})
             for i, (figure, ranks) in enumerate(per_rank.items()) for rank, points in ranks.items()]
    peaks = ", ".join(f"{figure} rank {rank} ({value:.2f} GiB)" for figure, (rank, value) in memory_peaks(per_rank).items())
    return " per rank", f"peak: {peaks}", lines


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """The PNGs of :data:`FIGURES` that have data, written to ``out_dir`` (default ``run_dir``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    scalars = read_scalars(Path(run_dir))
    out = Path(out_dir) if out_dir is not None else Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (title, ylabel, tags) in FIGURES.items():
        whose, note, lines = _series(name, tags, scalars)
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, points, style in lines:
            steps, values = zip(*points)
            ax.plot(steps, values, **style, marker="." if len(steps) < 50 else None, label=label)
        ax.set(xlabel="step", ylabel=ylabel, title=f"{title}{whose}: {run_dir}" + (f"\n{note}" if note else ""))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)
    return written


def main_report(args: argparse.Namespace) -> int:
    for path in write_report(args.run_dir, args.out):
        print(path)
    return 0
