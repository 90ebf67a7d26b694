"""Imports that leave out what recpipe never uses: :func:`torchmetrics_without_transformers`.

torchmetrics imports its whole namespace on ``import torchmetrics``, and with it, where the
transformers package is installed, transformers' auto models (its BERTScore, InfoLM and
CLIPScore modules import them at module level). On one GPU host with transformers installed,
``import recpipe.train.trainer`` took 23.4 s, torchmetrics 9.4 s of it and
``torchmetrics.functional.text.bert`` alone 6.0 s. recpipe uses torchmetrics' ``Metric`` base
and torchrec's metrics built on it, none of those text or multimodal metrics.

torch-free: imported before torch.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from typing import Iterator

__all__ = ["torchmetrics_without_transformers"]


class _Hidden(importlib.abc.MetaPathFinder):
    """A finder, first on ``sys.meta_path``, that says ``names`` (and their submodules) do not exist."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 (importlib's signature)
        if fullname.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r} (hidden while torchmetrics is imported)",
                                      name=fullname)
        return None


@contextlib.contextmanager
def _hidden(*names: str) -> Iterator[None]:
    finder = _Hidden(names)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def torchmetrics_without_transformers() -> None:
    """Import torchmetrics as if transformers were not installed, unless it was imported before
    or transformers is already loaded (then nothing changes). torchmetrics then reports its
    transformers-based metrics (BERTScore, InfoLM, CLIPScore) as unavailable in this process:
    a user's model that needs them imports transformers before recpipe builds its trainer."""
    if "torchmetrics" in sys.modules or "transformers" in sys.modules:
        return
    with _hidden("transformers"):
        import torchmetrics  # noqa: F401
