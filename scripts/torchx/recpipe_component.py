"""A TorchX component for ``recpipe train`` on Kubernetes, Slurm, AWS Batch, ... (docs/multi_node.md).

It is TorchX's own ``dist.ddp`` (one torchrun per node, c10d rendezvous on the first
node's ``rdzv_port``) running ``python -m recpipe train --config CONFIG [--set ...]``,
with a torchrun shutdown timeout long enough for recpipe to save a checkpoint when
the scheduler preempts the job. With torchx installed (``pip install torchx``):

    torchx run -s kubernetes -cfg queue=default,namespace=recs \\
        scripts/torchx/recpipe_component.py:train \\
        --config configs/dlrm_gpu.yaml --j 2x8 --image registry/recpipe:latest \\
        --mounts type=volume,src=recpipe-runs,dst=/runs \\
        -- checkpoint.dir=/runs/ckpt logging.run_dir=/runs/log train.steps=20000

    torchx run -s slurm scripts/torchx/recpipe_component.py:train --config configs/dlrm_gpu.yaml --j 2x8

The trailing arguments are ``--set`` overrides. ``checkpoint.dir`` and
``logging.run_dir`` must be on storage every node mounts; with ``max_retries`` the
scheduler restarts a failed or preempted job, which resumes from the newest
checkpoint. This file imports nothing from torchx until the component is called.
"""

from typing import Dict, List, Optional


def train(
    *overrides: str,
    config: str = "configs/dlrm_gpu.yaml",
    j: str = "2x8",
    image: str = "recpipe:latest",
    gpu: int = 8,
    cpu: int = 64,
    memMB: int = 491520,
    h: Optional[str] = None,
    rdzv_port: int = 29500,
    max_retries: int = 3,
    shutdown_timeout: int = 240,
    mounts: Optional[List[str]] = None,
    env: Optional[Dict[str, str]] = None,
) -> "AppDef":
    """recpipe training, one torchrun per node (TorchX's dist.ddp).

    Args:
        overrides: config overrides KEY=VALUE, each passed to recpipe as --set KEY=VALUE
        config: the YAML config, a path inside the image (or the working directory)
        j: {nnodes}x{nproc_per_node}, e.g. 2x8 for 2 nodes of 8 GPUs
        image: container image with recpipe and its dependencies
        gpu: GPUs per node
        cpu: CPUs per node
        memMB: host memory per node in MB
        h: a registered named resource (instead of cpu, gpu, memMB)
        rdzv_port: port of torchrun's c10d rendezvous store on the first node
        max_retries: scheduler restarts of a failed or preempted job (each resumes from the newest checkpoint)
        shutdown_timeout: seconds torchrun gives the ranks after a SIGTERM to finish the step and save
        mounts: mounts for the shared checkpoint and run directories (type=volume,src=...,dst=...)
        env: extra environment variables (e.g. NCCL_SOCKET_IFNAME=eth0)
    """
    from torchx.components.dist import ddp  # only when the component is used

    args = ["train", "--config", config]
    for override in overrides:
        args += ["--set", override]
    environment = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(shutdown_timeout), **(env or {})}
    return ddp(
        *args,
        m="recpipe",
        j=j,
        image=image,
        gpu=gpu,
        cpu=cpu,
        memMB=memMB,
        h=h,
        rdzv_port=rdzv_port,
        max_retries=max_retries,
        mounts=mounts,
        env=environment,
        name="recpipe/train",
    )
