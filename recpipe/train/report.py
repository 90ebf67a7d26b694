"""``recpipe report RUN_DIR``: PNG plots of a run from the TensorBoard scalars it wrote.

Reads the newest TensorBoard run of ``RUN_DIR`` (``RUN_DIR`` itself or its newest
``rerun_<n>``, :func:`recpipe.train.run_dir.tensorboard_runs`) with TensorBoard's
``EventAccumulator``, which also drops what a resumed run logged again (``purge_step``), and
draws each figure whose scalars are there against the step: the training loss, the eval AUC
and NE, samples/s, and memory (rank 0's, the rank that records it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from recpipe.errors import ConfigError

# file name -> (title, y label, the scalar tags drawn in it)
FIGURES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "loss.png": ("training loss", "loss (mean of each log interval)", ("train/loss",)),
    "eval.png": ("evaluation", "AUC / NE", ("eval/auc", "eval/ne")),
    "throughput.png": ("throughput", "samples/s", ("throughput/samples_per_s", "eval/samples_per_s")),
    "memory.png": ("memory, rank 0", "GiB",
                   ("memory/max_allocated_gib", "memory/max_reserved_gib", "memory/peak_rss_gib")),
}


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the newest TensorBoard run in ``run_dir``: ``{tag: [(step, value), ...]}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from recpipe.train.run_dir import EVENT_FILES, tensorboard_runs

    if not run_dir.is_dir():
        raise ConfigError(f"recpipe report: {str(run_dir)!r} is not a directory (give a run's logging.run_dir)")
    used = [d for d in tensorboard_runs(run_dir) if any(d.glob(EVENT_FILES))]
    if not used:
        raise ConfigError(f"recpipe report: {str(run_dir)!r} holds no TensorBoard events ({EVENT_FILES}); "
                          "was the run trained with logging.tensorboard: false?")
    events = EventAccumulator(str(used[-1]), size_guidance={"scalars": 0}).Reload()  # 0: keep every point
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


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
        drawn = [tag for tag in tags if scalars.get(tag)]
        if not drawn:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for tag in drawn:
            steps, values = zip(*scalars[tag])
            ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=tag)
        ax.set(xlabel="step", ylabel=ylabel, title=f"{title}: {run_dir}")
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
