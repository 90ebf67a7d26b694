"""The studies are imported as ``benchmarks.studies.*``: the repository root on the path
(``python -m pytest`` from the root has it already; a bare ``pytest`` does not)."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
