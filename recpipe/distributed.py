"""Process groups and devices: joining the job's process group (env://: torchrun's, or
``recpipe.launcher.launch_local``'s), leaving it, and the job's rendezvous store.
"""

from __future__ import annotations

import faulthandler
import gc
import os
from datetime import timedelta
from typing import Any, TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed import TCPStore

from recpipe.deterministic import apply_deterministic
from recpipe.errors import job_warning
from recpipe.groups import reset_graphs_with_collectives
from recpipe.launch_preload import under_torchrun
from recpipe.system import ALLOC_CONF_ENV

if TYPE_CHECKING:
    from recpipe.config import DistributedConfig, RecpipeConfig, TrainConfig


def torchrun_overrides() -> list[str]:
    """Under torchrun the job's world size is WORLD_SIZE, whatever the YAML says:
    set ``distributed.nproc`` from it before validation, so rules that depend on
    the number of ranks (pinned ranks, column-wise splits) check the real one."""
    return [f"distributed.nproc={os.environ['WORLD_SIZE']}"] if under_torchrun() else []


def resolve_device(train: TrainConfig, local_rank: int) -> torch.device:
    want = train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device='cuda' but no CUDA GPU is visible (torch.cuda.is_available() is False)")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        n = torch.cuda.device_count()
        if local_rank >= n:
            raise RuntimeError(f"local rank {local_rank} has no GPU: only {n} visible")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend_for(distributed: DistributedConfig, device: torch.device) -> str:
    if distributed.backend != "auto":
        return distributed.backend
    return "nccl" if device.type == "cuda" else "gloo"


def apply_cuda_alloc_conf(train: TrainConfig) -> str | None:
    """Give this process the caching-allocator settings of ``train.cuda_alloc_conf``,
    unless ``PYTORCH_CUDA_ALLOC_CONF`` is set (the user's choice wins); returns the
    settings in force. Must run before CUDA is initialized: the allocator reads its
    settings once, at initialization, so after it this only warns."""
    if ALLOC_CONF_ENV in os.environ or train.cuda_alloc_conf is None:
        return os.environ.get(ALLOC_CONF_ENV)
    if torch.cuda.is_initialized():
        job_warning(f"train.cuda_alloc_conf={train.cuda_alloc_conf!r} not applied: CUDA was initialized "
                    f"before recpipe started; set {ALLOC_CONF_ENV} instead", stacklevel=2)
        return None
    os.environ[ALLOC_CONF_ENV] = train.cuda_alloc_conf
    return train.cuda_alloc_conf


# A collective that waits this long fails on the rank: Gloo raises, NCCL's watchdog aborts
# the communicator and ends the process (TORCH_NCCL_ASYNC_ERROR_HANDLING, on unless set to
# 0). The backstop for waits outside training steps (start-up, evaluation, checkpoints); in
# training, a rank that stops making steps ends the job sooner (train.step_timeout_s,
# recpipe.train.watchdog), whatever the backend, since it does not wait for the collective.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


# NCCL registers the buffers of collectives captured in a CUDA graph with their peers
# (NCCL_GRAPH_REGISTER, on by default). With pipeline.step_graph on two H200s (torch 2.11's
# NCCL), whose graph holds the ids' and embeddings' all-to-alls and the dense all-reduce, the
# replays deadlocked on the device within the first steps of nearly every run, with or without
# compile or train.deterministic, and trained with registration off; SGLang found the same
# deadlock of a captured all-to-all (sgl-project/sglang#38936). Off unless the user set it.
NCCL_GRAPH_REGISTER_ENV = "NCCL_GRAPH_REGISTER"


def apply_nccl_graph_register(captures_collectives: bool) -> str | None:
    """Turn NCCL's buffer registration for captured collectives off where this job captures
    collectives (``pipeline.step_graph``), unless ``NCCL_GRAPH_REGISTER`` is set; returns the
    value in force. Before the first communicator: NCCL reads it then."""
    if captures_collectives:
        os.environ.setdefault(NCCL_GRAPH_REGISTER_ENV, "0")
    return os.environ.get(NCCL_GRAPH_REGISTER_ENV)


def init_process_group(cfg: RecpipeConfig) -> torch.device:
    """Join the job's process group (env:// rendezvous) and return this rank's device."""
    apply_cuda_alloc_conf(cfg.train)
    apply_deterministic(cfg.train.deterministic)  # before CUDA starts: cuBLAS reads its setting then
    apply_nccl_graph_register(cfg.pipeline.step_graph.enabled)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(cfg.train, local_rank)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend_for(cfg.distributed, device), "timeout": COLLECTIVE_TIMEOUT}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
    return device


def shutdown_process_group() -> None:
    """Leave every process group now, while the interpreter is fully alive.

    ``destroy_process_group`` only drops torch's own references to the groups. The
    sharded model still holds them (torchrec's ShardingEnv, its all-to-all modules,
    ShardedTensors), and torchrec's modules sit in reference cycles, so after the
    run they are cyclic garbage: without a collection here the groups, and Gloo's
    worker threads, would live until interpreter shutdown, where a Gloo thread that
    releases a tensor with a Python object aborts the process ("terminate called
    without an active exception") after training has succeeded. Collecting the
    cycles runs the groups' destructors, which join those threads, here.

    First, once the device has finished, every CUDA graph that captured collectives
    (``recpipe.groups.graph_holds_collectives``) is reset, whoever still holds it: a replay after
    the groups are gone could not run anyway."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    reset_graphs_with_collectives()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def job_store() -> TCPStore | None:
    """A client of the job's rendezvous store (env://: ``launch_local``'s, or torchrun's agent
    store), for what ranks tell one another outside the process group (it cannot wait for
    a rank that is stuck or gone); None when this process has none to reach."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    try:
        return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                        timeout=timedelta(seconds=30))
    except (RuntimeError, ValueError):  # gone already, or not a TCP store
        return None


def job_key(name: str) -> str:
    """A key of this run in :func:`job_store` (a torchrun job's restarts share its store)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    return f"recpipe/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"


FAILED_EXIT_DEADLINE_S = 30.0


def leave_after_failure() -> None:
    """What a rank does instead of ``shutdown_process_group`` when it fails with an
    exception (a bug, a CUDA error, a failed graph capture): nothing collective. Its peers
    may be waiting for it in a collective; they see it gone when its process ends, after
    its traceback is written, so the first error is the one reported (a goodbye through
    the group would fail their collective first, and could hang under NCCL with work in
    flight). And its process ends within ``FAILED_EXIT_DEADLINE_S`` whatever holds it
    (a thread that never ends, a library's teardown): faulthandler's timer runs in C, with
    no need of the interpreter, and ends the process with exit 1."""
    # faulthandler keeps the file open until the timer fires or is cancelled
    faulthandler.dump_traceback_later(FAILED_EXIT_DEADLINE_S, exit=True, file=open(os.devnull, "w"))  # noqa: SIM115
