"""Shared by the GPU validation tests: print a markdown report and, when
``$RECPIPE_REPORT_DIR`` is set, write it there as ``NAME.md`` and ``NAME.json``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def emit(name: str, text: str, doc: dict[str, Any]) -> None:
    print("\n" + text)
    out = os.environ.get("RECPIPE_REPORT_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.md").write_text(text)
        (Path(out) / f"{name}.json").write_text(json.dumps(doc, indent=2))
