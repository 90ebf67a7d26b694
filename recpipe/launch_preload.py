"""Imported once by the forkserver of :func:`recpipe.distributed.launch_local`, before it
forks any rank: the modules every rank imports, so that a rank starts as a fork of a
process that has them (about 0.03 s) instead of importing them anew (about 6 s of CPU
each: torch, fbgemm-gpu, torchrec, recpipe's trainer; 2 ranks on 2 cores, 7.4 s a launch).

In that server process alone, SIGTERM is ignored. The server lives as long as the process
that launches (it exits when that one does), and the ranks are its children: a SIGTERM to
the whole process group, as schedulers deliver it, must reach the ranks and the launcher
(which drain and save), not end the server, whose end the launcher would read as every
rank gone and the ranks as their parent gone (SIGKILL, ``die_with_parent``). SIGINT the
server ignores already (multiprocessing's forkserver). A rank sets its own dispositions
first thing (``recpipe.distributed``).

The server must not initialize CUDA: a process forked from one that did cannot use it.
fbgemm-gpu asks ``torch.cuda.is_available()`` when it is imported, which initializes the
CUDA driver unless torch counts the devices through NVML
(``PYTORCH_NVML_BASED_CUDA_CHECK=1``); so it does during these imports, in the server only.

Nothing here may raise: the server would die with it. A module that fails to import is
left to the rank, which then imports it itself and reports the error.
"""

from __future__ import annotations

import os
import signal
import sys
from multiprocessing import forkserver

MODULES = ("torch", "fbgemm_gpu", "torchrec", "torchrec.distributed", "recpipe.train.trainer")
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def in_forkserver() -> bool:
    """Whether this import runs inside multiprocessing's forkserver (its ``main``)."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


if in_forkserver():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _check = os.environ.get(NVML_CHECK)
    os.environ[NVML_CHECK] = "1"
    for _name in MODULES:
        try:
            __import__(_name)
        except Exception:  # noqa: BLE001: the rank imports it again and reports the error
            pass
    if _check is None:
        del os.environ[NVML_CHECK]
    else:
        os.environ[NVML_CHECK] = _check
