"""What every test shares: how many GPUs a `gpu`-marked test needs, and its time limit.

A `gpu` test needs a CUDA GPU, and the GPUs its `gpus` marker names (``@pytest.mark.gpus(4)``),
else its ``nproc`` or ``world_size`` parameter's value, else one. With fewer visible it is
skipped as "needs N GPUs" (the GPU suite's record counts those as not run);
``--gpus-needed N`` keeps only the `gpu` tests that need exactly N (the GPU suite runs
each count on its own GPUs). ``--gpu-test-timeout S`` ends a `gpu` test that runs
longer than S seconds as a failure, so that a hang costs one test, not the suite's call.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch


def gpus_needed(item: pytest.Item) -> int:
    marker = item.get_closest_marker("gpus")
    if marker is not None:
        return int(marker.args[0])
    params = getattr(getattr(item, "callspec", None), "params", {})
    for name in ("nproc", "world_size"):
        if name in params:
            return int(params[name])
    return 1


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gpus-needed", type=int, default=None,
                     help="keep only the gpu-marked tests that need exactly this many GPUs")
    parser.addoption("--gpu-test-timeout", type=float, default=0,
                     help="fail a gpu-marked test that runs longer than this many seconds (0: no limit)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpus(n): the GPUs a gpu-marked test needs (default: its nproc / world_size, else 1)")
    config.addinivalue_line("markers", "host_bound: the test needs the host to itself (it proves the host runs ahead of "
                            "the device); scripts/gpu_suite.py runs it with no other test on the machine")


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = config.getoption("--gpus-needed")
    keep, drop = [], []
    for item in items:
        if item.get_closest_marker("gpu") is None:
            keep.append(item)
            continue
        n = gpus_needed(item)
        item.user_properties.append(("gpus_needed", n))
        (keep if wanted is None or n == wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    if os.environ.get("RECPIPE_GPU_NEEDS"):  # scripts/gpu_suite.py plans its parts from them
        Path(os.environ["RECPIPE_GPU_NEEDS"]).write_text(json.dumps(
            {i.nodeid: {"gpus": gpus_needed(i), "alone": i.get_closest_marker("host_bound") is not None}
             for i in items if i.get_closest_marker("gpu") is not None}))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Under the GPU suite (``RECPIPE_GPU_SUITE``), a failure's report is printed when it
    happens, not at the end: a part stopped at its deadline still shows why its tests failed."""
    if report.failed and os.environ.get("RECPIPE_GPU_SUITE"):
        sys.stderr.write(f"\n== {report.nodeid} failed ({report.when}):\n{report.longreprtext[-8000:]}\n")
        sys.stderr.flush()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is None:
        return
    item.user_properties.append(("gpus_visible", torch.cuda.device_count()))
    n = gpus_needed(item)
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    limit = item.config.getoption("--gpu-test-timeout")
    if not limit or item.get_closest_marker("gpu") is None:
        yield
        return

    def expired(signum, frame):
        dumped = _dump_descendants()
        pytest.fail(f"ran longer than --gpu-test-timeout={limit:g} s"
                    + (f" (stacks of {dumped} child processes above)" if dumped else ""), pytrace=True)

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _dump_descendants() -> int:
    """With ``PYTHONFAULTHANDLER`` set (the GPU suite sets it, so the ranks inherit it),
    SIGABRT makes each process below this one print every thread's Python stack before it
    ends: where a hung test's ranks wait. Returns how many were signalled."""
    if not os.environ.get("PYTHONFAULTHANDLER"):
        return 0
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    below, todo = [], [os.getpid()]
    while todo:
        for pid in children.get(todo.pop(), []):
            below.append(pid)
            todo.append(pid)
    for pid in below:
        try:
            os.kill(pid, signal.SIGABRT)
        except ProcessLookupError:
            pass
    time.sleep(3)
    return len(below)
