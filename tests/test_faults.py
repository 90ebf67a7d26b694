"""Faults as an operator meets them, each with real processes: a signal to a process
group through a wrapper is one signal; a rank whose torchrun is killed stops every
rank, and the job ends at once, non-zero; a run without training data, a full
filesystem for logging.run_dir or checkpoint.dir, a directory that cannot be written
at the start, a failed two-rank run: each ends with its documented exit code and one
line naming the cause, leaves nothing behind in /tmp, and no process survives."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from process_harness import CONFIG, TINY_MODEL, cmdline, alive, descendants, finish, overrides, ranks_of, wait_for
from recpipe.checkpoint.integrity import METADATA_FILE
from recpipe.checkpoint.store import latest_checkpoint
from recpipe.cli import main
from recpipe.exit_codes import (
    EXIT_BAD_CONFIG,
    EXIT_BAD_DATA,
    EXIT_CHECKPOINT,
    EXIT_HANGUP,
    EXIT_INTERRUPTED,
    EXIT_LAUNCHER_FAILED,
    EXIT_LAUNCHER_GONE,
    EXIT_PREEMPTED,
    EXIT_WORKER_FAILED,
)

ROOT = Path(__file__).resolve().parents[1]
RECPIPE = [sys.executable, "-m", "recpipe", "train", "--config", str(CONFIG)]
# A short, finite run (2 ranks, 8 steps): for faults found at the start or at the end.
SHORT = [*TINY_MODEL, "data.synthetic.num_batches=8", "data.synthetic.num_eval_batches=1", "train.steps=8",
         "train.eval_every=0", "train.log_every=4", "train.progress=false"]


def _sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


def _env(**extra: str) -> dict[str, str]:
    """This environment, for a recpipe command: the checkout importable, no OMP_NUM_THREADS of the caller's."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return {**env, **extra}


def _pgrp(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2 :].split()[2])


def _group_members(pgid: int, settle_s: float = 5.0) -> list[int]:
    """The live processes of group ``pgid`` once it has settled: the launcher's forkserver
    and multiprocessing's resource tracker end when the launcher does, a moment after it."""
    end = time.monotonic() + settle_s
    while True:
        members = [int(p) for p in os.listdir("/proc") if p.isdigit() and _pgrp(int(p)) == pgid and alive(int(p))]
        if not members or time.monotonic() > end:
            return members
        time.sleep(0.05)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _stop_line(err: str) -> tuple[str, int]:
    lines = [line for line in err.splitlines() if re.search(r"stopped by .* after step \d+", line)]
    assert len(lines) == 1, err[-4000:]  # once for the job
    return lines[0], int(re.search(r"after step (\d+)", lines[0])[1])


# ------------------------------------------------------------ one signal, delivered twice
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, EXIT_INTERRUPTED), (signal.SIGTERM, EXIT_PREEMPTED)],
                         ids=["SIGINT", "SIGTERM"])
