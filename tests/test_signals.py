"""A signal at any moment of ``recpipe train``, from its first line to its exit, is
never lost: before training starts it ends the run at once with one line and 128 +
signal; once a step has run, every rank stops at a step boundary after a checkpoint;
after the last step the run completes and says so. Each case is a real launch of
configs/quickstart.yaml on 2 ranks, signalled at a moment found by watching it (its
processes, its output), and leaves no process and nothing in $TMPDIR behind.

``recpipe.stop_requests`` on its own: the phases of a request, and a main thread that
waits in C++ (where Python cannot run a handler) ended by the watching thread."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from process_harness import alive
from recpipe.exit_codes import EXIT_INTERRUPTED, EXIT_PREEMPTED

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
CONFIG = ROOT / "configs" / "quickstart.yaml"
BEFORE = "before training started: nothing was trained or saved"


def _env(tmp: Path) -> dict[str, str]:
    """This environment with $TMPDIR=``tmp``: the checkout and the tests importable, no
    OMP_NUM_THREADS of the caller's, and no compile cache directory of its own (inductor
    sets TORCHINDUCTOR_CACHE_DIR in a process that compiled: the run's goes under $TMPDIR)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS)])
    env["TMPDIR"] = str(tmp)
    return env


def _sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for t in os.listdir(f"/proc/{pid}/task") for c in
                Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _forkserver(launcher: int) -> int | None:
    return next((c for c in _children(launcher) if "multiprocessing.forkserver" in _cmdline(c)), None)


def _compiled_code(tmp: Path) -> bool:
    """Whether inductor has written a module into ``tmp``'s compile cache. os.walk, not
    Path.glob: inductor removes its temporary directories while the walk runs, and
    Python 3.11's glob raises FileNotFoundError for one that vanished under it."""
    return any(name.endswith(".py") for cache in tmp.glob("torchinductor_*")
               for _, _, names in os.walk(cache) for name in names)


def _group(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(text[text.rindex(")") + 2:].split()[2]) == pgid and alive(int(entry)):
            members.append(int(entry))
    return members


def _foreground_signals() -> None:
    """The run's SIGINT and SIGTERM as a terminal's foreground command has them, whatever
    this test process inherited: pytest started in the background by a shell without job
    control ignores SIGINT, and a command started with a signal ignored keeps ignoring it
    (by design: ``recpipe.stop_requests``), which is not what these tests are about."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


class Run:
    """``recpipe train`` on configs/quickstart.yaml (2 ranks), in a process group of its
    own, with its own $TMPDIR; stdout is read line by line as it comes."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        self.dir, self.tmp = tmp / "run", tmp / "tmp"
        self.tmp.mkdir()
        cmd = [sys.executable, "-m", "recpipe", "train", "--config", str(CONFIG),
               *_sets("train.eval_every=0", "train.progress=false", f"logging.run_dir={self.dir}",
                      f"checkpoint.dir={self.dir / 'ckpt'}", *extra)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=_env(self.tmp), start_new_session=True, preexec_fn=_foreground_signals)
        self.started = time.monotonic()

    def wait_until(self, ready, what: str, timeout: float = 240.0) -> None:
        end = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"exited ({self.proc.returncode}) before {what}: {self.proc.stderr.read()[-3000:]}")
            assert time.monotonic() < end, f"no {what} within {timeout} s"
            time.sleep(0.02)

    def ranks(self) -> list[int]:
        server = _forkserver(self.proc.pid)
        return _children(server) if server else []

    def signal(self, sig: int = signal.SIGTERM) -> float:
        os.kill(self.proc.pid, sig)
        return time.monotonic()

    def end(self, timeout: float = 180.0) -> str:
        """Wait for the end; the stderr. Nothing of the job may outlive it (the server
        that forks the ranks and multiprocessing's resource tracker end with it, within
        a moment), nor anything it made in $TMPDIR (torch's compile cache aside)."""
        try:
            _, err = self.proc.communicate(timeout=timeout)
        finally:
            end = time.monotonic() + 5
            while _group(self.proc.pid) and time.monotonic() < end:
                time.sleep(0.05)
            left = _group(self.proc.pid)
            for pid in left:
                os.kill(pid, signal.SIGKILL)
        assert not left, f"processes of the job outlived it: {[_cmdline(p)[:120] for p in left]}"
        made = [p.name for p in self.tmp.iterdir() if not p.name.startswith("torchinductor_")]
        assert not made, f"left in $TMPDIR: {made}"
        return err

    def last_line(self, err: str) -> str:
        lines = [line for line in err.splitlines() if line.strip()]
        assert lines, "nothing on stderr"
        assert "Traceback" not in err, err[-4000:]
        return lines[-1]

    def stopped_as_documented(self, err: str, name: str = "SIGTERM", code: int = EXIT_PREEMPTED) -> str:
        """Exit 128 + signal, and a last line that says either that nothing was trained
        or which checkpoint holds the steps that were. Returns how it stopped."""
        assert self.proc.returncode == code, err[-4000:]
        last = self.last_line(err)
        if last == f"recpipe train: stopped by {name} {BEFORE} [exit {code}]":
            assert not list((self.dir / "ckpt").glob("step_*")), "a checkpoint of a run that trained nothing"
            return "before"
        after = re.fullmatch(rf"recpipe train: stopped by {name} after step (\d+): checkpoint (\S+) saved; run the "
                             rf"same command again to resume \[exit {code}\]", last)
        assert after, err[-4000:]
        assert Path(after[2]) == self.dir / "ckpt" / f"step_{int(after[1]):08d}"
        assert (Path(after[2]) / "metadata.json").is_file()
        return "after"


