"""logging.run_dir reused: a resumed run continues its TensorBoard run (TensorBoard's purge
step hides what the stopped process logged after its checkpoint), a fresh run starts a new
TensorBoard run beside the old one; never two event files over the same steps of one run.
And without a terminal, one line per log point."""

from __future__ import annotations

import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from recpipe.cli import main
from recpipe.config import load_config
from recpipe.train.run_dir import RunDir, tensorboard_dir

CONFIG = Path(__file__).parent.parent / "configs" / "quickstart.yaml"


def _log(run: Path, steps: range, value: float, resumed_from: int = 0) -> str | None:
    """One process of a run that logs ``value`` at ``steps``; returns what it says. It starts in
    a second of its own, as a process that resumes a run does: TensorBoard reads a directory's
    event files in the order of their names, ``events.out.tfevents.<second>.<host>.<pid>.<n>``,
    where ``n`` counts the writers of this process; two in one second sort by it as text, and
    ``.10`` comes before ``.9``."""
    second = int(time.time())
    while int(time.time()) == second:
        time.sleep(0.05)
    run_dir = RunDir(load_config(CONFIG, [f"logging.run_dir={run}"]), rank=0, resumed_from=resumed_from)
    for step in steps:
        run_dir.scalars(step, {"train/loss": value})
    run_dir.close()
    return run_dir.note


def _scalars(directory: Path) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in EventAccumulator(str(directory)).Reload().Scalars("train/loss")]


def test_a_resumed_run_continues_its_tensorboard_run_and_a_fresh_one_starts_its_own(tmp_path):
    run = tmp_path / "run"
    assert _log(run, range(1, 8), 1.0) is None  # logged up to 7, its last checkpoint at 4
    assert _log(run, range(5, 11), 2.0, resumed_from=4) is None
    assert len(list(run.glob("events.out.tfevents.*"))) == 2
    assert _scalars(run) == [(s, 1.0) for s in range(1, 5)] + [(s, 2.0) for s in range(5, 11)]  # 5-7 once

    note = _log(run, range(1, 4), 3.0)  # a fresh run into the same directory
    assert note == (f"logging.run_dir={str(run)!r} holds the TensorBoard events of an earlier run; this run's go to "
                    f"{run / 'rerun_1'} (a TensorBoard run of its own)")
    assert _scalars(run / "rerun_1") == [(s, 3.0) for s in range(1, 4)]
    assert _log(run, range(3, 5), 4.0, resumed_from=2) is None  # resumes the newest: rerun_1
    assert _scalars(run / "rerun_1") == [(1, 3.0), (2, 3.0), (3, 4.0), (4, 4.0)]
    assert "rerun_2" in _log(run, range(1, 2), 5.0)
    assert _scalars(run) == [(s, 1.0) for s in range(1, 5)] + [(s, 2.0) for s in range(5, 11)]  # untouched


def test_tensorboard_dir_of_an_empty_run_dir(tmp_path):
    assert tensorboard_dir(tmp_path, 0) == (tmp_path, None, None)
    assert tensorboard_dir(tmp_path, 12) == (tmp_path, 13, None)


def test_without_a_terminal_every_log_point_is_one_line(tmp_path, capfd):
    sets = ["model.num_embeddings_per_feature=[100, 200]", "model.embedding_dim=8", "model.dense_arch_layer_sizes=[8]",
            "model.over_arch_layer_sizes=[8, 1]", "sharding.tables={}", "data.batch_size=32", "distributed.nproc=1",
            "data.synthetic.num_eval_batches=1", "train.steps=6", "train.log_every=2", "train.eval_every=0",
            f"logging.run_dir={tmp_path}"]
    assert main(["train", "--config", str(CONFIG), *[a for s in sets for a in ("--set", s)]]) == 0
    lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("step ") and "/6  " in line]
    assert [line.split()[1] for line in lines] == ["2/6", "4/6", "6/6"], lines
    for line in lines:  # step, loss, samples/s, memory
        assert " loss 0." in line and " samples/s  peak RSS " in line and line.endswith(" GiB"), line
