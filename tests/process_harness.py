"""Shared by the fault tests: start a real ``recpipe train`` (launcher or torchrun) on a
tiny config, wait for its checkpoints, and find or check its processes through /proc
(no psutil)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import yaml

TESTS = Path(__file__).resolve().parent
CONFIG = TESTS.parent / "configs" / "quickstart.yaml"
# A step in milliseconds; a row-wise and a column-wise table.
TINY_MODEL = [
    "model.num_embeddings_per_feature=[100, 300, 500, 1000]",
    "model.embedding_dim=8",
    "model.dense_arch_layer_sizes=[16, 8]",
    "model.over_arch_layer_sizes=[16, 1]",
    "sharding.tables={t_cat_1: {type: row_wise}, t_cat_2: {type: column_wise}}",
    "data.batch_size=64",
]
# Tiny and endless: 4 batches per epoch (so a stop lands inside an epoch), a
# checkpoint every 4 steps to know that training is under way.
ENDLESS = [
    *TINY_MODEL,
    "optimizer.dense.name=adam",
    "data.synthetic.num_batches=4",
    "data.synthetic.num_eval_batches=1",
    "train.epochs=100000",
    "train.steps=100000000",
    "train.eval_every=0",
    "train.log_every=5",
    "train.progress=false",
    "checkpoint.every=4",
]


def overrides(run: Path, *extra: str) -> list[str]:
    """``--set`` arguments: ``ENDLESS`` into ``run`` (checkpoints in run/ckpt), then ``extra``."""
    args = []
    for pair in [*ENDLESS, f"logging.run_dir={run}", f"checkpoint.dir={run / 'ckpt'}", *extra]:
        args += ["--set", pair]
    return args


def _as_background_job() -> None:
    """What a non-interactive shell does to a job started with ``&``: SIGINT ignored
    (inherited by every process it starts)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# torchrun's arguments for two ranks on this host; through torch, or through ``recpipe torchrun``.
TORCHRUN_ARGS = ["--standalone", "--nproc-per-node", "2"]
LAUNCHERS = {"torch": ["-m", "torch.distributed.run", *TORCHRUN_ARGS], "recpipe": ["-m", "recpipe", "torchrun", *TORCHRUN_ARGS]}


def start(run: Path, *extra: str, torchrun: bool | str = False, background: bool = False,
          config: Path = CONFIG) -> subprocess.Popen:
    """``torchrun``: True (or "torch") for torch's torchrun, "recpipe" for ``recpipe torchrun``."""
    chosen = LAUNCHERS["torch" if torchrun is True else torchrun] if torchrun else []
    launcher = [sys.executable, *chosen]
    cmd = [*launcher, "-m", "recpipe", "train", "--config", str(config), *overrides(run, *extra)]
    # The tests' own modules (fault_data's factories) importable by the run
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(TESTS)]))}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=_as_background_job if background else None)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"exited with {proc.returncode} before {path} appeared:\n{out[-2000:]}\n{err[-4000:]}")
        assert time.monotonic() < end, f"{path} did not appear in {timeout} s"
        time.sleep(0.02)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) from /proc, or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")  # a zombie has ended


def descendants(pid: int) -> list[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            parents[int(entry)] = stat[1]
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        children = [p for p, pp in parents.items() if pp == parent]
        found += children
        todo += children
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _environ_rank(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def ranks_of(pid: int, torchrun: bool = False, nproc: int = 2, timeout: float = 60.0) -> dict[int, int]:
    """{rank: pid} of the ``nproc`` training ranks under launcher ``pid``. torchrun puts
    RANK in each worker's environment at exec; ``launch_local``'s forkserver (the
    launcher's child) forks rank 0 then rank 1 (its children, in pid order), which set
    RANK only later."""
    end = time.monotonic() + timeout
    while True:
        if torchrun:
            ranks = {r: p for p in descendants(pid) if (r := _environ_rank(p)) is not None}
        else:
            servers = [p for p in descendants(pid) if "multiprocessing.forkserver" in cmdline(p)
                       and (stat := _stat(p)) is not None and stat[1] == pid]
            ranks = dict(enumerate(sorted(p for s in servers for p in descendants(s)
                                          if (stat := _stat(p)) is not None and stat[1] == s)))
        if len(ranks) >= nproc or time.monotonic() > end:
            return ranks
        time.sleep(0.05)


def interrupt(
    run: Path,
    act: Callable[[subprocess.Popen, dict[int, int]], None],
    *extra: str,
    torchrun: bool = False,
    nproc: int = 2,
    background: bool = False,
    timeout: float = 180.0,
    config: Path = CONFIG,
) -> tuple[subprocess.Popen, dict[int, int], str]:
    """Start an endless run into ``run``; once training is under way (its step-4
    checkpoint exists) call ``act(process, {rank: pid})``; wait up to ``timeout``
    for the end. Returns the process, the ranks' pids and its stderr. Whatever
    happens, nothing it started is left running."""
    proc = start(run, *extra, torchrun=torchrun, background=background, config=config)
    ranks: dict[int, int] = {}
    try:
        wait_for(run / "ckpt" / "step_00000004" / "metadata.json", proc)
        ranks = ranks_of(proc.pid, torchrun=torchrun, nproc=nproc)
        assert sorted(ranks) == list(range(nproc)), ranks
        act(proc, ranks)
        _, err = finish(proc, timeout, also_kill=list(ranks.values()))
    finally:
        proc.kill()
        _kill(list(ranks.values()))
    return proc, ranks, err


def _kill(pids: list[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def finish(proc: subprocess.Popen, timeout: float = 180.0, also_kill: list[int] = ()) -> tuple[str, str]:
    """Wait for ``proc``; past ``timeout`` kill it and ``also_kill`` (its ranks,
    which hold its output pipes open even after it is gone) and fail."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _kill(list(also_kill))
        out, err = proc.communicate()
        raise AssertionError(f"still running after {timeout} s:\n{out[-2000:]}\n{err[-4000:]}") from None


def factory_config(directory: Path) -> Path:
    """configs/quickstart.yaml without its ``data.source``, for a run whose batches come
    from a ``data.factory`` (the two name the data; one may be set)."""
    raw = yaml.safe_load(CONFIG.read_text())
    del raw["data"]["source"]
    path = directory / "factory.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path
