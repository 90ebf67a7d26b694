"""The schedule variants kept as a study (benchmarks/studies/schedule_variants.py),
importable from the tests and their spawned ranks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "studies" / "schedule_variants.py"
_spec = importlib.util.spec_from_file_location("schedule_variants", _PATH)
schedule_variants = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("schedule_variants", schedule_variants)
_spec.loader.exec_module(schedule_variants)
