"""Checkpoints: saving, finding, verifying and loading them, and converting TorchRec's.

``store`` holds the DCP layout, save, resume and retention; ``reader`` reads a checkpoint
without running code it names; ``integrity`` records and checks every file's size and
CRC-32 (``recpipe checkpoint verify``); ``convert`` moves checkpoints between TorchRec and
recpipe (``recpipe checkpoint convert``).

The package sits below the pre-launch checks (``recpipe.preflight`` checks the checkpoint a
resume starts from) and the trainer, which saves and loads through it. The names below are
loaded on first use, so that importing one module of the package (``integrity``, which
imports no torch) runs no other.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "TrainPosition": "recpipe.checkpoint.store",
    "latest_checkpoint": "recpipe.checkpoint.store",
    "load_checkpoint": "recpipe.checkpoint.store",
    "save_checkpoint": "recpipe.checkpoint.store",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from recpipe.checkpoint.store import TrainPosition, latest_checkpoint, load_checkpoint, save_checkpoint


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'recpipe.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
