"""``recpipe train``: the trainer, its checkpoints and metrics.

``recpipe.train.cli.main_train`` validates and checks the config and starts the ranks
(:func:`train` does the same from a trainer script, with its own pipeline class); each
runs :func:`run_worker`, i.e. a :class:`Trainer` (see ``trainer`` for the segment
loop, ``checkpoint`` for the DCP layout and resume, ``integrity`` for its checksums,
``metrics`` for AUC, NE and TorchRec's other metrics, ``preemption`` for stopping on signals, ``nonfinite``
for NaN / inf losses).
"""

from recpipe.train.checkpoint import TrainPosition, latest_checkpoint, load_checkpoint, save_checkpoint
from recpipe.train.cli import train
from recpipe.train.metrics import ClickMetrics
from recpipe.train.trainer import Trainer, run_worker

__all__ = [
    "ClickMetrics",
    "TrainPosition",
    "Trainer",
    "latest_checkpoint",
    "load_checkpoint",
    "run_worker",
    "save_checkpoint",
    "train",
]
