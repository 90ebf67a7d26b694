"""Training a shipped config and reading back what it reached: each log interval's mean
loss (TensorBoard's ``train/loss``) and the final eval AUC (``summary.json``). Used by
tests/test_configs_train.py (CPU) and tests/test_configs_train_gpu.py (CUDA).

The bound on an interval's mean loss, ``LOSS_BOUND`` = 0.75 = ln 2 + 0.057: labels are
clicks, and a model that knows nothing predicts 0.5 and scores ln 2 (a model at
initialization is there, its logits near 0); one that predicts the click rate (30 % on the
synthetic log, 14 % in the two-tower data) scores less, and training goes below that. The
0.057 is room for noise at small batches (no interval of the shipped configs exceeds 0.70
in these tests), none for first updates that overshoot (the first Adagrad or Adam step
moves every weight by the rate, whatever its gradient): such rates put the first 10 steps
at 0.77-1.7 (dcnv2.yaml's Adagrad at 0.05, MLPerf's 0.005 on mlperf_dcnv2.yaml,
optimizer_heavy.yaml's Adam, each without a warm-up), and Adagrad at 0.05 on 1024-wide
layers at 1e4-1e12.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from recpipe.cli import main

ROOT = Path(__file__).parent.parent
CONFIGS = ROOT / "configs"
LOSS_BOUND = 0.75


@dataclass(frozen=True)
class Trained:
    losses: list[tuple[int, float]]  # (log step, mean loss of the interval ending there)
    eval_auc: float

    def describe(self) -> str:
        return f"eval AUC {self.eval_auc:.4f}; losses " + " ".join(f"{s}:{v:.4g}" for s, v in self.losses)


def read_config(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


def reduced(name: str, *, max_rows: int, batch_size: int | None, steps: int, log_every: int,
            eval_batches: int, device: str) -> list[str]:
    """``--set`` overrides that train config ``name`` for ``steps`` steps with every table
    capped at ``max_rows`` rows (the ids keep their law, Zipf or uniform, over the smaller
    table), ``batch_size`` samples per rank (None: the config's), a log point every
    ``log_every`` steps and one evaluation at the end over ``eval_batches`` batches.
    ``device="cpu"`` also moves a CUDA config to CPU: Gloo, no pinned memory, no producer
    processes, no CUDA graphs. Optimizer settings, model widths, precision and pipeline are
    the config's (a test changes what CPU cannot run, and says so)."""
    raw = read_config(name)
    model, data, train = raw.get("model", {}), raw.get("data", {}), raw.get("train", {})
    out = [f"train.steps={steps}", f"train.log_every={log_every}", "train.eval_every=0",
           "train.progress=false", "checkpoint.dir=null", "checkpoint.every=0"]
    if "num_embeddings_per_feature" in model:
        out.append(f"model.num_embeddings_per_feature={[min(n, max_rows) for n in model['num_embeddings_per_feature']]}")
    if batch_size is not None:
        out.append(f"data.batch_size={batch_size}")
    if data.get("source", "synthetic") == "synthetic" and "factory" not in data:
        out += [f"data.synthetic.num_batches={steps}", f"data.synthetic.num_eval_batches={eval_batches}"]
    if device == "cpu" and train.get("device") == "cuda":
        out += ["train.device=cpu", "distributed.backend=gloo", "data.pin_memory=false", "data.num_workers=0"]
        if raw.get("pipeline", {}).get("cuda_graphs"):
            out.append("pipeline.cuda_graphs=false")
    return out


def train(name: str, overrides: list[str], run_dir: Path) -> Trained:
    """``recpipe train`` on ``configs/<name>`` with ``overrides``; what it reached."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = ["train", "--config", str(CONFIGS / name), "--set", f"logging.run_dir={run_dir}"]
    for pair in overrides:
        args += ["--set", pair]
    assert main(args) == 0, f"recpipe train {name} failed"
    events = EventAccumulator(str(run_dir)).Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    summary = json.loads((run_dir / "summary.json").read_text())
    return Trained(losses=losses, eval_auc=summary["eval_auc"])


def assert_trains(trained: Trained, min_auc: float) -> None:
    """Every log interval's mean loss finite and below ``LOSS_BOUND``, the last below the
    first, and the final eval AUC at least ``min_auc``."""
    what = trained.describe()
    assert len(trained.losses) >= 2, what
    for step, loss in trained.losses:
        assert math.isfinite(loss) and loss < LOSS_BOUND, f"interval ending at step {step}: mean loss {loss:.4g}; {what}"
    assert trained.losses[-1][1] < trained.losses[0][1], f"the loss did not fall; {what}"
    assert trained.eval_auc >= min_auc, f"eval AUC {trained.eval_auc:.4f} < {min_auc}; {what}"
