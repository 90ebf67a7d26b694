"""``recpipe train``: the trainer, its checkpoints and metrics.

``recpipe.train.cli.main_train`` validates and checks the config and starts the ranks
(:func:`train` does the same from a trainer script, with its own pipeline class); each
runs :func:`run_worker`, i.e. a :class:`Trainer` (see ``trainer`` for the segment
loop, ``checkpoint`` for the DCP layout and resume, ``integrity`` for its checksums,
``metrics`` for AUC, NE and TorchRec's other metrics, ``preemption`` for stopping on signals, ``nonfinite``
for NaN / inf losses).

The names below are loaded on first use: the pre-launch checks import
``recpipe.train.checkpoint``, which must not import the command (``train``) that runs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ClickMetrics": "recpipe.train.metrics",
    "TrainPosition": "recpipe.train.checkpoint",
    "Trainer": "recpipe.train.trainer",
    "latest_checkpoint": "recpipe.train.checkpoint",
    "load_checkpoint": "recpipe.train.checkpoint",
    "run_worker": "recpipe.train.trainer",
    "save_checkpoint": "recpipe.train.checkpoint",
    "train": "recpipe.train.cli",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from recpipe.train.checkpoint import TrainPosition, latest_checkpoint, load_checkpoint, save_checkpoint
    from recpipe.train.cli import train
    from recpipe.train.metrics import ClickMetrics
    from recpipe.train.trainer import Trainer, run_worker


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'recpipe.train' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
