"""No silent hang. A rank that stops making training steps (here: SIGSTOP) ends the job on
every rank within ``train.step_timeout_s`` and a few polls, naming the rank and its last
step, with exit 8, summary.json saying "stalled" and the newest checkpoint intact; so does
one that stops during a checkpoint save, whichever rank it is. A rank
that raises inside a step ends the job within 60 s with that rank's error (exit 1), never
leaving the others waiting in a collective. On CPU (Gloo) here; the same on 2 GPUs (NCCL)
in the gpu-marked cases."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from process_harness import alive, finish, ranks_of, start, wait_for
from recpipe.checkpoint.integrity import METADATA_FILE, verify_checkpoint
from recpipe.checkpoint.store import latest_checkpoint
from recpipe.exit_codes import EXIT_STALLED, EXIT_WORKER_FAILED
from recpipe.train.watchdog import AUTO_FACTOR, AUTO_MIN_S, StepWatchdog, auto_timeout_s

CUDA_2 = ["train.device=cuda", "distributed.backend=auto", "distributed.nproc=2"]


def test_the_default_timeout_is_sized_from_the_measured_step():
    assert auto_timeout_s([]) == AUTO_MIN_S
    assert auto_timeout_s([0.01] * 50) == AUTO_MIN_S  # 1 s: the floor
    assert auto_timeout_s([2.0, 3.0, 100.0]) == AUTO_FACTOR * 3.0  # the median, not the slowest


def test_the_first_step_evaluation_and_saves_are_not_timed():
    dog = StepWatchdog(0.2, rank=0, world_size=1, describe_newest=str, on_stall=print)
    try:
        dog.arm()
        assert dog._last_at is None  # the first step (compiles, captures) is not timed
        dog.stepped(1)
        assert dog._last_at is not None
        dog.disarm()  # evaluation, a save
        assert dog._last_at is None
        dog.arm()
        dog.stepped(2)
        assert list(dog._durations) and dog._last_at is not None
    finally:
        dog.disarm()
        dog.close()


def test_a_compile_is_not_timed():
    """torch.compile compiling inside a step (here a backend that takes a second, five
    timeouts) is no stall; the step is timed from the compile's end."""
    ended: list[str] = []

    def slow_backend(gm, example_inputs):
        time.sleep(1.0)
        return gm.forward

    fn = torch.compile(lambda x: x.sin() + 1, backend=slow_backend)
    dog = StepWatchdog(0.2, rank=0, world_size=1, describe_newest=str, on_stall=ended.append)
    dog._end = ended.append  # record instead of ending this process
    try:
        dog.arm()
        dog.stepped(1)
        started = time.monotonic()
        fn(torch.randn(8))
        assert time.monotonic() - started > 1.0
        dog.stepped(2)
        assert ended == []
        time.sleep(0.5)  # a step that takes longer than the timeout is still one
        assert ended and "no training step for" in ended[0]
    finally:
        dog.disarm()
        dog.close()