# ---------------------------------------------------------------- start-up, phase by phase
@pytest.mark.slow
def test_a_signal_while_the_launcher_imports_ends_the_run_at_once(tmp_path):
    run = Run(tmp_path, "train.steps=100")
    time.sleep(0.3)  # importing torch and torchrec (seconds on 2 cores)
    sent = run.signal()
    err = run.end()
    assert run.stopped_as_documented(err) == "before"
    assert time.monotonic() - sent < 15


@pytest.mark.slow
def test_a_signal_while_the_forkserver_loads_ends_the_run_at_once(tmp_path):
    """The server starts with the command and loads while the launcher imports and checks
    the config: a signal then ends the run at once (the command's handler, or the launcher's
    once it launches), and neither the server nor anything of its in $TMPDIR is left (end())."""
    run = Run(tmp_path, "train.steps=100")
    run.wait_until(lambda: _forkserver(run.proc.pid) is not None, "forkserver")
    sent = run.signal()
    err = run.end()
    assert run.stopped_as_documented(err) == "before"
    assert time.monotonic() - sent < 15


@pytest.mark.slow
@pytest.mark.parametrize("sig, name, code", [(signal.SIGTERM, "SIGTERM", EXIT_PREEMPTED),
                                             (signal.SIGINT, "SIGINT", EXIT_INTERRUPTED)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_as_the_ranks_are_forked_is_not_lost(tmp_path, sig, name, code):
    """The launcher forwards it to ranks that have just been forked and do not handle
    signals yet: it waits for them, blocked, and is not lost (it was, ignored)."""
    run = Run(tmp_path, "train.steps=100")
    run.wait_until(lambda: len(run.ranks()) == 2, "2 ranks")
    run.signal(sig)
    err = run.end()
    run.stopped_as_documented(err, name, code)


@pytest.mark.slow
def test_a_signal_during_the_model_build_ends_the_run_at_once(tmp_path):
    run = Run(tmp_path, "train.steps=100", "model.factory=fault_data:slow_build")
    run.wait_until(lambda: len(run.ranks()) == 2, "2 ranks")
    time.sleep(2.0)  # the ranks are building the model (2 minutes)
    sent = run.signal()
    err = run.end()
    assert run.stopped_as_documented(err) == "before"
    assert time.monotonic() - sent < 15


@pytest.mark.slow
def test_a_signal_during_the_first_compile_stops_after_a_step_with_a_checkpoint(tmp_path):
    run = Run(tmp_path, "train.steps=100000", "pipeline.compile=true")
    # The first step compiles the dense part: inductor writes its code into $TMPDIR's cache.
    run.wait_until(lambda: _compiled_code(run.tmp), "compiled code")
    run.signal()
    err = run.end(timeout=600)
    assert run.stopped_as_documented(err) == "after"


@pytest.mark.slow
def test_a_signal_after_the_last_step_lets_the_run_complete_and_says_so(tmp_path):
    run = Run(tmp_path, "train.steps=30")
    final = run.dir / "ckpt" / "step_00000030" / "metadata.json"
    run.wait_until(final.exists, "the final checkpoint")
    run.signal()
    err = run.end()
    assert run.proc.returncode == 0, err[-4000:]
    assert json.loads((run.dir / "summary.json").read_text())["status"] == "completed"
    assert run.last_line(err) in ("recpipe train: SIGTERM came after the last step: the run completed",
                                  "recpipe: SIGTERM received by the launcher (pid %d): forwarded to every rank"
                                  % run.proc.pid), err[-3000:]


# ---------------------------------------------------------------- recpipe.stop_requests
PHASES = """
import os, signal, sys, time
from recpipe.errors import StopRequested
from recpipe.stop_requests import defer_requests, install_signal_handlers, requested_signal
install_signal_handlers("train")
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    print("not raised", flush=True)
except StopRequested as stop:
    print("starting:", stop, flush=True)
install_signal_handlers("train")  # a new run forgets the request
assert requested_signal() is None
defer_requests()  # training: recorded, not raised
os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.05)
assert requested_signal() == signal.SIGTERM
os.kill(os.getpid(), signal.SIGINT); time.sleep(0.05)  # delivered twice (e.g. Ctrl-C and forwarded)
print("still running", flush=True)
time.sleep(1.2)
os.kill(os.getpid(), signal.SIGTERM); time.sleep(10)
print("not stopped", flush=True)
"""


def test_a_request_raises_while_starting_and_is_recorded_while_training():
    out = subprocess.run([sys.executable, "-c", PHASES], capture_output=True, text=True, timeout=60, env=_env(Path("/tmp")))
    assert f"starting: stopped by SIGTERM {BEFORE}" in out.stdout, out.stderr
    assert "not raised" not in out.stdout
    assert out.returncode == EXIT_PREEMPTED, out.stderr
    assert "still running" in out.stdout and "not stopped" not in out.stdout
    assert "second SIGTERM" in out.stderr and "without a checkpoint" in out.stderr


STUCK = """
import os, signal, threading, time
from datetime import timedelta
from torch.distributed import TCPStore
from recpipe.stop_requests import install_signal_handlers
install_signal_handlers("train")
store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
store.wait(["a key nobody sets"], timedelta(seconds=60))  # in C++, as a rendezvous with a peer that left
print("returned", flush=True)
"""


def test_a_main_thread_waiting_in_cpp_is_ended_by_the_watch_with_the_line():
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", STUCK], capture_output=True, text=True, timeout=60, env=_env(Path("/tmp")))
    assert out.returncode == EXIT_PREEMPTED, out.stderr
    assert out.stderr.strip() == f"recpipe train: stopped by SIGTERM {BEFORE} [exit {EXIT_PREEMPTED}]"
    assert "returned" not in out.stdout
    assert time.monotonic() - started < 30
