"""Operating-system helpers and names that import no torch: the layers below the
training (the planner, the data loaders' producer processes, the launcher's forkserver)
use them, so ``recpipe plan`` and the data commands load without torch.
"""

from __future__ import annotations

import ctypes
import glob
import os
import signal
import sys

from recpipe.exit_codes import EXIT_WORKER_FAILED

# PyTorch's caching-allocator settings; the user's value wins over train.cuda_alloc_conf
# (recpipe.distributed.apply_cuda_alloc_conf), and the planner reads the one in force.
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"

_PR_SET_PDEATHSIG = 1


def signal_when_parent_dies(signum: int) -> bool:
    """Linux: have the kernel send ``signum`` to this process when the thread that forked it
    ends, however it ends. False where the call is not available (not Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
    except (OSError, AttributeError):
        return False
    return True


def die_with_parent(parent_pid: int) -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies, however it
    dies (torch's spawn asks for SIGINT, which a job started in the background
    ignores, so the ranks of a killed launcher trained on as orphans). Call first
    thing in the child; ``parent_pid`` is the parent's pid, read before the fork. The
    kernel acts when the parent *thread* that forked this process ends: fork from
    a thread that lives as long as the child should (the main thread)."""
    if not signal_when_parent_dies(signal.SIGKILL):  # not Linux: the parent's own cleanup still applies
        return
    if os.getppid() != parent_pid:  # it died before the prctl took effect
        os._exit(EXIT_WORKER_FAILED)


def may_have_gpu() -> bool:
    """False where this Linux machine has no GPU device node (NVIDIA's ``/dev/nvidia<N>``,
    AMD's ``/dev/kfd``, WSL's ``/dev/dxg``), so that ``torch.cuda.is_available()`` is
    False: known without importing torch. True elsewhere: only torch can tell."""
    if sys.platform != "linux":
        return True
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg")


def local_world_size(world_size: int) -> int:
    """Ranks on this host: the launcher's ``LOCAL_WORLD_SIZE`` (torchrun, ``recpipe train``)
    when it divides ``world_size``, else every rank on one host (``recpipe plan``, which
    plans one host)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
    return local if 0 < local <= world_size and world_size % local == 0 else world_size
