"""The GPU gate's script on CPU: how it splits the suite over a machine's GPUs, and what
its record counts (scripts/gpu_suite.py; the GPU machine runs it)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "scripts" / "gpu_suite.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_parts_run_each_test_on_the_gpus_it_needs():
    suite = _suite()
    needs = {f"t.py::one[{i}]": 1 for i in range(8)} | {f"t.py::two[{i}]": 2 for i in range(4)} | {"t.py::four": 4}
    parts = suite.plan(needs, gpus=4, seconds={"t.py::one[0]": 100.0}, slots=1)
    assert [p.gpus for p in parts] == [4, 2, 2, 1, 1, 1, 1]  # largest need first: it takes the whole machine
    assert sorted(t for p in parts for t in p.tests) == sorted(needs)
    assert all(needs[t] == p.gpus for p in parts for t in p.tests)
    ones = [p for p in parts if p.gpus == 1]
    assert [len(p.tests) for p in ones if "t.py::one[0]" in p.tests] == [1]  # the long one has a part to itself
    # A 2-GPU machine: the 4-GPU test gets a part of its own (its tests skip "needs 4 GPUs").
    assert [p.gpus for p in suite.plan(needs, gpus=2, seconds={}, slots=1)] == [4, 2, 1, 1]
    # Two parts at a time on each GPU: twice the parts of each need.
    assert [p.gpus for p in suite.plan(needs, gpus=4, seconds={}, slots=2)] == [4, 2, 2, 2, 2] + [1] * 8
    # host_bound tests first, in parts of one per GPU whatever the slots, then the rest
    alone = {"t.py::one[0]", "t.py::one[1]", "t.py::two[0]"}
    parts = suite.plan(needs, gpus=4, seconds={}, slots=2, alone=alone)
    assert [(p.gpus, p.alone) for p in parts] == [(2, True), (1, True), (1, True)] + [
        (4, False), (2, False), (2, False), (2, False)] + [(1, False)] * 6
    assert {t for p in parts if p.alone for t in p.tests} == alone


def test_host_bound_parts_run_with_the_machine_to_themselves(tmp_path, monkeypatch):
    """No other part starts while a host_bound part is waiting or running."""
    suite = _suite()
    started, ended = [], []

    class Proc:
        def __init__(self, cmd, cwd, env, stdout, stderr):
            self.k, self.polls, self.returncode = len(started) + 1, 0, None
            started.append((self.k, env["CUDA_VISIBLE_DEVICES"], [k for k, _ in running()]))

        def poll(self):
            self.polls += 1
            if self.polls < 2:
                return None
            self.returncode = 0
            ended.append(self.k)
            return 0

    live = {}

    def running():
        return [(k, p) for k, p in live.items() if p.returncode is None]

    def popen(*args, **kwargs):
        proc = Proc(*args, **kwargs)
        live[proc.k] = proc
        return proc

    monkeypatch.setattr(suite.subprocess, "Popen", popen)
    monkeypatch.setattr(suite.time, "sleep", lambda s: None)
    parts = [suite.Part(2, ["t.py::a"], alone=True), suite.Part(1, ["t.py::b"], alone=True),
             suite.Part(1, ["t.py::c"]), suite.Part(1, ["t.py::d"])]
    assert suite.run(parts, gpus=2, out=tmp_path, test_timeout=10, deadline=0, slots=2) == 0
    # a has both GPUs; then b has one to itself, and the other stays idle until b has ended
    assert [(k, gpus, before) for k, gpus, before in started[:2]] == [(1, "0,1", []), (2, "0", [])]
    assert ended[:2] == [1, 2] and all(before == [] or set(before) <= {3, 4} for _, _, before in started[2:])


def test_record_counts_tests_skipped_for_want_of_gpus(tmp_path):
    suite = _suite()
    xml = tmp_path / "part1_gpus2.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_x[2]" time="3.5">'
        '<properties><property name="gpus_needed" value="2"/><property name="gpus_visible" value="2"/></properties>'
        '</testcase>'
        '<testcase classname="tests.test_a" name="test_x[4]" time="0.1">'
        '<properties><property name="gpus_needed" value="4"/><property name="gpus_visible" value="2"/></properties>'
        '<skipped message="needs 4 GPUs"/></testcase>'
        '<testcase classname="tests.test_b" name="test_y" time="1.0"><failure message="boom&#10;more"/></testcase>'
        '</testsuite></testsuites>')
    record = suite.render("abc1234", [xml])
    assert "passed 1, failed 1, skipped 1 (1 for want of GPUs), not run 0" in record
    assert "| `tests/test_a.py::test_x[4]` | skipped | needs 4 GPUs | 4 | 2 | 0.1 |" in record
    assert "| `tests/test_b.py::test_y` | failed | boom |" in record
    (tmp_path / "gpu_suite.md").write_text(record)
    assert suite.last_seconds(tmp_path / "gpu_suite.md") == {"tests/test_a.py::test_x[2]": 3.5,
                                                             "tests/test_a.py::test_x[4]": 0.1,
                                                             "tests/test_b.py::test_y": 1.0}


def test_each_gpu_test_needs_what_its_parameters_say():
    """Collected on CPU: every gpu-marked test states its GPU count (conftest.py)."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_suite.py"), "plan", "--gpus", "4"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tests needing 4 GPU(s)" in out.stdout and "tests needing 2 GPU(s)" in out.stdout
    need, tests = {}, []
    for line in out.stdout.splitlines():
        if line.startswith("part "):
            gpus = int(line.split("needing ")[1].split(" GPU")[0])
        else:
            need[line.strip()] = gpus
    assert need["tests/test_step_graph_gpu.py::test_step_graph_replays_train_like_eager_steps[4-every_type]"] == 4
    assert need["tests/test_pipelines_gpu.py::test_two_ranks_average_dense_gradients_exactly_as_ddp_on_cuda"] == 2
    assert need["tests/test_cache_fill_gpu.py::test_compiled_kernels_match_the_reference"] == 1