def test_a_group_signal_through_a_wrapper_is_one_signal(tmp_path, sig, code):
    """`set -m; timeout 300 recpipe train ... & kill -INT -$!` (or -TERM, as schedulers
    deliver it): the launcher gets the signal from the group and again from `timeout`,
    which forwards it (and sends it to its group once more); the ranks get it three
    times, and so does the server that forks them, which must outlive it. One request:
    drain, save, 130 (143)."""
    if shutil.which("timeout") is None:
        pytest.skip("needs coreutils' timeout")
    run = tmp_path / "run"
    proc = subprocess.Popen(["timeout", "300", *RECPIPE, *overrides(run)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True)
    try:
        wait_for(run / "ckpt" / "step_00000004" / METADATA_FILE, proc)
        os.killpg(proc.pid, sig)
        _, err = finish(proc, timeout=120)
    finally:
        _kill_group(proc.pid)
    assert proc.returncode == code, err[-4000:]
    assert f"second {sig.name}" not in err and "Traceback" not in err, err[-4000:]
    line, step = _stop_line(err)
    assert f"checkpoint {run / 'ckpt' / f'step_{step:08d}'} saved" in line and f"[exit {code}]" in line
    assert latest_checkpoint(run / "ckpt") == run / "ckpt" / f"step_{step:08d}"
    assert not _group_members(proc.pid), "a process of the job outlived it"


# ------------------------------------------- TSV loader workers, SIGHUP, the forkserver
class _Job:
    """An endless ``recpipe train`` (process_harness.ENDLESS) in a process group of its own
    (as `setsid` or a scheduler starts it) with its own $TMPDIR. ``end()`` checks that
    nothing of it outlives it: no process of its group, nothing it made in $TMPDIR
    (torch's compile cache aside)."""

    def __init__(self, tmp_path: Path, *extra: str) -> None:
        self.run, self.tmp = tmp_path / "run", tmp_path / "tmp"
        self.tmp.mkdir()
        self.proc = subprocess.Popen([*RECPIPE, *overrides(self.run, *extra)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=_env(TMPDIR=str(self.tmp)),
                                     start_new_session=True)

    def training(self) -> None:
        wait_for(self.run / "ckpt" / "step_00000004" / METADATA_FILE, self.proc)

    def server(self) -> int:
        """The forkserver: the launcher's child that forks the ranks (which share its command line)."""
        return next(c for c in _children(self.proc.pid) if "multiprocessing.forkserver" in cmdline(c))

    def end(self, timeout: float = 120) -> str:
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(self.proc.pid)  # its ranks hold its output open
            _, err = self.proc.communicate()
            raise AssertionError(f"still running after {timeout} s:\n{err[-4000:]}") from None
        finally:
            members = _group_members(self.proc.pid)
            _kill_group(self.proc.pid)
        assert not members, f"processes of the job outlived it: {[cmdline(p)[:100] for p in members]}\n{err[-3000:]}"
        left = [p.name for p in self.tmp.iterdir() if not p.name.startswith("torchinductor_")]
        assert not left, f"left in $TMPDIR: {left}"
        return err

    def summary(self) -> dict:
        return json.loads((self.run / "summary.json").read_text())


def _tsv_source(tmp_path: Path) -> list[str]:
    """Criteo TSV training data read by a forked DataLoader worker in each rank."""
    return ["data.source=criteo_tsv", "data.num_workers=1", "data.batch_size=16",
            f"data.criteo.train_files=[{_tsv(tmp_path / 'day_0.tsv', 4000)}]"]


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, EXIT_PREEMPTED), (signal.SIGHUP, EXIT_HANGUP)],
                         ids=["SIGTERM", "SIGHUP"])
def test_a_group_signal_with_tsv_loader_workers_is_one_request(tmp_path, sig, code):
    """`kill -TERM -$PGID` (or the SIGHUP of a closed terminal) reaches the launcher, the
    forkserver, the ranks and their DataLoader workers: the workers outlive it (torch's end
    on SIGTERM, which failed the run: "DataLoader worker ... is killed by signal"), and the
    job stops as for one request: drain, save, 128 + signal, one line."""
    job = _Job(tmp_path, *_tsv_source(tmp_path))
    job.training()
    os.killpg(job.proc.pid, sig)
    err = job.end()
    assert job.proc.returncode == code, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    line, step = _stop_line(err)
    assert line.startswith(f"recpipe train: stopped by {sig.name} after step {step}: "), line
    assert f"checkpoint {job.run / 'ckpt' / f'step_{step:08d}'} saved" in line and f"[exit {code}]" in line
    assert latest_checkpoint(job.run / "ckpt") == job.run / "ckpt" / f"step_{step:08d}"
    assert job.summary()["status"] == "preempted" and job.summary()["stopped_by"] == sig.name


