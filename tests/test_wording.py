"""The product never speaks of its development.

README, docs, benchmark reports, configs, scripts, code comments, docstrings and CLI strings say
what recpipe does and why, with measurements, not when or in which working session it was built:
no "session", no issue numbers of this project, no borrowed machines, no paths outside the
repository, no stories of experiments that did not land, no report names with session suffixes.
This test greps every tracked text file (``git ls-files``) for those patterns.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
             "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth")

PATTERNS = {
    "a working session": re.compile(rf"\bsessions?\b|\b({_ORDINALS})\s+session", re.IGNORECASE),
    "borrowed machines": re.compile(r"\blent\s+(gpu|multi|machine|h100|h200)", re.IGNORECASE),
    "a path outside the repository": re.compile(r"\.\./shared\b", re.IGNORECASE),
    "an issue number of this project": re.compile(r"\bissues?\s+[0-9]+", re.IGNORECASE),
    "a story of what did not land": re.compile(r"tried\s+and\s+dropped|tried,\s+dropped|\bnot\s+kept\b", re.IGNORECASE),
    "a report named after a session": re.compile(r"_s[0-9]+\.(md|json|png)\b", re.IGNORECASE),
}

# An upstream project's issue or PR is a fine reference ("TorchRec issue 1234", "PyTorch PR #180090").
_UPSTREAM = re.compile(r"(torchrec|pytorch|torch|fbgemm|triton|nccl|cuda|github\.com\S*)\W{0,3}$", re.IGNORECASE)

# Files where a pattern is not history: this test's own patterns.
ALLOWED = {"tests/test_wording.py"}


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = []
    for name in out.decode().split("\0"):
        if not name or name in ALLOWED:
            continue
        path = ROOT / name
        if path.is_file() and path.suffix.lower() not in (".png", ".jpg", ".gif", ".pdf", ".gz"):
            files.append(path)
    return files


def _hits(text: str) -> list[tuple[int, str, str]]:
    hits = []
    for what, pattern in PATTERNS.items():
        for m in pattern.finditer(text):
            if what == "an issue number of this project" and _UPSTREAM.search(text[max(0, m.start() - 40):m.start()]):
                continue
            line = text.count("\n", 0, m.start()) + 1
            hits.append((line, what, " ".join(m.group(0).split())))
    return hits


def test_the_patterns_find_what_they_should():
    found = {what for _, what, _ in _hits(
        "Measured in the ninth session (issue 16) on the lent\nmulti-GPU machines; see ../shared/x.md. "
        "Tried and dropped. Not kept. Report foo_s13.md."
    )}
    assert found == set(PATTERNS)
    assert _hits("TorchRec issue 1234, fixed by TorchRec's PR #4191 and github.com/pytorch/pytorch issue 5") == []
    assert _hits("line one\nsee issue 5") == [(2, "an issue number of this project", "issue 5")]


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the git checkout (git ls-files)")
def test_tracked_files_do_not_speak_of_development():
    problems = []
    for path in _tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a binary file
        for line, what, match in _hits(text):
            problems.append(f"{path.relative_to(ROOT)}:{line}: {what}: {match!r}")
    assert not problems, "development history in the product:\n" + "\n".join(problems)
