"""Multi-node launch on one host: two torchrun node launchers (``--nnodes 2
--nproc-per-node 1``, c10d rendezvous on a local port) both exit 0 and train exactly
what one launcher with 2 ranks trains; the Slurm script and the TorchX component
build the launch command docs/multi_node.md describes."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
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
    for key in ("loss", "eval_auc", "eval_logloss"):
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



# Slurm's side of a signal, reproduced for the test (Slurm's src/srun/signals.c, scancel(1)):
# srun turns a SIGTERM, SIGHUP or SIGQUIT it receives into a SIGKILL of every task
# ("forcing job termination"); a first SIGINT only prints the tasks' status and a second
# within a second is forwarded; any other signal is forwarded as it is. srun exits with
# its task's exit code, or 128 + the signal that ended it. The task runs on another node:
# not in the batch shell's process group.
FAKE_SRUN = """#!{python}
import os, signal, subprocess, sys, time
out = os.environ["FAKE_SLURM_OUT"]
argv = sys.argv[1:]
while argv and argv[0].startswith("-"):  # srun's own options, all --key=value here
    argv.pop(0)
task = subprocess.Popen(argv, start_new_session=True)
with open(os.path.join(out, "task.pids"), "w") as f:
    f.write(str(task.pid))
last_int = [0.0]

def on_signal(signum, frame):
    with open(os.path.join(out, "srun.signals"), "a") as f:
        f.write(signal.Signals(signum).name + "\\n")
    if signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        task.send_signal(signal.SIGKILL)
    elif signum == signal.SIGINT:
        if time.monotonic() - last_int[0] < 1.0:
            task.send_signal(signal.SIGINT)
        last_int[0] = time.monotonic()
    else:
        task.send_signal(signum)

for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(signum, on_signal)
code = task.wait()
sys.exit(128 - code if code < 0 else code)
"""

# scancel --signal=SIG JOBID: slurmctld signals the job's steps' tasks, not the batch step.
FAKE_SCANCEL = """#!{python}
import os, signal, sys
out = os.environ["FAKE_SLURM_OUT"]
with open(os.path.join(out, "scancel.args"), "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
name = next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--signal="))
for pid in open(os.path.join(out, "task.pids")).read().split():
    os.kill(int(pid), getattr(signal, "SIG" + name.upper().removeprefix("SIG")))
"""

# A task: torchrun and its ranks in one process. On SIGTERM it "saves" and exits 143, as
# recpipe's ranks do (checkpoint.on_preempt); a SIGKILL leaves no save behind.
FAKE_TASK = """#!{python}
import os, signal, sys, time
out = os.environ["FAKE_SLURM_OUT"]

def save(signum, frame):
    with open(os.path.join(out, "task.saved"), "w") as f:
        f.write(signal.Signals(signum).name)
    sys.exit(128 + signum)

signal.signal(signal.SIGTERM, save)
with open(os.path.join(out, "task.started"), "w") as f:
    f.write(" ".join(sys.argv[1:]))
while True:
    time.sleep(0.02)
"""


def _fake_slurm(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A bin directory with Slurm's srun, scancel and scontrol as the test needs them, and
    the environment of a batch job of two nodes; what they saw lands in tmp_path/out."""
    stubs, out = tmp_path / "bin", tmp_path / "out"
    stubs.mkdir()
    out.mkdir()
    (stubs / "scontrol").write_text(
        "#!/bin/sh\n"
        f"printf '%s\\n' \"$*\" >> {out / 'scontrol.args'}\n"
        "[ \"$1 $2\" = 'show hostnames' ] && printf 'gpu-a\\ngpu-b\\n'\n"
        "exit 0\n")
    for name, text in (("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL), ("python", FAKE_TASK)):
        (stubs / name).write_text(text.replace("{python}", sys.executable))
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_NODELIST": "gpu-[a-b]", "SLURM_GPUS_ON_NODE": "8", "CONFIG": "configs/dlrm_gpu.yaml",
           "PYTHON": str(stubs / "python"), "FAKE_SLURM_OUT": str(out)}
    return out, env


def _wait_for(path: Path, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)


def test_slurm_time_limit_signal_reaches_the_ranks_as_sigterm_and_the_job_requeues(tmp_path):
    """--signal=B:TERM@300 signals the batch shell alone. The script must hand the tasks a
    SIGTERM (they checkpoint) without signalling srun, which would SIGKILL them."""
    out, env = _fake_slurm(tmp_path)
    script = subprocess.Popen(["bash", str(ROOT / "scripts" / "slurm" / "train.sbatch"), "--set", "train.steps=10"],
                              env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(out / "task.started")
        script.send_signal(signal.SIGTERM)  # Slurm's B:TERM: to the batch shell, no other process
        text, _ = script.communicate(timeout=60)
    finally:
        if script.poll() is None:
            script.kill()
            script.wait()
    srun_saw = (out / "srun.signals").read_text().split() if (out / "srun.signals").exists() else []
    assert (out / "task.saved").exists(), (f"the task never saw a SIGTERM (srun received {srun_saw}, which it turns "
                                           f"into SIGKILL for its tasks):\n{text}")
    assert (out / "task.saved").read_text() == "SIGTERM"
    assert srun_saw == [], f"srun received {srun_saw}: it would have killed the ranks"
    assert script.returncode == 143, text  # srun's: its task's exit code
    assert "requeue 77" in (out / "scontrol.args").read_text().splitlines(), text
    assert "requeueing job 77" in text

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
