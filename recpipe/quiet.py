"""Silences the one library message that every recpipe process would otherwise print.

fbgemm-gpu's ``_load_library`` checks its own version against a table of the torch
versions it was built for (``fbgemm_gpu/__init__.py``, ``_fbgemm_torch_compat_table``)
and, for a release the table does not list yet (fbgemm-gpu 1.6.0's table stops at 1.5),
logs through the root logger::

    _fbgemm_torch_compat_table has no entry for 1.6.0 of FBGEMM;
    cannot determine compatibility with PyTorch 2.11.0

once per shared library and per process: a screen of ``WARNING:root:`` lines in every
rank, data worker and bench process, saying nothing a user can act on. It is dropped
here, matched on exactly that text; fbgemm's other warning (a version that is listed
and does not match the installed torch) still prints. :func:`install` runs when
``recpipe`` is imported, so it covers the launcher, every rank (forked from a server that
imports recpipe before torchrec: ``recpipe.launch_preload``) and forked producers; it adds
one filter, once.
"""

from __future__ import annotations

import logging

FBGEMM_COMPAT_TABLE_MESSAGE = "_fbgemm_torch_compat_table has no entry"


class _DropFbgemmCompatTable(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return FBGEMM_COMPAT_TABLE_MESSAGE not in record.getMessage()


_FILTER = _DropFbgemmCompatTable()


def install() -> None:
    """Add the filter to the root logger (where fbgemm logs it), once per process."""
    root = logging.getLogger()
    if _FILTER not in root.filters:
        root.addFilter(_FILTER)


__all__ = ["FBGEMM_COMPAT_TABLE_MESSAGE", "install"]
