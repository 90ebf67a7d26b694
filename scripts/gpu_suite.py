"""The GPU gate: every `gpu`-marked test on the GPUs of this machine, and its record.

    python3 scripts/gpu_suite.py run --commit SHA --out DIR [--gpus N] [--test-timeout S] [--deadline S]
    python3 scripts/gpu_suite.py plan [--gpus N]
    python3 scripts/gpu_suite.py render --commit SHA --out FILE REPORT.xml ...

``run`` collects the `gpu`-marked tests with the GPUs each needs (tests/conftest.py: a
``gpus`` marker, or the test's ``nproc`` / ``world_size`` parameter), splits the tests of
each need into ``N // need`` parts of about equal time (the seconds each test took in the
last record, ``benchmarks/gpu_suite.md``; 20 s for a new one), and runs the parts at
once as GPUs come free, largest need first: each part is one pytest process that sees
only its GPUs (``CUDA_VISIBLE_DEVICES``) and has its own rendezvous port. On a 4-GPU host
the 4-GPU part runs on all four, then the 2-GPU parts on the two pairs and the 1-GPU
parts on one GPU each. Tests marked ``host_bound`` (they prove the host runs ahead of the
device, which a host busy with other parts' compiles and producers cannot) run first, each
part alone on its GPUs and no other part on the machine until they are done. Tests that need more GPUs than the machine has run in a part of
their own and are recorded as skipped "needs N GPUs": the record is then not green.
A test running longer than ``--test-timeout`` fails (the rest of its part runs); a part
still running at ``--deadline`` seconds is interrupted (pytest still writes its report).

``render`` writes the record from pytest's JUnit XML reports: the commit, the device,
the versions, and every test with its outcome, the GPUs it needed and saw, and its
seconds; never edited by hand. The rule (README, Contributing): a change under
``recpipe/`` or ``tests/`` lands with a ``benchmarks/gpu_suite.md`` whose commit has the
same ``recpipe/`` and ``tests/`` trees, 0 failed and 0 skipped for want of GPUs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "benchmarks" / "gpu_suite.md"
NEW_TEST_S = 20.0


@dataclass
class Part:
    gpus: int  # GPUs each test of the part needs (and the part sees, where the machine has them)
    tests: list[str] = field(default_factory=list)
    seconds: float = 0.0
    alone: bool = False  # host_bound tests: the part has its GPUs to itself, and runs before any other part


def collect(select: str = "") -> tuple[dict[str, int], set[str]]:
    """Every `gpu`-marked test's node id -> the GPUs it needs, and the ``host_bound`` ones,
    as pytest collects them (``select``: only those matching a pytest ``-k`` expression;
    tests/conftest.py writes them to the file ``RECPIPE_GPU_NEEDS`` names)."""
    with tempfile.TemporaryDirectory() as tmp:
        needs = Path(tmp) / "needs.json"
        out = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider",
                              "tests", *(["-k", select] if select else [])],
                             capture_output=True, text=True, cwd=ROOT, env={**os.environ, "RECPIPE_GPU_NEEDS": str(needs)})
        if out.returncode != 0 or not needs.is_file():
            raise SystemExit(f"collecting the gpu-marked tests failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        found = json.loads(needs.read_text())
        return {test: need["gpus"] for test, need in found.items()}, {t for t, need in found.items() if need["alone"]}


def last_seconds(record: Path = RECORD) -> dict[str, float]:
    """Each test's seconds in the last record (its table's last column), where it has them."""
    seconds = {}
    if record.is_file():
        for line in record.read_text().splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) >= 5 and cells[0].startswith("`") and re.fullmatch(r"[0-9.]+", cells[-1]):
                seconds[cells[0].strip("`")] = float(cells[-1])
    return seconds


def plan(needs: dict[str, int], gpus: int, seconds: dict[str, float], slots: int = 1,
         alone: frozenset[str] | set[str] = frozenset()) -> list[Part]:
    """The parts: the ``alone`` tests' first, ``max(1, gpus // need)`` for each need, then for
    each need ``max(1, gpus * slots // need)`` parts; tests placed longest first into the part
    with the least time (a need above ``gpus`` gets one part, to be skipped)."""
    parts = []
    for solo, per_gpu in ((True, 1), (False, slots)):
        for need in sorted(set(needs.values()), reverse=True):
            group = [Part(need, alone=solo) for _ in range(max(1, gpus * per_gpu // need) if need <= gpus else 1)]
            tests = sorted((t for t, n in needs.items() if n == need and (t in alone) == solo),
                           key=lambda t: (-seconds.get(t, NEW_TEST_S), t))
            for test in tests:
                lightest = min(group, key=lambda p: p.seconds)
                lightest.tests.append(test)
                lightest.seconds += seconds.get(test, NEW_TEST_S)
            parts += [p for p in group if p.tests]
    return parts


def run(parts: list[Part], gpus: int, out: Path, test_timeout: float, deadline: float, slots: int = 1) -> int:
    """Runs the parts as GPUs come free (list order: largest need first), ``slots`` parts at
    a time on each GPU (the suite's tests leave most of a GPU idle: their time is launches,
    collectives and compiles), the ``alone`` parts first, each with its GPUs to itself and
    nothing else started until they are done; returns 1 if any failed."""
    out.mkdir(parents=True, exist_ok=True)
    free = [slots] * gpus  # parts each GPU can still take
    pending = list(enumerate(parts, start=1))
    running: dict[int, tuple[subprocess.Popen, list[int], object]] = {}
    status, start = 0, time.monotonic()
    while pending or running:
        solo = any(p.alone for _, p in pending) or any(parts[k - 1].alone for k in running)
        for k, part in list(pending):
            if solo and not part.alone and part.gpus <= gpus:
                continue
            if part.gpus > gpus:  # listed as not run, with why (render): never a skip for want of GPUs
                (out / f"part{k}_gpus{part.gpus}.tests").write_text("".join(f"{t}\n" for t in part.tests))
                (out / f"part{k}_gpus{part.gpus}.why").write_text(f"needs {part.gpus} GPUs; this machine has {gpus}\n")
                print(f"part {k}: {len(part.tests)} tests needing {part.gpus} GPUs: not run ({gpus} here)", flush=True)
                pending.remove((k, part))
                continue
            take = min(part.gpus, gpus)
            devices = sorted(sorted(range(gpus), key=lambda g: -free[g])[:take])
            if any(free[g] < (slots if part.alone else 1) for g in devices):
                continue
            for g in devices:
                free[g] -= slots if part.alone else 1
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, devices)),
                   "MASTER_PORT": str(29500 + 17 * k), "PYTHONUNBUFFERED": "1",
                   "PYTHONFAULTHANDLER": "1",  # a test past its time limit prints its ranks' stacks
                   "RECPIPE_GPU_SUITE": "1"}  # failures printed as they happen (tests/conftest.py)
            log = open(out / f"part{k}_gpus{part.gpus}.log", "w")
            (out / f"part{k}_gpus{part.gpus}.tests").write_text("".join(f"{t}\n" for t in part.tests))
            cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfEs", "-p", "no:cacheprovider",
                   "--durations=0", f"--junitxml={out}/part{k}_gpus{part.gpus}.xml",
                   f"--gpu-test-timeout={test_timeout:g}", *part.tests]
            print(f"part {k}: {len(part.tests)} tests needing {part.gpus} GPU(s) on GPUs {devices}"
                  f"{', alone' if part.alone else ''} (~{part.seconds:.0f} s)", flush=True)
            running[k] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), devices, log)
            pending.remove((k, part))
        time.sleep(1)
        for k, (proc, devices, log) in list(running.items()):
            if proc.poll() is None:
                if deadline and time.monotonic() - start > deadline:
                    proc.send_signal(signal.SIGINT)  # pytest ends the test and writes its report
                    try:
                        proc.wait(30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                continue
            log.close()
            code = proc.returncode
            print(f"part {k} ended with exit code {code} after {time.monotonic() - start:.0f} s", flush=True)
            status |= int(code not in (0, 5))  # 5: every test deselected
            for g in devices:
                free[g] += slots if parts[k - 1].alone else 1
            del running[k]
    return status


def render(commit: str, reports: list[Path], select: str = "") -> str:
    """The record of ``reports`` (parts' JUnit XML files, from one or more output folders); a part
    without its report has its tests listed as not run (its ``.tests`` file beside the missing
    ``.xml``): one that needs more GPUs than the machine has (its ``.why`` says so), or whose
    pytest was killed at the deadline."""
    rows, totals = [], collections.Counter()
    seconds, want = 0.0, 0
    parts = {p.with_suffix(".tests") for p in reports}
    for folder in {p.parent for p in reports}:
        parts |= set(folder.glob("part*_gpus*.tests"))
    for listed in sorted(parts):
        if not listed.with_suffix(".xml").is_file() and listed.is_file():
            why = listed.with_suffix(".why")
            reason = why.read_text().strip() if why.is_file() else "its part ended without a report (killed at --deadline)"
            gpus = re.search(r"_gpus(\d+)", listed.name)
            for name in listed.read_text().split():
                totals["not run"] += 1
                rows.append((name, "not run", reason, gpus.group(1) if gpus else "-", "-", "-"))
    for path in reports:
        suite = ElementTree.parse(path).getroot()
        for case in suite.iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            took = float(case.get("time", 0) or 0)
            seconds += took
            props = {p.get("name"): p.get("value") for p in case.iter("property")}
            failure = case.find("failure")
            if failure is None:
                failure = case.find("error")
            skipped = case.find("skipped")
            if failure is not None:
                outcome, why = "failed", (failure.get("message") or "").splitlines()[0][:200] if failure.get("message") else ""
            elif skipped is not None:
                outcome, why = "skipped", (skipped.get("message") or "")[:200]
                want += bool(re.search(r"needs \d+ GPU", why))
            else:
                outcome, why = "passed", ""
            totals[outcome] += 1
            rows.append((name, outcome, why.replace("|", "\\|"), props.get("gpus_needed", "1"),
                         props.get("gpus_visible", "-"), f"{took:.1f}"))
    stack = _stack()
    lines = [
        f"# GPU suite: commit {commit}",
        "",
        "Written by `scripts/gpu_suite.sh` from pytest's JUnit XML reports of every `gpu`-marked test; not edited "
        "by hand. A change under `recpipe/` or `tests/` lands with this file recording a commit with the same "
        "`recpipe/` and `tests/` trees, 0 failed and 0 skipped for want of GPUs.",
        "",
        f"- commit: {commit}" + (f"; only the tests matching -k {select!r}: not the gate" if select else ""),
        f"- machine: {stack.get('device')}; each test ran on the GPUs it needs (column 'GPUs seen')",
        f"- torch {stack.get('torch')}, CUDA {stack.get('cuda')}, fbgemm-gpu {stack.get('fbgemm_gpu')}, "
        f"torchrec {stack.get('torchrec')}",
        f"- tests: {sum(totals.values())}; passed {totals['passed']}, failed {totals['failed']}, skipped "
        f"{totals['skipped']} ({want} for want of GPUs), not run {totals['not run']}; {seconds:.0f} s of test time in "
        f"{len(reports)} parts",
        "",
        "| test | outcome | reason | GPUs needed | GPUs seen | s |",
        "|---|---|---|---|---|---|",
        *(f"| `{n}` | {o} | {w} | {g} | {v} | {s} |" for n, o, w, g, v, s in sorted(rows)),
    ]
    return "\n".join(lines) + "\n"


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


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run every part and write the record")
    p_run.add_argument("--commit", required=True)
    p_run.add_argument("--out", required=True, type=Path)
    p_plan = sub.add_parser("plan", help="print the parts")
    for p in (p_run, p_plan):
        p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible)")
    p_run.add_argument("--test-timeout", type=float, default=300, help="seconds a test may run (default 300)")
    for p in (p_run, p_plan):
        p.add_argument("--slots", type=int, default=2, help="parts at a time on each GPU (default 2)")
    p_run.add_argument("--deadline", type=float, default=0, help="interrupt parts still running after this many seconds")
    for p in (p_run, p_plan):
        p.add_argument("-k", dest="select", default="", help="only the tests matching this pytest -k expression "
                       "(a record of a subset is no gate)")
    rend = sub.add_parser("render", help="the record from the parts' JUnit XML")
    rend.add_argument("--commit", required=True)
    rend.add_argument("--out", required=True)
    rend.add_argument("reports", nargs="+", type=Path)
    args = parser.parse_args(argv)
    if args.command == "render":
        Path(args.out).write_text(render(args.commit, [p for p in args.reports if p.is_file()]))
        return 0
    gpus = args.gpus if args.gpus is not None else _gpu_count()
    needs, alone = collect(args.select)
    parts = plan(needs, max(gpus, 1), last_seconds(), args.slots, alone)
    if args.command == "plan":
        for k, part in enumerate(parts, start=1):
            print(f"part {k}: {len(part.tests)} tests needing {part.gpus} GPU(s){', alone' if part.alone else ''}, "
                  f"~{part.seconds:.0f} s")
            print("".join(f"  {t}\n" for t in part.tests), end="")
        return 0
    if gpus < 1:
        print("gpu_suite.py: no CUDA GPU visible", file=sys.stderr)
        return 2
    status = run(parts, gpus, args.out, args.test_timeout, args.deadline, args.slots)
    record = args.out / "gpu_suite.md"
    record.write_text(render(args.commit, sorted(args.out.glob("part*_gpus*.xml")) or sorted(args.out.glob("part*.tests")),
                             args.select))
    print(record.read_text().split("\n\n")[2], flush=True)  # the summary lines
    return status


if __name__ == "__main__":
    sys.exit(main())
