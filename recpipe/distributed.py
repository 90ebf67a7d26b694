"""Process groups, devices and local multi-process launch.

``recpipe train`` runs under torchrun as is (it reads RANK/WORLD_SIZE/LOCAL_RANK);
otherwise ``launch_local`` starts ``distributed.nproc`` processes on this machine
with torch.multiprocessing (spawn), which tests use as well.
"""

from __future__ import annotations

import gc
import os
import warnings
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import TCPStore

from recpipe.config import RecpipeConfig


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def torchrun_overrides() -> list[str]:
    """Under torchrun the job's world size is WORLD_SIZE, whatever the YAML says:
    set ``distributed.nproc`` from it before validation, so rules that depend on
    the number of ranks (pinned ranks, column-wise splits) check the real one."""
    return [f"distributed.nproc={os.environ['WORLD_SIZE']}"] if under_torchrun() else []


def resolve_device(cfg: RecpipeConfig, local_rank: int) -> torch.device:
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device='cuda' but no CUDA GPU is visible (torch.cuda.is_available() is False)")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        n = torch.cuda.device_count()
        if local_rank >= n:
            raise RuntimeError(f"local rank {local_rank} has no GPU: only {n} visible")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend_for(cfg: RecpipeConfig, device: torch.device) -> str:
    if cfg.distributed.backend != "auto":
        return cfg.distributed.backend
    return "nccl" if device.type == "cuda" else "gloo"


ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"


def apply_cuda_alloc_conf(cfg: RecpipeConfig) -> str | None:
    """Give this process the caching-allocator settings of ``train.cuda_alloc_conf``,
    unless ``PYTORCH_CUDA_ALLOC_CONF`` is set (the user's choice wins); returns the
    settings in force. Must run before CUDA is initialized: the allocator reads its
    settings once, at initialization, so after it this only warns."""
    if ALLOC_CONF_ENV in os.environ or cfg.train.cuda_alloc_conf is None:
        return os.environ.get(ALLOC_CONF_ENV)
    if torch.cuda.is_initialized():
        warnings.warn(f"train.cuda_alloc_conf={cfg.train.cuda_alloc_conf!r} not applied: CUDA was initialized "
                      f"before recpipe started; set {ALLOC_CONF_ENV} instead", stacklevel=2)
        return None
    os.environ[ALLOC_CONF_ENV] = cfg.train.cuda_alloc_conf
    return cfg.train.cuda_alloc_conf


def init_process_group(cfg: RecpipeConfig) -> torch.device:
    """Join the job's process group (env:// rendezvous) and return this rank's device."""
    apply_cuda_alloc_conf(cfg)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(cfg, local_rank)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend_for(cfg, device), "timeout": timedelta(minutes=10)}
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
    cycles runs the groups' destructors, which join those threads, here."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _child(local_rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # Connect to the parent's store as clients (env:// then never binds a port).
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    # Two ranks on a 2-core machine: one intra-op thread each, or they fight.
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    try:
        fn(*args)
    finally:
        shutdown_process_group()


def launch_local(fn: Callable[..., Any], nproc: int, *args: Any) -> None:
    """Run ``fn(*args)`` in ``nproc`` fresh processes that form one process group
    (the caller's ``fn`` calls ``init_process_group``). Raises if any rank fails.

    The rendezvous store lives in this process on a port the OS picks, so
    concurrent launches on one machine never race for a port."""
    store = TCPStore("127.0.0.1", 0, world_size=nproc, is_master=True, wait_for_workers=False)
    try:
        mp.start_processes(_child, args=(nproc, store.port, fn, args), nprocs=nproc, join=True, start_method="spawn")
    finally:
        del store