@contextlib.contextmanager
def _job_store() -> Iterator[None]:
    """A rendezvous store the watchdogs of this process reach as a job's ranks would (env://)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def test_a_rank_waiting_for_one_that_compiles_waits_on():
    """Rank 1 compiles (its heartbeat says so) while rank 0 waits for it in a collective:
    slow, not stalled."""
    ended: list[str] = []
    with _job_store():
        compiling = StepWatchdog(0.2, rank=1, world_size=2, describe_newest=str, on_stall=ended.append)
        compiling._compile_started()
        dog = StepWatchdog(0.2, rank=0, world_size=2, describe_newest=str, on_stall=ended.append)
        dog._end = ended.append
        dog.arm()
        dog.stepped(1)
        time.sleep(1.5)  # several timeouts and diagnoses
        assert ended == []
        compiling._compile_ended()
        compiling.close()  # its heartbeat says closed: still no stall
        dog.disarm()
        dog.close()
    assert ended == []


def _stalled_run(run: Path, *extra: str, stop: int | None = 1, nproc: int = 2, timeout_s: float = 5.0):
    """An endless run; once step 4's checkpoint exists, SIGSTOP rank ``stop`` (None: a rank
    of the run stops itself). Returns the launcher, the ranks, stderr and the seconds from
    then to the end."""
    proc = start(run, f"train.step_timeout_s={timeout_s}", *extra)
    ranks: dict[int, int] = {}
    try:
        wait_for(run / "ckpt" / "step_00000004" / METADATA_FILE, proc)
        ranks = ranks_of(proc.pid, nproc=nproc)
        if stop is not None:
            os.kill(ranks[stop], signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, err = finish(proc, timeout=timeout_s + 90, also_kill=list(ranks.values()))
        took = time.monotonic() - stopped_at
    finally:
        proc.kill()
        for pid in ranks.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    return proc, ranks, err, took


def _assert_stalled(run: Path, proc, ranks, err: str, took: float, timeout_s: float) -> None:
    assert proc.returncode == EXIT_STALLED, err[-4000:]
    assert took < timeout_s + 45, took
    last = [line for line in err.splitlines() if line.strip()][-1]
    said = re.fullmatch(rf"recpipe train: no training step for \d+ s \(train.step_timeout_s={timeout_s:g}\): rank 1 "
                        rf"stopped responding after step (\d+) \(stopped or frozen\); the other ranks waited for it\. "
                        rf"Every rank is ended; nothing was saved after it \(newest checkpoint: (\S+)\) "
                        rf"\[exit {EXIT_STALLED}\]", last)
    assert said, err[-4000:]
    assert err.count("no training step for") == 1, err[-4000:]  # one rank says it
    newest = latest_checkpoint(run / "ckpt")
    assert str(newest) == said[2] and int(said[1]) >= 4
    assert verify_checkpoint(newest, 0, 1) == [], "the newest checkpoint is damaged"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "stalled" and "rank 1" in summary["stalled"]
    assert not [pid for pid in ranks.values() if alive(pid)], "a rank outlived the job (the stopped one?)"


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_naming_it(tmp_path):
    run = tmp_path / "run"
    proc, ranks, err, took = _stalled_run(run)
    _assert_stalled(run, proc, ranks, err, took, 5.0)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.gpus(2)
def test_a_stopped_rank_ends_the_job_under_nccl(tmp_path):
    run = tmp_path / "run"
    proc, ranks, err, took = _stalled_run(run, *CUDA_2, timeout_s=10.0)
    _assert_stalled(run, proc, ranks, err, took, 10.0)


def _rank_1_raises(run: Path, *extra: str):
    """An endless run whose model raises on rank 1 in its 6th training step (just after
    step 4's checkpoint). Returns the launcher, stderr and the seconds from step 4 to the end."""
    proc = start(run, "model.factory=fault_data:fails_on_rank_1", *extra)
    try:
        wait_for(run / "ckpt" / "step_00000004" / METADATA_FILE, proc)
        step_4 = time.monotonic()
        _, err = finish(proc, timeout=600)
    finally:
        proc.kill()
    return proc, err, time.monotonic() - step_4


def _assert_its_error(proc, err: str, took: float) -> None:
    assert proc.returncode == EXIT_WORKER_FAILED, err[-4000:]
    assert "recpipe train: rank 1 failed:" in err, err[-4000:]
    assert "RuntimeError: injected failure on rank 1 at its training step 6" in err, err[-4000:]
    assert "Connection closed by peer" not in err, "the report is another rank's error, not the first one"
    # rank 0 waited in a collective with rank 1: ended within seconds, not at the timeout (10 min)
    assert took < 60, took


@pytest.mark.slow
def test_a_rank_that_raises_mid_step_ends_the_job_with_its_error(tmp_path):
    proc, err, took = _rank_1_raises(tmp_path / "run")
    _assert_its_error(proc, err, took)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())  # the launcher's word for rank 1
    assert summary["status"] == "failed" and summary["exit_code"] == EXIT_WORKER_FAILED, summary
    assert summary["error"] == "rank 1 failed: RuntimeError: injected failure on rank 1 at its training step 6", summary


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.gpus(2)
def test_a_rank_that_raises_mid_step_ends_the_job_under_nccl(tmp_path):
    proc, err, took = _rank_1_raises(tmp_path / "run", *CUDA_2)
    _assert_its_error(proc, err, took)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_stopped_in_a_checkpoint_save_ends_the_job_naming_it(tmp_path, rank):
    """A rank stops (SIGSTOP, here its own, from inside the save of step 8: the check of its
    weights reads its state) while every rank saves: saves are not timed, but a rank that
    stops responding in one ends the job as in a step, naming it, within the timeout and a
    few polls, not Gloo's 10 minutes. When rank 0 is the stopped one, the launcher writes
    the "stalled" summary.json that rank 0 cannot."""
    run, timeout_s = tmp_path / "run", 5.0
    # the save of step 8 starts a few steps after step 4's checkpoint
    proc, ranks, err, took = _stalled_run(run, f"model.factory=fault_data:rank_{rank}_stops_in_a_save", stop=None)
    assert proc.returncode == EXIT_STALLED, err[-4000:]
    assert took < timeout_s + 45, took
    newest = run / "ckpt" / "step_00000004"
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last == (f"recpipe train: no response for 5 s during the checkpoint save of step 8 (train.step_timeout_s=5): "
                    f"rank {rank} stopped responding (stopped or frozen); the other ranks waited for it. Every rank is "
                    f"ended; nothing was saved after it (newest checkpoint: {newest}) [exit {EXIT_STALLED}]"), err[-4000:]
    assert latest_checkpoint(run / "ckpt") == newest and verify_checkpoint(newest, 0, 1) == []
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "stalled", summary
    assert not [pid for pid in ranks.values() if alive(pid)], "a rank outlived the job (the stopped one?)"


def test_a_closed_watchdog_is_not_taken_for_a_stopped_rank(tmp_path):
    """A rank whose training is over (its watchdog closed) stops beating: the ranks still
    saving or evaluating must not end the job for it."""
    ended: list[str] = []
    with _job_store():
        done = StepWatchdog(0.2, rank=1, world_size=2, describe_newest=str, on_stall=ended.append)
        done.close()
        dog = StepWatchdog(0.2, rank=0, world_size=2, describe_newest=str, on_stall=ended.append)
        dog._end = ended.append  # record instead of ending this process
        with dog.during("the checkpoint save of step 8"):
            time.sleep(1.5)  # several timeouts and diagnoses
        dog.close()
    assert ended == []
