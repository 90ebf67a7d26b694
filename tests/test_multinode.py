"""Multi-node launch on one host: two torchrun node launchers (``--nnodes 2
--nproc-per-node 1``, c10d rendezvous on a local port) both exit 0 and train exactly
what one launcher with 2 ranks trains; the Slurm script and the TorchX component
build the launch command docs/multi_node.md describes."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from test_checkpoint import _full_state

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "quickstart.yaml"
TINY = [
    "model.num_embeddings_per_feature=[100, 300, 500, 1000]",
    "model.embedding_dim=8",
    "model.dense_arch_layer_sizes=[16, 8]",
    "model.over_arch_layer_sizes=[16, 1]",
    "sharding.tables={t_cat_1: {type: row_wise}, t_cat_2: {type: column_wise}}",
    "data.batch_size=64",
    "data.synthetic.num_eval_batches=1",
    "train.steps=4",
    "train.eval_every=0",
    "train.log_every=2",
    "train.progress=false",
]
STEP = "step_00000004"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(run: Path, launcher: list[str]) -> list[str]:
    sets = [arg for pair in [*TINY, f"logging.run_dir={run}", f"checkpoint.dir={run / 'ckpt'}"] for arg in ("--set", pair)]
    return [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "recpipe", "train", "--config", str(CONFIG), *sets]


def _run_all(commands: list[list[str]], timeout: float = 300.0) -> list[tuple[int, str]]:
    # One intra-op thread per rank under both launchers: the same numerics.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in commands]
    out = []
    try:
        for proc in procs:
            text, _ = proc.communicate(timeout=timeout)
            out.append((proc.returncode, text))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


@pytest.mark.slow
def test_two_node_launchers_on_one_host_train_like_one_launcher(tmp_path):
    port = _free_port()
    two = tmp_path / "two_nodes"
    nodes = [_command(two, ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node), "--rdzv-backend", "c10d",
                            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "recpipe-multinode-test"])
             for node in (0, 1)]
    for node, (code, text) in enumerate(_run_all(nodes)):
        assert code == 0, f"node launcher {node} exited {code}:\n{text[-4000:]}"
    one = tmp_path / "one_node"
    [(code, text)] = _run_all([_command(one, ["--standalone", "--nnodes", "1", "--nproc-per-node", "2"])])
    assert code == 0, f"the one launcher exited {code}:\n{text[-4000:]}"

    summaries = [json.loads((run / "summary.json").read_text()) for run in (two, one)]
    assert summaries[0]["world_size"] == summaries[1]["world_size"] == 2
    assert summaries[0]["steps"] == summaries[1]["steps"] == 4
    for key in ("loss", "eval_auc", "eval_loss"):
        assert summaries[0][key] == summaries[1][key], key
    a = _full_state(two / "ckpt" / STEP, tmp_path)
    b = _full_state(one / "ckpt" / STEP, tmp_path)
    assert a.keys() == b.keys() and any("t_cat_1" in k for k in a)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"two node launchers trained differently from one in {different}"


def test_slurm_script_is_valid_bash_and_starts_one_torchrun_per_node(tmp_path):
    """The sbatch script under stub ``scontrol`` / ``srun``: the command it runs on each node."""
    script = ROOT / "scripts" / "slurm" / "train.sbatch"
    bash = shutil.which("bash")
    assert bash is not None
    assert subprocess.run([bash, "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --signal=B:TERM@" in text
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "scontrol").write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && printf 'gpu-a\\ngpu-b\\n'\n")
    (stubs / "srun").write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path / 'srun.args'}\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_NODELIST": "gpu-[a-b]", "SLURM_GPUS_ON_NODE": "8", "CONFIG": "configs/dlrm_gpu.yaml"}
    done = subprocess.run([bash, str(script), "--set", "train.steps=10"], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "srun.args").read_text().split("\n")
    joined = " ".join(args)
    assert "--nnodes 2 --nproc-per-node 8" in joined and "--rdzv-backend c10d --rdzv-endpoint gpu-a:29500" in joined
    assert "--rdzv-id 77" in joined and "-m recpipe train --config configs/dlrm_gpu.yaml --set train.steps=10" in joined


def _load_component():
    spec = importlib.util.spec_from_file_location("recpipe_torchx", ROOT / "scripts" / "torchx" / "recpipe_component.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports without torchx
    return module


def test_torchx_component_runs_recpipe_train_through_dist_ddp(monkeypatch):
    calls = []
    dist = types.ModuleType("torchx.components.dist")
    dist.ddp = lambda *args, **kwargs: calls.append((args, kwargs)) or "appdef"
    for name, module in (("torchx", types.ModuleType("torchx")), ("torchx.components", types.ModuleType("torchx.components")),
                         ("torchx.components.dist", dist)):
        monkeypatch.setitem(sys.modules, name, module)
    component = _load_component()
    assert component.train("train.steps=10", "data.batch_size=4096", config="configs/dlrm_gpu.yaml", j="2x8",
                           image="registry/recpipe:1") == "appdef"
    [(args, kwargs)] = calls
    assert args == ("train", "--config", "configs/dlrm_gpu.yaml", "--set", "train.steps=10", "--set", "data.batch_size=4096")
    assert kwargs["m"] == "recpipe" and kwargs["j"] == "2x8" and kwargs["image"] == "registry/recpipe:1"
    assert kwargs["gpu"] == 8 and int(kwargs["env"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) > 30
