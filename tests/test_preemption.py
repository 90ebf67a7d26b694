"""Preemption: SIGTERM to ``recpipe train`` (the launcher, or one rank only, also under
torchrun) stops every rank at a step boundary with a checkpoint, exit 143, nothing
left running, and the resumed run trains bit for bit like one never stopped. While
a run holds its directories, a second run on them is refused."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fault_data import EVAL_STARTED
from process_harness import CONFIG, alive, factory_config, interrupt, overrides, wait_for
from recpipe.checkpoint.integrity import METADATA_FILE
from recpipe.cli import main
from recpipe.exit_codes import EXIT_DIR_IN_USE, EXIT_PREEMPTED
from test_checkpoint import _full_state

M = 5  # steps trained after the resume


def _stopped_at(err: str, run: Path) -> int:
    """The step every rank stopped after, from the one line rank 0 prints."""
    lines = [line for line in err.splitlines() if "stopped by SIGTERM after step" in line]
    assert len(lines) == 1, err[-4000:]  # once for the job, not once per rank
    step = int(re.search(r"after step (\d+)", lines[0])[1])
    assert f"checkpoint {run / 'ckpt' / f'step_{step:08d}'} saved" in lines[0] and f"[exit {EXIT_PREEMPTED}]" in lines[0]
    meta = json.loads((run / "ckpt" / f"step_{step:08d}" / METADATA_FILE).read_text())
    assert meta["step"] == step
    return step


def _train(run: Path, *extra: str) -> int:
    return main(["train", "--config", str(CONFIG), *overrides(run, *extra)])


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_saves_and_resumes_bit_identically(tmp_path, capfd):
    run = tmp_path / "run"

    def second_run_then_sigterm(proc, ranks):
        # A second run on the same directories is refused, naming the holder.
        assert _train(run, "train.steps=8") == EXIT_DIR_IN_USE
        refused = capfd.readouterr().err
        assert f"pid {proc.pid} on host {socket.gethostname()}" in refused and "logging.run_dir" in refused
        proc.send_signal(signal.SIGTERM)

    proc, ranks, err = interrupt(run, second_run_then_sigterm)
    assert proc.returncode == EXIT_PREEMPTED, err[-4000:]
    stopped = _stopped_at(err, run)
    assert stopped >= 4 and "Traceback" not in err
    assert not [pid for pid in ranks.values() if alive(pid)], "a rank outlived the launcher"
    assert json.loads((run / "summary.json").read_text())["status"] == "preempted"

    # Resume (the same command, further) and train the same steps without a stop.
    assert _train(run, f"train.steps={stopped + M}") == 0
    assert f"resumed from {run / 'ckpt' / f'step_{stopped:08d}'}" in capfd.readouterr().out
    straight = tmp_path / "straight"
    assert _train(straight, f"train.steps={stopped + M}", "checkpoint.every=0") == 0
    a = _full_state(run / "ckpt" / f"step_{stopped + M:08d}", tmp_path)
    b = _full_state(straight / "ckpt" / f"step_{stopped + M:08d}", tmp_path)
    assert a.keys() == b.keys() and any(k.endswith("exp_avg_sq") for k in a)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"resumed run differs from the uninterrupted one in {different}"


@pytest.mark.slow
def test_under_torchrun_one_signalled_rank_stops_them_all(tmp_path):
    run = tmp_path / "run"
    # Only rank 1 is told; rank 0 learns it at the next exchange.
    proc, ranks, err = interrupt(run, lambda proc, ranks: os.kill(ranks[1], signal.SIGTERM), torchrun=True)
    _stopped_at(err, run)  # the checkpoint of the stop step: a collective save, so both ranks stopped there
    # The ranks exit with 143. torchrun's summary lists both, unless one rank was still
    # leaving when torchrun saw the other exit (its monitor then sends it SIGTERM).
    codes = re.findall(r"^\s+exitcode\s+: (-?\d+) ", err, re.MULTILINE)
    assert codes and all(int(c) in (EXIT_PREEMPTED, -signal.SIGTERM) for c in codes), err[-3000:]
    assert str(EXIT_PREEMPTED) in codes, err[-3000:]
    assert not [pid for pid in ranks.values() if alive(pid)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpus(2)
def test_sigterm_stops_a_cuda_run_with_a_checkpoint(tmp_path):
    nproc = 2  # NCCL for training, a Gloo group for the agreement
    run = tmp_path / "run"
    on_cuda = ["train.device=cuda", "distributed.backend=auto", f"distributed.nproc={nproc}"]
    proc, ranks, err = interrupt(run, lambda proc, ranks: proc.send_signal(signal.SIGTERM), *on_cuda, nproc=nproc)
    assert proc.returncode == EXIT_PREEMPTED, err[-4000:]
    _stopped_at(err, run)
    assert not [pid for pid in ranks.values() if alive(pid)]


# Runs recpipe.cli.main four times in this one process, each as a one-rank torchrun job
# (RANK, WORLD_SIZE, MASTER_ADDR set: the rank trains in the calling process). Prints
# each run's exit code and the step its stop message names.
SEVERAL_RUNS = """
import os, re, signal, sys, threading, time
from pathlib import Path
from torch.distributed import TCPStore
sys.path.insert(0, {tests!r})
from process_harness import CONFIG, overrides
from recpipe.cli import main

