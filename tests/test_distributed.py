"""Process-group lifetime: recpipe leaves its process groups while the interpreter
is alive, so no Gloo thread outlives them into interpreter shutdown (where it can
abort a run that has succeeded: "terminate called without an active exception").
launch_local's supervision: a rank killed with SIGKILL ends the others and is named;
a signal delivered twice within a second is one; a second signal ends every rank at
once; no rank outlives the launcher, even one killed with SIGKILL (whose directory
lock the next run then takes over); no rank's traceback file is left behind. The
launcher uses no private name of multiprocessing or sys (a Python release may rename
one)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from process_harness import alive, interrupt
from recpipe.distributed import shutdown_process_group
from recpipe.launcher import launch_local
from recpipe.groups import graph_holds_collectives
from recpipe.exit_codes import EXIT_PREEMPTED, EXIT_WORKER_FAILED
from recpipe.run_lock import DirLock

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def _gloo_threads() -> list[str]:
    names = (open(f"/proc/self/task/{tid}/comm").read().strip() for tid in os.listdir("/proc/self/task"))
    return [name for name in names if name in GLOO_THREADS]


class _Holder:
    """Like torchrec's sharded modules: holds the group, inside a reference cycle."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.me = self


def _worker() -> None:
    dist.init_process_group("gloo")  # env:// from launch_local
    holder = _Holder(dist.group.WORLD)
    flag = torch.ones(1)
    dist.all_reduce(flag, group=holder.group, async_op=True).wait()
    assert flag.item() == dist.get_world_size()
    assert _gloo_threads(), "no Gloo threads found: the check below would prove nothing"

    dist.destroy_process_group()
    del holder
    # The premise: destroy_process_group alone leaves the cyclically held group, and
    # its threads, alive.
    assert _gloo_threads(), "destroy_process_group freed the group by itself"

    shutdown_process_group()
    assert not _gloo_threads(), f"Gloo threads outlive shutdown_process_group: {_gloo_threads()}"


def test_shutdown_frees_cyclically_held_groups_and_their_threads():
    launch_local(_worker, 2)


class _Graph:
    """Stands for a torch.cuda.CUDAGraph that captured collectives (its reset is all shutdown uses)."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def reset(self) -> None:
        self.events.append("reset" if dist.is_initialized() else "reset after the groups were gone")


def test_shutdown_resets_graphs_that_captured_collectives_before_leaving_the_groups(monkeypatch):
    """NCCL's communicator destruction waits forever for a live graph that captured its
    work; shutdown resets every such graph first, even one its owner still holds."""
    events: list[str] = []
    held = _Graph(events)  # still referenced: a pipeline that outlives the run
    graph_holds_collectives(held)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: events.append("destroy"))
    shutdown_process_group()
    assert events == ["reset", "destroy"]
    shutdown_process_group()  # a graph is reset once
    assert events == ["reset", "destroy", "destroy"]


# ------------------------------------------------- launch_local's supervision
def test_a_failed_launch_leaves_no_traceback_file(tmp_path, monkeypatch):
    """torch.multiprocessing gives each rank a file for its traceback in the temporary
    directory; the launcher reports one rank and removes every rank's file."""
    from torch.multiprocessing.spawn import ProcessExitedException

    from fault_data import fail_unevenly

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ProcessExitedException) as failed:
        launch_local(fail_unevenly, 2)
    assert (failed.value.error_index, failed.value.exit_code) == (0, 5)
    assert not list(tmp_path.glob("pytorch-errorfile-*"))