@pytest.mark.slow
def test_a_rank_killed_with_tsv_loader_workers_is_one_report(tmp_path):
    """SIGKILL to a rank: its workers end with it (they outlived it for seconds, and their
    exit printed tracebacks about the launcher's temporary files); the launcher reports
    the rank and writes how the run ended in summary.json, which rank 0 could not."""
    job = _Job(tmp_path, *_tsv_source(tmp_path))
    job.training()
    os.kill(ranks_of(job.proc.pid)[1], signal.SIGKILL)
    err = job.end()
    assert job.proc.returncode == EXIT_WORKER_FAILED, err[-4000:]
    assert "recpipe train: rank 1 failed:\nprocess 1 terminated with signal SIGKILL" in err, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    summary = job.summary()
    assert summary["status"] == "failed" and summary["exit_code"] == EXIT_WORKER_FAILED, summary
    assert summary["error"] == "process 1 terminated with signal SIGKILL", summary


@pytest.mark.slow
@pytest.mark.parametrize("sig, what", [(signal.SIGKILL, "was killed by SIGKILL"), (signal.SIGSTOP, "was stopped (SIGSTOP)")],
                         ids=["SIGKILL", "SIGSTOP"])
def test_the_forkserver_killed_or_stopped_ends_the_job_in_one_line(tmp_path, sig, what):
    """The server that forks the ranks is their parent and passes their exits on to the
    launcher: killed, its ranks die with it (the launcher exited 255 without a word);
    stopped, the launcher would wait for ever. Either ends the job: one line, exit 9, and
    summary.json says so."""
    job = _Job(tmp_path)
    job.training()
    server = job.server()
    os.kill(server, sig)
    err = job.end()
    assert job.proc.returncode == EXIT_LAUNCHER_FAILED, err[-4000:]
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith(f"recpipe train: the process that forks the ranks (multiprocessing's forkserver, pid "
                           f"{server}) {what}"), err[-4000:]
    assert f"; every rank was ended; newest checkpoint: {job.run / 'ckpt'}/step_" in last, last
    assert last.endswith(f"[exit {EXIT_LAUNCHER_FAILED}]") and "Traceback" not in err, err[-4000:]
    summary = job.summary()
    assert summary["status"] == "launcher_failed" and summary["exit_code"] == EXIT_LAUNCHER_FAILED, summary


# ---------------------------------------------------- a rank whose torchrun is gone
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environ(pid: int) -> dict[str, str]:
    try:
        items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_a_rank_whose_torchrun_is_killed_stops_every_rank_and_the_job_ends(tmp_path):
    """Two torchrun agents on one host (two nodes of one rank each, c10d rendezvous);
    `kill -9` the agent of rank 1. Rank 1 sees its launcher gone and asks every rank
    to stop: they save a checkpoint, and the other agent ends promptly, non-zero.
    The ranks ran with recpipe's intra-op thread rule (one each), not torch's one
    thread per core, which torchrun leaves in place with one process per node."""
    run, port = tmp_path / "run", _free_port()
    logs = [open(tmp_path / f"agent{n}.log", "w") for n in range(2)]
    agents: list[subprocess.Popen] = []
    try:
        for node in range(2):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                   "--max-restarts", "0", "-m", "recpipe", "train", "--config", str(CONFIG), *overrides(run)]
            agents.append(subprocess.Popen(cmd, stdout=logs[node], stderr=subprocess.STDOUT, env=_env(),
                                           start_new_session=True))
            end = time.monotonic() + 60
            while node == 0 and not _listening(port):  # agent 0 hosts the rendezvous store
                assert agents[0].poll() is None and time.monotonic() < end, (tmp_path / "agent0.log").read_text()
                time.sleep(0.1)
        wait_for(run / "ckpt" / "step_00000004" / METADATA_FILE, agents[0])
        ranks = {int(_environ(p)["RANK"]): p for a in agents for p in descendants(a.pid) if "RANK" in _environ(p)}
        assert sorted(ranks) == [0, 1], ranks
        holder = next(a for a in agents if ranks[1] in descendants(a.pid))
        other = next(a for a in agents if a is not holder)
        holder.kill()
        killed_at = time.monotonic()
        other.wait(timeout=120)
        took = time.monotonic() - killed_at
        end = time.monotonic() + 30
        while alive(ranks[1]) and time.monotonic() < end:
            time.sleep(0.1)
        orphan_alive = alive(ranks[1])
    finally:
        for a in agents:
            _kill_group(a.pid)
        for log in logs:
            log.close()
    text = "".join((tmp_path / f"agent{n}.log").read_text() for n in range(2))
    assert other.returncode != 0 and took < 60, (other.returncode, took, text[-4000:])
    assert not orphan_alive, "the rank whose torchrun was killed trained on"
    assert f"rank 1: its launcher (pid {holder.pid}) is gone" in text, text[-4000:]
    line, step = _stop_line(text)
    assert "stopped by the loss of a rank's launcher (torchrun) after step" in line, line
    assert f"[exit {EXIT_LAUNCHER_GONE}]" in line, line
    assert latest_checkpoint(run / "ckpt") == run / "ckpt" / f"step_{step:08d}"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["world_size"] == 2
    assert summary["intra_op_threads"] == 1, summary  # torch's default: one per core; torchrun sets none