def run(name, *extra, signal_after=None):
    store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True")
    directory = Path({tmp!r}) / name
    if signal_after is not None:  # SIGTERM to this process once training is under way
        def kill():
            while not (directory / "ckpt" / signal_after / "metadata.json").exists():
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=kill, daemon=True).start()
    code = main(["train", "--config", str(CONFIG), *overrides(directory, *extra)])
    print("RUN", name, code, flush=True)

if __name__ == "__main__":
    run("a", "train.steps=3")
    os.kill(os.getpid(), signal.SIGTERM)  # between runs: no run is there to stop
    time.sleep(0.2)
    run("b", "train.steps=3")  # must not stop on it
    run("c", signal_after="step_00000004")  # preempted: checkpoint, 143
    run("d", signal_after="step_00000004")  # its own first SIGTERM, not a "second" one
"""


@pytest.mark.slow
def test_a_run_never_stops_on_a_signal_from_an_earlier_run_in_the_same_process(tmp_path):
    """One process that runs several trainings (a notebook, a sweep script, a pytest
    run) keeps recpipe's signal handlers: a SIGTERM after one run has ended, or
    the one that preempted it, must neither stop the next run at its first step
    (exit 143, "as if preempted", although nobody signalled it) nor turn the next
    run's own first SIGTERM into a "second" one that ends it without a checkpoint."""
    script = tmp_path / "several_runs.py"
    script.write_text(SEVERAL_RUNS.format(tests=str(Path(__file__).parent), tmp=str(tmp_path)))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    codes = dict(re.findall(r"^RUN (\w) (\d+)$", out.stdout, re.MULTILINE))
    assert codes == {"a": "0", "b": "0", "c": str(EXIT_PREEMPTED), "d": str(EXIT_PREEMPTED)}, out.stderr[-4000:]
    assert "second SIGTERM" not in out.stderr, out.stderr[-4000:]
    for name in "cd":  # each stopped at a step boundary after its own signal, with a checkpoint
        _stopped_at_in(out.stderr, tmp_path / name)
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["status"] == "completed"


def _stopped_at_in(err: str, run: Path) -> None:
    lines = [line for line in err.splitlines() if f"checkpoint {run / 'ckpt'}" in line and "stopped by SIGTERM" in line]
    assert len(lines) == 1, err[-4000:]
    step = int(re.search(r"after step (\d+)", lines[0])[1])
    assert step >= 4 and (run / "ckpt" / f"step_{step:08d}" / METADATA_FILE).is_file()


@pytest.mark.slow
def test_a_stop_request_during_an_evaluation_ends_it_within_the_grace(tmp_path):
    """An evaluation that would outlast any grace period (its eval split never ends) and a
    SIGTERM to rank 1 only while it runs: it goes on for train.stop_grace_s, then both
    ranks end it at the same batch (they agree, as at step boundaries), save the last
    trained step and exit 143."""
    run, grace = tmp_path / "run", 2.0
    signalled: list[float] = []

    def sigterm_rank_1_in_the_evaluation(proc, ranks):
        wait_for(run / EVAL_STARTED, proc)
        os.kill(ranks[1], signal.SIGTERM)
        signalled.append(time.monotonic())

    proc, ranks, err = interrupt(run, sigterm_rank_1_in_the_evaluation, "data.factory=fault_data:endless_eval",
                                 "train.eval_every=8", f"train.stop_grace_s={grace:g}", config=factory_config(tmp_path),
                                 timeout=90)
    took = time.monotonic() - signalled[0]
    assert proc.returncode == EXIT_PREEMPTED, err[-4000:]
    assert grace <= took < grace + 30, took
    last = [line for line in err.splitlines() if line.strip()][-1]
    step_8 = run / "ckpt" / "step_00000008"
    assert last == (f"recpipe train: stopped by SIGTERM during the evaluation after step 8 (ended unfinished, "
                    f"train.stop_grace_s={grace:g}): checkpoint {step_8} saved; run the same command again to resume "
                    f"[exit {EXIT_PREEMPTED}]"), err[-4000:]
    assert json.loads((step_8 / METADATA_FILE).read_text())["step"] == 8
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["stopped_by"] == "SIGTERM", summary
    assert not [pid for pid in ranks.values() if alive(pid)]