def test_nccl_graph_registration_is_off_for_a_step_graph_unless_set(monkeypatch):
    from recpipe.config import load_config
    from recpipe.distributed import NCCL_GRAPH_REGISTER_ENV, apply_nccl_graph_register, init_process_group

    monkeypatch.delenv(NCCL_GRAPH_REGISTER_ENV, raising=False)
    assert apply_nccl_graph_register(False) is None
    assert NCCL_GRAPH_REGISTER_ENV not in os.environ  # nothing captures collectives: NCCL's default
    assert apply_nccl_graph_register(True) == "0" and os.environ[NCCL_GRAPH_REGISTER_ENV] == "0"
    monkeypatch.setenv(NCCL_GRAPH_REGISTER_ENV, "1")
    assert apply_nccl_graph_register(True) == "1"  # the user's choice wins
    # what joining a step-graph job's process group applies
    from recpipe import deterministic
    from recpipe.distributed import ALLOC_CONF_ENV

    monkeypatch.delenv(NCCL_GRAPH_REGISTER_ENV)
    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)  # init_process_group may set it: restored after
    monkeypatch.setattr("torch.distributed.is_initialized", lambda: True)  # the group itself is not the point
    with deterministic.kept():
        init_process_group(load_config(None, ["pipeline.name=sparse_dist", "pipeline.step_graph=true"]))
    assert os.environ[NCCL_GRAPH_REGISTER_ENV] == "0"


def test_the_first_traceback_is_reported_whichever_rank_ends_first(tmp_path, monkeypatch):
    """A rank's peers fail only once it is gone, after its traceback is written: the report
    is the earliest traceback, even when the peer's process ends first."""
    from torch.multiprocessing.spawn import ProcessRaisedException

    from fault_data import fail_first_but_exit_last

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ProcessRaisedException) as failed:
        launch_local(fail_first_but_exit_last, 2)
    assert failed.value.error_index == 1, str(failed.value)
    assert "the first failure, on rank 1" in str(failed.value) and "Connection closed" not in str(failed.value)
    assert not list(tmp_path.glob("pytorch-errorfile-*"))


@pytest.mark.slow
def test_a_killed_rank_ends_the_others_and_is_named(tmp_path):
    killed_at = []

    def kill_rank_1(proc, ranks):
        os.kill(ranks[1], signal.SIGKILL)
        killed_at.append(time.monotonic())

    proc, ranks, err = interrupt(tmp_path / "run", kill_rank_1)
    assert proc.returncode == EXIT_WORKER_FAILED
    assert time.monotonic() - killed_at[0] < 15
    assert "rank 1 failed" in err and "SIGKILL" in err, err[-3000:]
    assert not [pid for pid in ranks.values() if alive(pid)]


STUBBORN = """
import os, signal, sys, time
from torch.multiprocessing.spawn import ProcessExitedException
from recpipe.launcher import launch_local

def stubborn():  # takes note of SIGTERM and goes on, like a rank in a long save
    rank = os.environ["RANK"]
    signal.signal(signal.SIGTERM, lambda *_: print(f"rank {rank} got SIGTERM", file=sys.stderr, flush=True))
    print(f"rank {rank} is pid {os.getpid()}", file=sys.stderr, flush=True)
    while True:
        time.sleep(0.05)

if __name__ == "__main__":
    try:
        launch_local(stubborn, 2)
    except ProcessExitedException as err:
        sys.exit(err.exit_code)
"""


def _read_until(proc: subprocess.Popen, needles: list[str], seen: list[str], timeout: float = 120.0) -> str:
    """Read ``proc``'s stderr (unbuffered) into ``seen`` until it holds every needle."""
    end = time.monotonic() + timeout
    while not all(n in "".join(seen) for n in needles):
        assert time.monotonic() < end, f"{needles} not seen in {timeout} s: {''.join(seen)}"
        if select.select([proc.stderr], [], [], 0.5)[0]:
            seen.append(os.read(proc.stderr.fileno(), 65536).decode())
    return "".join(seen)


