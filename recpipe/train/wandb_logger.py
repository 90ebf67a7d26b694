"""Weights & Biases as a second home of the training scalars (``logging.wandb``).

Rank 0 logs to W&B exactly what it writes to TensorBoard: the same tags
(``train/loss``, ``eval/auc``, ``throughput/samples_per_s``, ``memory/...``), the
same values, at the same training step. The step is logged as the scalar ``step``
and declared every metric's x-axis (``define_metric``) instead of W&B's own step
counter: recpipe publishes a log point's values one interval late, so a scalar of
step 100 can be written after one of step 110, which W&B's step counter would drop.

The resolved config is the W&B run's config. A resumed run (from a checkpoint in
``checkpoint.dir``) continues the W&B run whose id rank 0 kept in
``logging.run_dir/wandb_run_id``; a fresh run starts a new one. The W&B files go to
``logging.run_dir/wandb``.

``wandb`` is optional: with ``logging.wandb`` set and the package missing,
``recpipe train`` stops before any process starts (``recpipe.preflight.check_machine``,
exit code 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recpipe.config import RecpipeConfig

__all__ = ["WandbLogger"]

_ID_FILE = "wandb_run_id"


class WandbLogger:
    """Rank 0's W&B run (see the module docstring)."""

    def __init__(self, cfg: RecpipeConfig, resumed: bool) -> None:
        import wandb  # optional (see the module docstring), and only rank 0 of a run that asks for it needs it

        w = cfg.logging.wandb
        assert w is not None
        run_dir = Path(cfg.logging.run_dir)
        id_file = run_dir / _ID_FILE
        previous = id_file.read_text().strip() if resumed and id_file.is_file() else None
        resume: dict[str, Any] = {"id": previous, "resume": "allow"} if previous else {}
        self.run = wandb.init(project=w.project, entity=w.entity, name=w.name, mode=w.mode, dir=str(run_dir),
                              config=cfg.model_dump(mode="json"), **resume)
        run_id = getattr(self.run, "id", None)
        if run_id:
            id_file.write_text(f"{run_id}\n")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log({**scalars, "step": step})

    def finish(self, status: str) -> None:
        """``status`` as in summary.json: a run that did not complete ends with exit code 1."""
        self.run.finish(exit_code=0 if status == "completed" else 1)