# ----------------------------------------------------------------- no training data
def _tsv_line(label: int, dense: list[int], ids: list[str]) -> str:
    return "\t".join([str(label), *map(str, dense), *ids]) + "\n"


def _tsv(path: Path, lines: int, malformed_at: int | None = None) -> Path:
    """Criteo-layout lines for TINY_MODEL (13 counts, 4 ids); line ``malformed_at`` (1-based) has 3 columns."""
    with open(path, "w") as fh:
        for i in range(1, lines + 1):
            fh.write("1\t2\t3\n" if i == malformed_at else _tsv_line(i % 2, [i % 7] * 13, [f"{i:08x}"] * 4))
    return path


TSV = ["data.source=criteo_tsv", "data.num_workers=0", "data.batch_size=16"]


def test_an_empty_tsv_file_is_an_error_naming_it(tmp_path, capfd):
    empty = tmp_path / "day_0.tsv"
    empty.write_text("")
    code = main(["train", "--config", str(CONFIG), *_sets(*SHORT, *TSV, f"data.criteo.train_files=[{empty}]",
                                                         f"logging.run_dir={tmp_path / 'run'}")])
    err = capfd.readouterr().err
    assert code == EXIT_BAD_DATA, err
    assert f"data.criteo.train_files: {empty} holds no line: no training data [exit {EXIT_BAD_DATA}]" in err
    assert len(err.strip().splitlines()) == 1, err


def test_a_binary_dataset_without_rows_is_an_error(tmp_path, capfd):
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    data = tmp_path / "data"
    assert main(["data", "convert", "--config", str(CONFIG), *_sets(*TINY_MODEL), "--out", str(data), str(empty)]) == 0
    capfd.readouterr()
    code = main(["train", "--config", str(CONFIG), *_sets(*SHORT, "data.source=binary", f"data.binary.train_dir={data}",
                                                         f"logging.run_dir={tmp_path / 'run'}")])
    err = capfd.readouterr().err
    assert code == EXIT_BAD_DATA, err
    assert f"data.binary.train_dir={str(data)!r} holds no rows: no training data" in err


@pytest.mark.slow
def test_a_data_factory_that_yields_nothing_is_an_error(tmp_path, capfd):
    run, config = tmp_path / "run", tmp_path / "factory.yaml"
    raw = yaml.safe_load(CONFIG.read_text())
    del raw["data"]["source"]  # a data.factory names the data instead
    config.write_text(yaml.safe_dump(raw))
    code = main(["train", "--config", str(config), *_sets(*SHORT, "data.factory=fault_data:no_batches",
                                                         "distributed.nproc=1", f"logging.run_dir={run}",
                                                         f"checkpoint.dir={run / 'ckpt'}")])
    err = capfd.readouterr().err
    assert code == EXIT_BAD_DATA, err[-3000:]
    assert "no training data: data.factory='fault_data:no_batches' yielded no training batch (epoch 0" in err
    assert json.loads((run / "summary.json").read_text())["status"] == "no_training_data"
    assert latest_checkpoint(run / "ckpt") is None