@pytest.mark.slow
def test_a_second_signal_ends_every_rank_at_once(tmp_path):
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    proc = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE, bufsize=0)
    seen: list[str] = []
    try:
        started = _read_until(proc, ["rank 0 is pid", "rank 1 is pid"], seen)
        ranks = [int(line.split()[-1]) for line in started.splitlines() if " is pid " in line]
        first = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # forwarded; the ranks go on
        proc.send_signal(signal.SIGTERM)  # the same one delivered again (the group, then a wrapper): not forwarded
        _read_until(proc, ["rank 0 got SIGTERM", "rank 1 got SIGTERM"], seen)
        time.sleep(max(0.0, first + 1.2 - time.monotonic()))  # past the repeat window
        assert all(alive(pid) for pid in ranks)
        proc.send_signal(signal.SIGTERM)  # the second: every rank ends now
        proc.wait(timeout=60)
        err = "".join(seen) + proc.stderr.read().decode()
    finally:
        proc.kill()
    assert proc.returncode == EXIT_PREEMPTED
    assert err.count("rank 0 got SIGTERM") == err.count("rank 1 got SIGTERM") == 1, err
    assert err.count("second SIGTERM: ending every rank now") == 1, err
    assert not [pid for pid in ranks if alive(pid)]


@pytest.mark.slow
def test_a_killed_launcher_takes_its_ranks_along_and_its_lock_is_taken_over(tmp_path):
    run = tmp_path / "run"
    # Started like a background job (SIGINT ignored), where torch's own parent-death
    # signal (SIGINT) did nothing and the ranks trained on as orphans.
    left = []

    def kill_the_launcher(proc, ranks):
        proc.kill()
        end = time.monotonic() + 10
        while [pid for pid in ranks.values() if alive(pid)] and time.monotonic() < end:
            time.sleep(0.05)
        left.extend(pid for pid in ranks.values() if alive(pid))
        for pid in left:  # orphans hold the output pipes: end them so the test can fail at once
            os.kill(pid, signal.SIGKILL)

    proc, ranks, _ = interrupt(run, kill_the_launcher, background=True)
    assert not left, "ranks outlived a SIGKILLed launcher"
    with pytest.warns(UserWarning, match=f"taking over the lock left by pid {proc.pid} on host"):
        DirLock(run, "logging.run_dir").acquire().release()


# ------------------------------------------------- the launcher on public interfaces
LAUNCHER_MODULES = ("recpipe/launcher.py", "recpipe/launch_preload.py")


def _private_uses(source: str) -> set[str]:
    """Names a module takes from multiprocessing or sys that are private (a leading
    underscore, or a name imported from a module that does not list it in ``__all__``):
    what a Python release may rename without notice."""
    import ast
    import importlib

    tree = ast.parse(source)
    modules: dict[str, str] = {}  # local name -> the module it is
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("multiprocessing", "sys"):
                    local = alias.asname or alias.name.split(".")[0]
                    modules[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "multiprocessing":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                try:
                    importlib.import_module(full)
                    modules[alias.asname or alias.name] = full  # a submodule
                except ImportError:
                    if alias.name.startswith("_") or alias.name not in importlib.import_module(node.module).__all__:
                        found.add(full)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.insert(0, base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules and any(part.startswith("_") for part in chain):
                found.add(f"{modules[base.id]}.{'.'.join(chain)}")
    return found


@pytest.mark.parametrize("path", LAUNCHER_MODULES)
def test_the_launcher_uses_no_private_name_of_multiprocessing_or_sys(path):
    from pathlib import Path

    assert _private_uses((Path(__file__).resolve().parents[1] / path).read_text()) == set()


def test_the_private_name_check_finds_them():
    """The check above can fail: on the launcher's former code, as it read."""
    former = """
import sys
from multiprocessing import forkserver, resource_tracker
fd = forkserver._forkserver._forkserver_alive_fd
tracker = resource_tracker._resource_tracker
frame = sys._getframe()
"""
    assert _private_uses(former) == {
        "multiprocessing.forkserver._forkserver", "multiprocessing.forkserver._forkserver._forkserver_alive_fd",
        "multiprocessing.resource_tracker._resource_tracker", "sys._getframe"}
    assert _private_uses("from multiprocessing.forkserver import _forkserver") == {"multiprocessing.forkserver._forkserver"}
