"""Shared by the GPU validation tests: print a markdown report and, when
``$RECPIPE_REPORT_DIR`` is set, write it there as ``NAME.md`` and ``NAME.json``.

A test whose cases the GPU gate may run in several pytest processes at once
(``scripts/gpu_suite.py`` splits a file's cases into parts) gathers its rows with
``merged_rows``: the rows the other processes wrote under NAME are kept, under a
file lock, so the report holds every case, not only the last process's."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator


def emit(name: str, text: str, doc: dict[str, Any]) -> None:
    print("\n" + text)
    out = os.environ.get("RECPIPE_REPORT_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.md").write_text(text)
        (Path(out) / f"{name}.json").write_text(json.dumps(doc, indent=2))


@contextlib.contextmanager
def merged_rows(name: str, rows: list[dict], key: Callable[[dict], tuple]) -> Iterator[list[dict]]:
    """Yields ``rows`` merged with those of ``$RECPIPE_REPORT_DIR/NAME.json`` (a row of
    ``rows`` replaces one with the same key), sorted by key; holds a lock on the report
    until the block (which calls ``emit``) ends. Without the variable: ``rows`` sorted."""
    out = os.environ.get("RECPIPE_REPORT_DIR")
    if not out:
        yield sorted(rows, key=key)
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    with open(Path(out) / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = Path(out) / f"{name}.json"
        earlier = json.loads(path.read_text()).get("rows", []) if path.exists() else []
        merged = {key(r): r for r in earlier}
        merged.update({key(r): r for r in rows})
        yield [merged[k] for k in sorted(merged)]
