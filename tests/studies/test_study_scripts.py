"""The studies as a whole: each one regenerates a published report (benchmarks/studies/README.md
names it, and it exists), answers ``--help`` and runs as a script from any directory."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUDIES = ROOT / "benchmarks" / "studies"
MODULES = sorted(p.stem for p in STUDIES.glob("*.py") if p.stem not in ("__init__", "common"))


def _readme_rows() -> dict[str, str]:
    """The README's table: study file name -> its "regenerates" cell."""
    rows = {}
    for line in (STUDIES / "README.md").read_text().splitlines():
        if match := re.match(r"\| `(\w+)\.py` \|", line):
            cells = line.split(" | ")
            rows[match.group(1)] = cells[2]
    return rows


def test_every_study_regenerates_a_published_report():
    """A study lives here only for a report under benchmarks/results/: the README names it,
    and every report it links exists."""
    rows = _readme_rows()
    assert sorted(rows) == MODULES
    for name, cell in rows.items():
        links = re.findall(r"\]\(\.\./results/([\w/]+\.md)\)", cell)
        assert links, f"{name}.py regenerates no report in benchmarks/studies/README.md"
        for link in links:
            assert (ROOT / "benchmarks" / "results" / link).is_file(), (name, link)


@pytest.mark.parametrize("name", MODULES)
def test_every_study_answers_help(name, monkeypatch, capsys):
    """Each study's ``main`` prints its usage for ``--help`` (in this process: one import of torch)."""
    module = importlib.import_module(f"benchmarks.studies.{name}")
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])
    with pytest.raises(SystemExit) as done:
        module.main()
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out


BOOTSTRAP = """if __package__ in (None, ""):  # run as a script: the repository's packages first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
"""


@pytest.mark.parametrize("name", MODULES)
def test_every_study_puts_the_repository_first_before_importing_it(name):
    """Run as a script, a study imports the checkout's ``recpipe`` and ``benchmarks``: the
    bootstrap comes before the first import of either."""
    text = (STUDIES / f"{name}.py").read_text()
    first = re.search(r"^(from|import) (recpipe|benchmarks)\b", text, re.MULTILINE)
    assert BOOTSTRAP in text and first is not None and text.index(BOOTSTRAP) < first.start(), name


def test_a_study_runs_as_a_script_from_anywhere():
    """``python benchmarks/studies/bound.py --help`` outside the checkout: the script finds the
    repository's packages and shows the bench's flags."""
    out = subprocess.run([sys.executable, str(STUDIES / "bound.py"), "--help"], cwd="/", capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and "--with-torchrec" in out.stdout and "--pipelines" in out.stdout, out.stderr[-2000:]
