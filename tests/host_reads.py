"""Counting the trainer's host reads of tensors between two log points (tests/test_train_host_reads.py
and its GPU twin).

:class:`HostReads` replaces the methods through which Python reads a tensor's values on the
host (``item``, ``tolist``, ``bool(t)``, ``float(t)``, ``int(t)``, ``.cpu()``, ``.numpy()``,
printing) for as long as it is entered, and records each call made on the main thread while
``counting`` is true, with where it came from. On CUDA every one of them waits for the device;
on CPU nothing waits, so this is how a CPU test sees a read that would be a host sync on a GPU.
Other threads (the data producers', the step watchdog's) are not the training loop's and are
not counted.

:func:`between_log_points` arms it around a :class:`~recpipe.train.trainer.Trainer`: counting
in ``_train_steps``, not inside a log point (``_log_train`` reads the values of the previous
one, by design) nor inside the pipeline's ``progress`` (the step itself: the torch optimizer's
CPU step and FBGEMM's CPU kernels read host tensors there; on CUDA a captured step does not).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import traceback
from typing import Any, Iterator

import torch

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "__repr__", "__format__")


class HostReads:
    """Counts host reads of tensors on the main thread while ``counting`` (see the module docstring).
    ``ignore``: tensors whose reads are not device reads (host tensors by design, by identity)."""

    def __init__(self) -> None:
        self.counting = False
        self.ignore: list[torch.Tensor] = []
        self.reads: collections.Counter[tuple[str, str]] = collections.Counter()
        self._originals = {name: getattr(torch.Tensor, name) for name in READS}
        self._main = threading.main_thread()

    def __enter__(self) -> "HostReads":
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, self._counted(name, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)

    def _counted(self, name: str, original: Any) -> Any:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if (self.counting and threading.current_thread() is self._main
                    and not any(tensor is host for host in self.ignore)):
                caller = traceback.extract_stack(limit=4)[:-1]
                where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in reversed(caller))
                self.reads[(name, where)] += 1
            return original(tensor, *args, **kwargs)

        return read

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        was, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = was

    def describe(self) -> str:
        return "\n".join(f"{count} x {name} at {where}" for (name, where), count in self.reads.items())


def between_log_points(trainer: Any, reads: HostReads) -> None:
    """Arm ``reads`` around ``trainer`` (instance attributes: the class is untouched)."""
    train_steps, log_train, progress = trainer._train_steps, trainer._log_train, trainer.pipeline.progress

    def counted_steps(batches: Any) -> int:
        # The stop agreement's flag is a host tensor of the Gloo control group, read at its exchanges.
        reads.ignore = [trainer._preemption._flag]
        reads.counting = True
        try:
            return train_steps(batches)
        finally:
            reads.counting = False

    def log_point(*args: Any, **kwargs: Any) -> None:
        with reads.paused():
            log_train(*args, **kwargs)

    def step(batches: Any) -> Any:
        with reads.paused():
            return progress(batches)

    trainer._train_steps, trainer._log_train, trainer.pipeline.progress = counted_steps, log_point, step
