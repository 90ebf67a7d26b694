"""recpipe's trainer imports torchmetrics without transformers' models (recpipe/lean_imports.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHECK = "import sys; {stmt}; print('transformers' in sys.modules)"


def _loaded(tmp_path: Path, stmt: str) -> bool:
    """Whether ``stmt`` imports transformers, with a stand-in transformers package installed."""
    fake = tmp_path / "site" / "transformers"
    fake.mkdir(parents=True, exist_ok=True)
    (fake / "__init__.py").write_text("__version__ = '4.46.0'\n\ndef __getattr__(name):\n    return type(name, (), {})\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", _CHECK.format(stmt=stmt)], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    return out.strip().splitlines()[-1] == "True"


def test_the_trainer_does_not_import_transformers(tmp_path):
    # control: torchmetrics alone imports the installed transformers (its text metrics' modules)
    assert _loaded(tmp_path, "import torchmetrics")
    assert not _loaded(tmp_path, "import recpipe.train.trainer")


def test_transformers_imported_first_stays_available(tmp_path):
    assert _loaded(tmp_path, "import transformers; import recpipe.train.trainer; import torchmetrics.functional.text.bert as b; "
                             "assert b._TRANSFORMERS_GREATER_EQUAL_4_4")
