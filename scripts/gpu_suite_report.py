"""The GPU suite's parts and its record (used by scripts/gpu_suite.sh).

    python3 scripts/gpu_suite_report.py files --part K/N
        the test files of part K of N: the files with `gpu`-marked tests, split into N
        groups of about equal numbers of such tests (collected by pytest)
    python3 scripts/gpu_suite_report.py render --commit SHA --out FILE PART.xml ...
        benchmarks/gpu_suite.md from pytest's JUnit XML reports of the parts: the
        commit, the device, the versions, and every test with its outcome (passed,
        failed with its message, skipped with its reason), never edited by hand
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def gpu_test_counts() -> dict[str, int]:
    """`gpu`-marked tests per file, as pytest collects them."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests"], capture_output=True, text=True, cwd=ROOT)
    counts: collections.Counter[str] = collections.Counter()
    for line in out.stdout.splitlines():
        if "::" in line:
            counts[line.split("::")[0]] += 1
    if not counts:
        raise SystemExit(f"no gpu-marked tests collected:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return dict(counts)


def split(counts: dict[str, int], parts: int) -> list[list[str]]:
    """Files into ``parts`` groups of about equal test counts (largest first, into the lightest group)."""
    groups: list[list[str]] = [[] for _ in range(parts)]
    load = [0] * parts
    for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        i = load.index(min(load))
        groups[i].append(name)
        load[i] += n
    return [sorted(g) for g in groups]


def _stack() -> dict[str, str]:
    versions = {}
    for name in ("torch", "fbgemm_gpu", "torchrec"):
        try:
            module = __import__(name)
            versions[name] = str(getattr(module, "__version__", "?"))
        except Exception as err:  # a missing package is part of the record
            versions[name] = f"not importable ({type(err).__name__})"
    try:
        import torch

        versions["cuda"] = str(torch.version.cuda)
        versions["device"] = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
                              if torch.cuda.is_available() else "no CUDA device")
    except Exception as err:
        versions["device"] = f"unknown ({type(err).__name__})"
    return versions


def render(commit: str, reports: list[Path]) -> str:
    rows, totals = [], collections.Counter()
    seconds = 0.0
    for path in reports:
        suite = ElementTree.parse(path).getroot()
        for case in suite.iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            seconds += float(case.get("time", 0) or 0)
            failure = case.find("failure")
            if failure is None:
                failure = case.find("error")
            skipped = case.find("skipped")
            if failure is not None:
                outcome, why = "failed", (failure.get("message") or "").splitlines()[0][:200]
            elif skipped is not None:
                outcome, why = "skipped", (skipped.get("message") or "")[:200]
            else:
                outcome, why = "passed", ""
            totals[outcome] += 1
            rows.append((name, outcome, why.replace("|", "\\|")))
    stack = _stack()
    lines = [
        f"# GPU suite: commit {commit}",
        "",
        "Written by `scripts/gpu_suite.sh` from pytest's JUnit XML reports of every `gpu`-marked test; not edited "
        "by hand. A change under `recpipe/` or `tests/` lands with this file recording a commit with the same "
        "`recpipe/` and `tests/` trees and no failure.",
        "",
        f"- commit: {commit}",
        f"- device: {stack.get('device')}",
        f"- torch {stack.get('torch')}, CUDA {stack.get('cuda')}, fbgemm-gpu {stack.get('fbgemm_gpu')}, "
        f"torchrec {stack.get('torchrec')}",
        f"- parts: {len(reports)}; tests: {sum(totals.values())}; passed {totals['passed']}, failed "
        f"{totals['failed']}, skipped {totals['skipped']}; {seconds:.0f} s of test time",
        "",
        "| test | outcome | reason |",
        "|---|---|---|",
        *(f"| `{name}` | {outcome} | {why} |" for name, outcome, why in sorted(rows)),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    files = sub.add_parser("files", help="the test files of one part")
    files.add_argument("--part", default="1/1", help="K/N")
    rend = sub.add_parser("render", help="the record from the parts' JUnit XML")
    rend.add_argument("--commit", required=True)
    rend.add_argument("--out", required=True)
    rend.add_argument("reports", nargs="+", type=Path)
    args = parser.parse_args(argv)
    if args.command == "files":
        k, n = (int(x) for x in args.part.split("/"))
        print(" ".join(split(gpu_test_counts(), n)[k - 1]))
        return 0
    Path(args.out).write_text(render(args.commit, [p for p in args.reports if p.is_file()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