def test_a_part_that_ended_without_its_report_lists_its_tests_as_not_run(tmp_path):
    suite = _suite()
    (tmp_path / "part1_gpus2.tests").write_text("tests/test_a.py::test_x[2]\ntests/test_a.py::test_y[2]\n")
    xml = tmp_path / "part2_gpus1.xml"
    xml.write_text('<testsuites><testsuite name="pytest"><testcase classname="tests.test_b" name="test_z" time="1.0"/>'
                   '</testsuite></testsuites>')
    (tmp_path / "part2_gpus1.tests").write_text("tests/test_b.py::test_z\n")
    record = suite.render("abc1234", [xml])
    assert "passed 1, failed 0, skipped 0 (0 for want of GPUs), not run 2" in record
    assert "| `tests/test_a.py::test_y[2]` | not run | its part ended without a report" in record


def test_parts_that_need_more_gpus_than_the_machine_has_are_not_run_and_say_why(tmp_path):
    """On a machine with fewer GPUs than a part needs, the part is not started (no skip for want of
    GPUs), and the record, rendered from the reports of two calls' folders, lists its tests as not
    run with the reason."""
    suite = _suite()
    parts = [suite.Part(gpus=4, tests=["tests/test_a.py::test_x[4]"], seconds=1.0)]
    assert suite.run(parts, gpus=1, out=tmp_path / "one", test_timeout=10, deadline=0) == 0
    assert (tmp_path / "one" / "part1_gpus4.why").read_text().strip() == "needs 4 GPUs; this machine has 1"
    assert not (tmp_path / "one" / "part1_gpus4.log").exists()  # nothing was started
    other = tmp_path / "two"
    other.mkdir()
    xml = other / "part1_gpus1.xml"
    xml.write_text('<testsuites><testsuite name="pytest"><testcase classname="tests.test_b" name="test_z" time="1.0"/>'
                   '</testsuite></testsuites>')
    (other / "part1_gpus1.tests").write_text("tests/test_b.py::test_z\n")
    ran = tmp_path / "one" / "part2_gpus1.xml"  # the first folder's report of a part that ran
    ran.write_text('<testsuites><testsuite name="pytest"><testcase classname="tests.test_c" name="test_w" time="1.0"/>'
                   '</testsuite></testsuites>')
    (tmp_path / "one" / "part2_gpus1.tests").write_text("tests/test_c.py::test_w\n")
    record = suite.render("abc1234", [ran, xml])
    assert "passed 2, failed 0, skipped 0 (0 for want of GPUs), not run 1" in record
    assert "| `tests/test_a.py::test_x[4]` | not run | needs 4 GPUs; this machine has 1 | 4 |" in record
