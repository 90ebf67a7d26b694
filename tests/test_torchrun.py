"""``recpipe torchrun``: torchrun in recpipe's process, which ends on a signal or a failed rank
with one line and the ranks' exit code instead of torchrun's traceback, also when the signal
comes twice (a wrapper or a scheduler signalling the group too), after its ranks saved."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from recpipe.exit_codes import EXIT_BAD_CONFIG, EXIT_PREEMPTED
from process_harness import CONFIG, TESTS, alive, ranks_of, start, wait_for


def test_a_sigterm_delivered_twice_ends_with_one_line_after_the_ranks_saved(tmp_path):
    run = tmp_path / "run"
    proc = start(run, torchrun="recpipe")
    ranks: dict[int, int] = {}
    try:
        wait_for(run / "ckpt" / "step_00000004" / "metadata.json", proc)
        ranks = ranks_of(proc.pid, torchrun=True)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)  # as `timeout` or a scheduler does: to torchrun and its group
        code = proc.wait(timeout=120)
        left = [pid for pid in ranks.values() if alive(pid)]  # torchrun waited for its ranks
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        for pid in ranks.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert code == EXIT_PREEMPTED, err[-4000:]
    assert left == [], err[-4000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-4000:]
    lines = err.strip().splitlines()
    assert lines[-1] == ("recpipe torchrun: stopped by SIGTERM: forwarded to the ranks, which said above what they "
                         f"saved [exit {EXIT_PREEMPTED}]"), err[-4000:]
    assert any(line.startswith("recpipe train: stopped by SIGTERM after step") and "saved" in line
               for line in lines[:-1]), err[-4000:]


def test_a_failed_rank_ends_with_its_exit_code_and_no_traceback(tmp_path):
    cmd = [sys.executable, "-m", "recpipe", "torchrun", "--standalone", "--nproc-per-node", "1", "-m", "recpipe",
           "train", "--config", str(CONFIG), "--set", "train.steps=-3", "--set", f"logging.run_dir={tmp_path}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(TESTS)]))}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == EXIT_BAD_CONFIG, done.stderr[-4000:]  # torchrun itself exits 1
    assert "train.steps" in done.stderr and "Traceback" not in done.stderr, done.stderr[-4000:]
    assert "ChildFailedError" not in done.stderr and "exitcode  : 2" in done.stderr, done.stderr[-4000:]

