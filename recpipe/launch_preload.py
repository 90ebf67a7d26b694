"""The forkserver of :func:`recpipe.launcher.launch_local`: :func:`start_server`, and what
the server imports once, before it forks any rank (``set_forkserver_preload``): the modules
every rank imports, so that a rank starts as a fork of a process that has them (a fork
is cheap) instead of importing them anew (seconds of CPU each: torch, fbgemm-gpu,
torchrec, recpipe's trainer).

``recpipe train`` starts the server first thing (``recpipe.cli``, before it imports torch
for its own checks), so the server's imports run while the launcher imports torch and
checks the config, instead of after (the launcher, which runs no rank, never imports the
trainer, torchmetrics or TensorBoard): the ranks start right after the
checks, and the first timed step comes sooner, where the machine has cores to spare
(``startup`` in summary.json times each phase). Where other work keeps the cores busy
the two processes share them, and the launcher's own imports take longer.

This module's top imports nothing heavy: the launcher imports it before torch.

It acts only in the server, which finds ``SERVER_ENV`` in its environment (the
launcher sets it while it starts the server, and a rank's environment is the
launcher's): ``"<launcher pid>:<multiprocessing's temporary directory of the launcher>"``.
There:

* The stop signals (SIGTERM, SIGINT, SIGHUP: ``recpipe.stop_requests.SIGNALS``) are
  blocked. A SIGTERM to the whole process group, as schedulers deliver it (or the
  SIGHUP of a closed terminal), must reach the ranks and the launcher (which drain and
  save), not end the server, whose end the launcher would read as every rank gone and
  the ranks as their parent gone. A rank inherits the mask: a signal sent to it before it handles signals
  waits until it does (``recpipe.stop_requests``), where an ignored one was lost.
* The server dies with its launcher (``PR_SET_PDEATHSIG``, with ``DEATH_SIGNAL``, a
  real-time signal nothing else sends): its handler removes the launcher's temporary
  directory, where multiprocessing put the server's socket and which a launcher killed
  with SIGKILL cannot remove, and exits; the kernel then ends the ranks
  (``recpipe.system.die_with_parent``).
* It must not initialize CUDA: a process forked from one that did cannot use it.
  fbgemm-gpu asks ``torch.cuda.is_available()`` when it is imported, which initializes
  the CUDA driver unless torch counts the devices through NVML
  (``PYTORCH_NVML_BASED_CUDA_CHECK=1``); so it does during these imports, in the server
  only.

Nothing here may raise: the server would die with it. A module that fails to import is
left to the rank, which then imports it itself and reports the error.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
from multiprocessing import forkserver, util

from recpipe.system import signal_when_parent_dies

MODULES = ("torch", "fbgemm_gpu", "torchrec", "torchrec.distributed", "recpipe.launcher", "recpipe.train.trainer")
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
SERVER_ENV = "RECPIPE_FORKSERVER_OF"
DEATH_SIGNAL = getattr(signal, "SIGRTMIN", signal.SIGUSR2)  # real-time signals: Linux


def _serve_only_while_the_launcher_lives(launcher_pid: int, temp_dir: str) -> None:
    server = os.getpid()

    def launcher_gone(signum: int, frame: object) -> None:
        if os.getpid() != server:  # a rank forked with this handler: not the server's to act on
            return
        shutil.rmtree(temp_dir, ignore_errors=True)
        os._exit(0)

    signal.signal(DEATH_SIGNAL, launcher_gone)
    if not signal_when_parent_dies(DEATH_SIGNAL):  # not Linux: the server ends when its "alive" pipe closes
        return
    if os.getppid() != launcher_pid:  # it died before the prctl took effect
        launcher_gone(DEATH_SIGNAL, None)


def _import_for_the_ranks() -> None:
    check = os.environ.get(NVML_CHECK)
    os.environ[NVML_CHECK] = "1"
    for name in MODULES:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001: the rank imports it again and reports the error
            pass
    if check is None:
        del os.environ[NVML_CHECK]
    else:
        os.environ[NVML_CHECK] = check


def under_torchrun() -> bool:
    """Whether this process is a rank that torchrun started (no forkserver then)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def start_server() -> None:
    """multiprocessing's forkserver (public API), with this module as its preload; a no-op
    while it runs. The server is started here, not at the first fork, so that it finds in
    its environment the launcher's pid and multiprocessing's temporary directory of this
    process, where its socket lives (``SERVER_ENV``): it ends when this process (the thread
    that starts it) does, however it ends, and removes that directory first, so that a
    launcher killed with SIGKILL leaves nothing running and nothing in $TMPDIR. It must
    start from a thread that lives as long as the launches (the main thread); one started
    by a thread that has ended is started anew."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(["recpipe.launch_preload"])
    os.environ[SERVER_ENV] = f"{os.getpid()}:{util.get_temp_dir()}"
    try:
        forkserver.ensure_running()  # a no-op while the server runs
    finally:
        del os.environ[SERVER_ENV]


if SERVER_ENV in os.environ:
    from recpipe.stop_requests import SIGNALS

    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    _pid, _dir = os.environ[SERVER_ENV].split(":", 1)
    _serve_only_while_the_launcher_lives(int(_pid), _dir)
    _import_for_the_ranks()
