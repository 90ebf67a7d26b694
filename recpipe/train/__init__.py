"""``recpipe train``: the trainer and its metrics.

``recpipe.train.cli.main_train`` validates and checks the config and starts the ranks
(:func:`train` does the same from a trainer script, with its own pipeline class); each
runs :func:`run_worker`, i.e. a :class:`Trainer` (see ``trainer`` for the segment
loop, ``metrics`` for AUC, NE and TorchRec's other metrics, ``preemption`` for stopping on
signals, ``nonfinite`` for NaN / inf losses). Checkpoints (the DCP layout, resume, their
checksums) live below, in ``recpipe.checkpoint``.

The names below are loaded on first use: importing one module of the package
(``recpipe.train.report`` for ``recpipe report``) runs neither the trainer nor the command
(``train``), which sits above the pre-launch checks.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ClickMetrics": "recpipe.train.metrics",
    "Trainer": "recpipe.train.trainer",
    "run_worker": "recpipe.train.trainer",
    "train": "recpipe.train.cli",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from recpipe.train.cli import train
    from recpipe.train.metrics import ClickMetrics
    from recpipe.train.trainer import Trainer, run_worker


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'recpipe.train' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