# ------------------------------------------------------------ full or read-only disks
def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt 2>/dev/null || "
                            "mount -t tmpfs -o size=64k tmpfs /tmp"], capture_output=True)
    return probe.returncode == 0


# Runs "$@" with a small tmpfs at $1 (a mount namespace of its own, as an unprivileged
# user where user namespaces are allowed). FILL=now: filled before the command starts;
# FILL=rerun: as now, over the config.yaml of an earlier run (rewritten in its own blocks);
# FILL=after:FILE: filled once FILE exists; then the complete checkpoints left in it
# are printed (the mount is gone with the namespace).
_FULL_FS = r"""
dir=$1; shift
mount -t tmpfs -o size=4m tmpfs "$dir" || exit 90
fill() { dd if=/dev/zero of="$dir/filler" bs=4k 2>/dev/null; true; }
case $FILL in
  now) fill; exec "$@" ;;
  rerun) echo "an earlier run's" >"$dir/config.yaml"; fill; exec "$@" ;;
  after:*) "$@" & job=$!
           while [ ! -e "${FILL#after:}" ] && kill -0 $job 2>/dev/null; do sleep 0.05; done
           fill; wait $job; code=$?
           for d in "$dir"/step_*; do [ -e "$d/metadata.json" ] && echo "complete: ${d##*/}"; done
           exit $code ;;
esac
"""


def _on_full_tmpfs(directory: Path, fill: str, cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    directory.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["unshare", "-rm", "sh", "-c", _FULL_FS, "sh", str(directory), *cmd], capture_output=True,
                          text=True, env=_env(FILL=fill), timeout=timeout, start_new_session=True)


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs `unshare -rm` (user and mount namespaces) to mount a tmpfs")
def test_a_full_filesystem_is_one_line_naming_the_path(tmp_path):
    # logging.run_dir full from the start: refused before the first step, every rank.
    run = tmp_path / "run"
    out = _on_full_tmpfs(run, "now", [*RECPIPE, *_sets(*SHORT, f"logging.run_dir={run}",
                                                      f"checkpoint.dir={tmp_path / 'ckpt'}")])
    assert out.returncode == EXIT_CHECKPOINT, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("recpipe train:")]
    assert lines == [f"recpipe train: cannot write logging.run_dir={str(run)!r} ({run / 'config.yaml'}): "
                     f"No space left on device [exit {EXIT_CHECKPOINT}]"], out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert latest_checkpoint(tmp_path / "ckpt") is None

    # A rerun into the full logging.run_dir: its config.yaml is rewritten in place, and
    # TensorBoard's writer is the first to fail (in its thread, which prints no traceback).
    out = _on_full_tmpfs(run, "rerun", [*RECPIPE, *_sets(*SHORT, f"logging.run_dir={run}",
                                                        f"checkpoint.dir={tmp_path / 'ckpt'}")])
    assert out.returncode == EXIT_CHECKPOINT, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines[-1] == (f"recpipe train: cannot write logging.run_dir={str(run)!r} ({run / 'events.out.tfevents.*'}): "
                         f"No space left on device [exit {EXIT_CHECKPOINT}]"), out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "Exception in thread" not in out.stderr, out.stderr[-3000:]

    # checkpoint.dir fills up once the step-10 checkpoint exists: a later save fails, and
    # the checkpoint before it stays the newest complete one.
    ckpt = tmp_path / "ckpt2"
    out = _on_full_tmpfs(ckpt, f"after:{ckpt / 'step_00000010' / METADATA_FILE}",
                         [*RECPIPE, *overrides(tmp_path / "run2", "checkpoint.every=10", f"checkpoint.dir={ckpt}")])
    assert out.returncode == EXIT_CHECKPOINT, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if "cannot save checkpoint" in line]
    assert len(lines) == 1 and "No space left on device" in lines[0], out.stderr[-3000:]
    failed = int(re.search(rf"cannot save checkpoint {ckpt}/step_(\d+) ", lines[0])[1])
    still = re.search(rf"the newest complete checkpoint is still {ckpt}/(step_\d+)", lines[0])
    left = re.findall(r"^complete: (step_\d+)$", out.stdout, re.MULTILINE)
    assert still and left and max(left) == still[1] and int(still[1][5:]) < failed, (lines[0], left)
    assert "Traceback" not in out.stderr
    summary = json.loads((tmp_path / "run2" / "summary.json").read_text())  # written by the launcher
    assert summary["status"] == "storage_error" and summary["exit_code"] == EXIT_CHECKPOINT, summary


def _without_root_override() -> list[str]:
    from test_checkpoint import _without_root_override as prefix

    return prefix()


def test_a_directory_that_cannot_be_written_at_the_start_exits_6(tmp_path):
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        cmd = [*_without_root_override(), *RECPIPE, *_sets(*SHORT, f"logging.run_dir={locked / 'run'}")]
        out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    finally:
        locked.chmod(0o755)
    assert out.returncode == EXIT_CHECKPOINT, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("recpipe train:")]
    assert lines == [f"recpipe train: cannot write logging.run_dir={str(locked / 'run')!r} ({locked / 'run'}): "
                     f"Permission denied [exit {EXIT_CHECKPOINT}]"], out.stderr[-3000:]



# ------------------------------------------------ checkpoint.dir: data only, and only the run's own
def _one_line(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith(f"recpipe {command}:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-4000:]
    return lines[0]


@pytest.mark.slow
def test_retention_keeps_what_recpipe_did_not_write(tmp_path):
    """Two ranks, checkpoint.keep=1: the user's directories in checkpoint.dir whose names
    begin like a checkpoint's survive every prune."""
    run, ckpt = tmp_path / "run", tmp_path / "run" / "ckpt"
    mine = {"step_foo/notes.txt": "a", "step_00000099_notes/important.txt": "b", "step_my_notes/todo.txt": "c"}
    for name, text in mine.items():
        (ckpt / name).parent.mkdir(parents=True)
        (ckpt / name).write_text(text)
    out = subprocess.run([*RECPIPE, *_sets(*SHORT, f"logging.run_dir={run}", f"checkpoint.dir={ckpt}",
                                           "checkpoint.every=2", "checkpoint.keep=1")],
                         capture_output=True, text=True, env=_env(), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert all((ckpt / name).read_text() == text for name, text in mine.items())
    assert sorted(p.name for p in ckpt.iterdir() if re.fullmatch(r"step_\d+", p.name)) == ["step_00000008"]


@pytest.mark.slow
def test_a_crafted_checkpoint_runs_no_code_on_resume_or_export(tmp_path):
    """A pickle that calls os.system in the newest checkpoint's DCP metadata, with matching
    sizes and CRC-32 in metadata.json: resuming (two ranks) and `recpipe export` refuse it
    in one line naming the file and what it names, exit 6, and nothing runs."""
    from test_checkpoint import craft_metadata

    run, ckpt, marker = tmp_path / "run", tmp_path / "run" / "ckpt", tmp_path / "ran"
    sets = _sets(*SHORT, f"logging.run_dir={run}", f"checkpoint.dir={ckpt}", "checkpoint.every=4")
    out = subprocess.run([*RECPIPE, *sets], capture_output=True, text=True, env=_env(), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    craft_metadata(ckpt / "step_00000008", marker)
    refused = (f"refusing checkpoint file {ckpt / 'step_00000008' / '.metadata'}: it names posix.system, which no "
               "checkpoint holds")

    out = subprocess.run([*RECPIPE, *sets, "--set", "train.steps=12"], capture_output=True, text=True, env=_env(),
                         timeout=600)
    assert out.returncode == EXIT_CHECKPOINT, out.stderr[-3000:]
    line = _one_line(out.stderr, "train")
    assert refused in line and line.endswith(f"[exit {EXIT_CHECKPOINT}]"), line

    exported = tmp_path / "model.pt"
    out = subprocess.run([sys.executable, "-m", "recpipe", "export", "--config", str(CONFIG), *_sets(*TINY_MODEL),
                          "--checkpoint", str(ckpt), "--out", str(exported)], capture_output=True, text=True,
                         env=_env(), timeout=600)
    assert out.returncode == EXIT_CHECKPOINT, out.stderr[-3000:]
    assert refused in _one_line(out.stderr, "export")
    assert not marker.exists(), "a checkpoint's file ran code"
    assert not exported.exists()


def test_a_directory_that_holds_more_than_the_run_is_refused(tmp_path, monkeypatch, capfd):
    """checkpoint.dir and logging.run_dir empty (the working directory), the root, the home
    directory or the working directory: refused before any process starts, exit 2, and
    nothing of the working directory is touched."""
    monkeypatch.chdir(tmp_path)
    notes = tmp_path / "step_my_notes" / "todo.txt"
    notes.parent.mkdir()
    notes.write_text("keep")
    for key in ("checkpoint.dir", "logging.run_dir"):
        for value, what in [('""', "is empty"), ("/", "is the filesystem's root"), (".", "is the working directory"),
                            (str(tmp_path), "is the working directory"), (str(Path.home()), "is the home directory")]:
            other = [f"logging.run_dir={tmp_path / 'run'}"] if key == "checkpoint.dir" else []
            code = main(["train", "--config", str(CONFIG), *_sets(*SHORT, *other, f"{key}={value}")])
            err = capfd.readouterr().err
            assert code == EXIT_BAD_CONFIG and f"{key}: {what}" in err, (key, value, err)
            assert len(err.strip().splitlines()) == 1, err
    assert notes.read_text() == "keep" and sorted(p.name for p in tmp_path.iterdir()) == ["step_my_notes"]


# ------------------------------------------------------------ nothing left after any kill
# Runs an endless `recpipe train` ("$@") with /dev/shm a tmpfs of its own (a mount
# namespace) and $TMPDIR=$T; once step 4's checkpoint exists, kills it as $KILL says,
# waits for the launcher, then up to 10 s for /dev/shm and $TMPDIR to empty (torch's
# compile cache aside) and prints what is left in each.
_KILL = r"""
mount -t tmpfs tmpfs /dev/shm || exit 90
"$@" 2>"$T.err" & launcher=$!
while [ ! -e "$CKPT/step_00000004/metadata.json" ] && kill -0 $launcher 2>/dev/null; do sleep 0.05; done
rank1() { for s in $(cat /proc/$launcher/task/*/children); do cat /proc/$s/task/*/children; done | tr ' ' '\n' | grep . | sort -n | tail -1; }
case $KILL in
  launcher) kill -KILL $launcher ;;
  rank) kill -KILL $(rank1) ;;
  sigterm) kill -TERM $launcher ;;
  twice) kill -TERM $launcher; sleep 1.5; kill -TERM $launcher ;;
esac
wait $launcher
left() { ls -A /dev/shm; ls -A "$T" | grep -v '^torchinductor_'; }
for i in $(seq 200); do [ -z "$(left)" ] && break; sleep 0.05; done
echo "left: $(left | tr '\n' ' ')"
"""


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs `unshare -rm` (user and mount namespaces) to mount a tmpfs")
@pytest.mark.parametrize("kill", ["launcher", "rank", "sigterm", "twice"])
def test_nothing_is_left_in_tmpdir_or_dev_shm_after_any_kill(tmp_path, kill):
    """SIGKILL to the launcher or to a rank, SIGTERM, a second SIGTERM: no process, no file
    in $TMPDIR (the forkserver's socket directory, torch's traceback files) and nothing in
    /dev/shm (a semaphore the resource tracker would remove with a "leaked semaphore"
    warning) outlives the run."""
    run, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen(["unshare", "-rm", "sh", "-c", _KILL, "sh", *RECPIPE, *overrides(run)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env=_env(T=str(tmp), TMPDIR=str(tmp), CKPT=str(run / "ckpt"), KILL=kill))
    try:
        out, _ = finish(proc, timeout=300)
    finally:
        members = _group_members(proc.pid)
        _kill_group(proc.pid)
    err = Path(f"{tmp}.err").read_text()
    left = [line for line in out.splitlines() if line.startswith("left:")]
    assert left == ["left: "], (out[-2000:], err[-3000:])
    assert "leaked" not in err and "resource_tracker" not in err, err[-3000:]
    assert not members, "a process of the run outlived it"


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs `unshare -rm` (user and mount namespaces) to mount a tmpfs")
def test_a_run_dir_that_fills_up_while_training_is_one_line(tmp_path):
    """TensorBoard's writer thread meets the full disk first: its traceback is not printed
    (the run reports it in one line at the next scalar)."""
    run = tmp_path / "run"
    out = _on_full_tmpfs(run, f"after:{run / 'summary.json'}",  # "running" from the first step on
                         [*RECPIPE, *overrides(run, "train.log_every=1", f"checkpoint.dir={tmp_path / 'ckpt'}")])
    assert out.returncode == EXIT_CHECKPOINT, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(f"recpipe train: rank 0: cannot write logging.run_dir={str(run)!r} ("), lines[-3:]
    assert lines[-1].endswith(f"No space left on device [exit {EXIT_CHECKPOINT}]"), lines[-3:]
    assert "Exception in thread" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]


@pytest.mark.slow
def test_a_run_killed_by_a_second_signal_leaves_no_earlier_summary(tmp_path):
    from process_harness import interrupt

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text('{"status": "completed", "steps": 999}')  # an earlier run's

    def twice(proc, ranks):
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.3)  # past the repeat window: a second signal
        proc.send_signal(signal.SIGTERM)

    proc, _, err = interrupt(run, twice)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    # preempted: the ranks were done before the second signal; killed: the launcher says it for them
    assert summary["status"] in ("killed", "preempted") and summary["steps"] != 999, summary


# ----------------------------------------------------------------- data convert and signals
def _big_tsv(path: Path, lines: int) -> Path:
    row = "\t".join(["1", *["3"] * 13, *["0000abcd"] * 26]) + "\n"
    with open(path, "w") as fh:
        fh.write(row * lines)
    return path


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for t in os.listdir(f"/proc/{pid}/task")
                for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_data_convert_stopped_by_a_signal_says_so_and_leaves_no_worker(tmp_path, sig):
    files = [str(_big_tsv(tmp_path / f"day_{i}.tsv", 400_000)) for i in range(2)]
    cmd = [sys.executable, "-m", "recpipe", "data", "convert", "--config", str(CONFIG), "--no-progress", "--workers",
           "2", "--out", str(tmp_path / "bin"), *files]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)
    try:
        end = time.monotonic() + 120
        while len(workers := [c for c in _children(proc.pid) if "resource_tracker" not in cmdline(c)]) < 2:
            assert proc.poll() is None and time.monotonic() < end, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.5)
        proc.send_signal(sig)
        _, err = finish(proc, timeout=60)
        end = time.monotonic() + 5
        while [w for w in workers if alive(w)] and time.monotonic() < end:
            time.sleep(0.05)
        left = [w for w in workers if alive(w)]
    finally:
        _kill_group(proc.pid)
    assert not left, "a worker outlived the conversion"
    if sig == signal.SIGTERM:
        assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
        assert err.strip().splitlines()[-1].startswith("recpipe data convert: stopped by SIGTERM after converting "), err
        assert "Traceback" not in err, err[-3000:]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)  # the same command resumes
    assert out.returncode == 0, out.stderr[-3000:]
    assert "800,000 rows in 2 parts" in out.stdout, out.stdout
