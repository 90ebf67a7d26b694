"""The studies' scripts: every one answers ``--help``; bench_summary renders the published
numbers; memory_at_peak replays an allocator history and names the streams by role;
trainer_vs_bench interleaves pairs and profiles the host."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUDIES = ROOT / "benchmarks" / "studies"
MODULES = sorted(p.stem for p in STUDIES.glob("*.py") if p.stem not in ("__init__", "common"))


def _help(argv: list[str], cwd: Path | str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv, "--help"], capture_output=True, text=True, cwd=cwd, timeout=600)


@pytest.mark.parametrize("name", MODULES)
def test_every_study_answers_help(name, monkeypatch, capsys):
    """Each study's ``main`` prints its usage for ``--help`` (in this process: one import of torch)."""
    import importlib

    module = importlib.import_module(f"benchmarks.studies.{name}")
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])
    with pytest.raises(SystemExit) as done:
        module.main()
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out


def test_studies_and_probes_run_as_scripts_from_anywhere():
    """``python benchmarks/studies/X.py --help`` outside the checkout: the script finds the
    repository's packages (a study with the bench's flags; every probe, which prints its docstring)."""
    out = _help([str(STUDIES / "bound.py")], "/")
    assert out.returncode == 0 and "--with-torchrec" in out.stdout and "--pipelines" in out.stdout, out.stderr[-2000:]
    probes = sorted(STUDIES.glob("probes/*.py"))
    assert len(probes) == 5
    for probe in probes:
        out = _help([str(probe)], "/")
        assert out.returncode == 0 and out.stdout.startswith("Probe"), (probe.name, out.stderr[-2000:])


def test_bench_summary_renders_the_published_numbers(tmp_path: Path):
    """benchmarks/studies/bench_summary.py: the per-hardware report and the README headline come
    from the suites' bench.json, number for number."""
    import json

    suite = ROOT / "benchmarks" / "results" / "h100x1" / "opt_heavy.json"
    record = json.loads(suite.read_text())
    ours = next(r for r in record["rows"] if r["pipeline"] == "sparse_dist" and r["impl"] == "recpipe")
    theirs = next(r for r in record["rows"] if r["pipeline"] == "sparse_dist" and r["impl"] == "torchrec")
    script = str(STUDIES / "bench_summary.py")
    head = subprocess.run([sys.executable, script, "headline", str(suite)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert head.returncode == 0, head.stderr[-2000:]
    ratio = ours["step_ms"]["p50"] / theirs["step_ms"]["p50"]
    line = next(x for x in head.stdout.splitlines() if "| sparse_dist |" in x)
    assert f"| {ours['step_ms']['p50']:.2f} | {theirs['step_ms']['p50']:.2f} | {ratio:.3f} |" in line
    out = tmp_path / "summary.md"
    rep = subprocess.run([sys.executable, script, "report", str(out), "--title", "t", str(suite)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert rep.returncode == 0, rep.stderr[-2000:]
    text = out.read_text()
    assert record["command"] in text and "### Targets" in text and "### Stages timed alone" in text
    assert f"**Stages alone: {record['bound']['bound_ms']:.3f} ms per step" in text


def test_memory_at_peak_replays_the_allocator_history_to_the_peak():
    import benchmarks.studies.memory_at_peak as m

    def frames(path: str, line: int) -> list[dict]:
        return [{"filename": "/usr/lib/python3/torch/nn/functional.py", "line": 1, "name": "linear"},
                {"filename": f"/site/{path}", "line": line, "name": "f"}]

    mib = 2**20
    trace = [
        {"action": "alloc", "addr": 1, "size": 4 * mib, "stream": 0, "frames": frames("recpipe/pipelines/steps.py", 10)},
        {"action": "alloc", "addr": 2, "size": 8 * mib, "stream": 7, "frames": frames("torchrec/distributed/dist_data.py", 5)},
        {"action": "free_requested", "addr": 1, "size": 4 * mib, "stream": 0, "frames": []},
        {"action": "alloc", "addr": 3, "size": 2 * mib, "stream": 0, "frames": frames("recpipe/pipelines/steps.py", 10)},
        {"action": "free_completed", "addr": 1, "size": 4 * mib, "stream": 0, "frames": []},
        {"action": "free_completed", "addr": 99, "size": mib, "stream": 0, "frames": []},  # allocated before recording
        {"action": "alloc", "addr": 4, "size": 1 * mib, "stream": 0, "frames": []},
    ]
    best, alive = m.peak_live(trace)
    assert best == 14 * mib and set(alive) == {1, 2, 3}  # freed only at free_completed
    summary = m.summarize(trace, {0: "compute", 7: "dist"})
    assert summary["by_site"] == [("torchrec/distributed/dist_data.py:5 f", 8 * mib),
                                  ("recpipe/pipelines/steps.py:10 f", 6 * mib)]
    assert summary["by_stream"] == [("dist", 8 * mib), ("compute", 6 * mib)]


def test_memory_at_peak_names_the_last_occupant_of_each_free_block():
    import benchmarks.studies.memory_at_peak as m

    comm = [{"filename": "/site/torchrec/distributed/comm_ops.py", "line": 422, "name": "allocate"}]
    mlp = [{"filename": "/site/torchrec/modules/mlp.py", "line": 80, "name": "forward"}]
    trace = [  # two occupants of [100, 160): the newer one counts
        {"action": "alloc", "addr": 100, "size": 60, "stream": 7, "frames": mlp},
        {"action": "free_completed", "addr": 100, "size": 60, "stream": 7, "frames": mlp},
        {"action": "alloc", "addr": 110, "size": 40, "stream": 7, "frames": comm},
        {"action": "free_completed", "addr": 110, "size": 40, "stream": 7, "frames": comm},
    ]
    segments = [
        {"stream": 7, "total_size": 200, "allocated_size": 120, "blocks": [
            {"address": 0, "size": 100, "state": "active_allocated"},
            {"address": 100, "size": 60, "state": "inactive"},
            {"address": 160, "size": 20, "state": "active_allocated"},
            {"address": 180, "size": 20, "state": "inactive"}]},
        {"stream": 9, "total_size": 50, "allocated_size": 50, "blocks": [
            {"address": 500, "size": 50, "state": "active_allocated"}]},
    ]
    got = m.reserved_summary(segments, trace, {7: "compute"})
    assert got["by_stream"] == {
        "compute": {"reserved": 200, "allocated": 120, "free": 80, "largest_free": 60, "segments": 1},
        "9": {"reserved": 50, "allocated": 50, "free": 0, "largest_free": 0, "segments": 1}}
    assert got["free_by_site"] == [("compute: torchrec/distributed/comm_ops.py:422 allocate", 60),
                                   ("compute: (before recording)", 20)]


def test_memory_at_peak_finds_the_free_holes_at_the_peak_allocated():
    import benchmarks.studies.memory_at_peak as m

    mib = 2**20
    grad = [{"filename": "/site/torchrec/distributed/comm_ops.py", "line": 1235, "name": "recat"}]
    mlp = [{"filename": "/site/torchrec/modules/mlp.py", "line": 80, "name": "forward"}]
    # One 100 MiB segment; A [0, 10) and B [50, 60) alive throughout (allocated before recording).
    segments = [{"device": 0, "address": 0, "total_size": 100 * mib, "stream": 7, "blocks": [
        {"address": 0, "size": 10 * mib, "state": "active_allocated"},
        {"address": 10 * mib, "size": 40 * mib, "state": "inactive"},
        {"address": 50 * mib, "size": 10 * mib, "state": "active_allocated"},
        {"address": 60 * mib, "size": 20 * mib, "state": "inactive"},
        {"address": 80 * mib, "size": 20 * mib, "state": "inactive"}]},
        # mapped only after the peak: not reserved at the peak
        {"device": 0, "address": 200 * mib, "total_size": 4 * mib, "stream": 9, "blocks": [
            {"address": 200 * mib, "size": 4 * mib, "state": "inactive"}]}]
    trace = [
        {"action": "alloc", "addr": 10 * mib, "size": 30 * mib, "stream": 7, "frames": mlp},
        {"action": "free_completed", "addr": 10 * mib, "size": 30 * mib, "stream": 7, "frames": mlp},
        {"action": "alloc", "addr": 10 * mib, "size": 20 * mib, "stream": 7, "frames": grad},
        {"action": "alloc", "addr": 60 * mib, "size": 25 * mib, "stream": 7, "frames": grad},  # the peak: 65 MiB
        {"action": "free_completed", "addr": 10 * mib, "size": 20 * mib, "stream": 7, "frames": grad},
        {"action": "free_completed", "addr": 60 * mib, "size": 25 * mib, "stream": 7, "frames": grad},
        {"action": "segment_map", "addr": 200 * mib, "size": 4 * mib, "stream": 9, "frames": []},
        {"action": "alloc", "addr": 85 * mib, "size": 15 * mib, "stream": 7, "frames": mlp},
        {"action": "free_completed", "addr": 85 * mib, "size": 15 * mib, "stream": 7, "frames": mlp},
    ]
    gap = m.gap_at_peak({"segments": segments, "device_traces": [trace]}, 0, {7: "compute"})
    assert gap["peak_allocated"] == 65 * mib and gap["event"] == 4
    assert gap["by_stream"] == {"compute": {"reserved": 100 * mib, "allocated": 65 * mib, "free": 35 * mib, "holes": 2}}
    assert gap["holes"] == [
        {"stream": "compute", "size": 20 * mib, "last_before": "30 MiB at torchrec/modules/mlp.py:80 forward",
         "next_after": "(not reused)"},
        {"stream": "compute", "size": 15 * mib, "last_before": "(before recording)",
         "next_after": "15 MiB at torchrec/modules/mlp.py:80 forward"}]


def test_memory_at_peak_names_streams_by_role(monkeypatch):
    """A recpipe pipeline's streams by their role, a TorchRec one's ``*_stream`` attributes; the
    current stream is compute."""
    import torch

    import benchmarks.studies.memory_at_peak as m

    class Fake:  # a torch.cuda.Stream as far as the function looks (no CUDA here)
        def __init__(self, handle):
            self.cuda_stream = handle

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Fake(0))

    @dataclasses.dataclass
    class Roles:
        memcpy: object
        dist: object

    class RecpipePipe:
        streams = Roles(memcpy=Fake(7), dist=None)

    class TorchRecPipe:
        def __init__(self):
            self._data_dist_stream = Fake(7)
            self._memcpy_stream = Fake(9)

    assert m.stream_roles(torch.device("cuda", 0), RecpipePipe()) == {0: "compute", 7: "memcpy"}
    assert m.stream_roles(torch.device("cuda", 0), TorchRecPipe()) == {0: "compute", 7: "data_dist", 9: "memcpy"}


@pytest.mark.slow
def test_trainer_vs_bench_interleaves_pairs_and_profiles_the_host(tmp_path: Path):
    root = ROOT
    out = tmp_path / "tvb"
    small = ["distributed.nproc=1", "train.device=cpu", "distributed.backend=gloo", "data.batch_size=128",
             "data.synthetic.num_eval_batches=1"]
    cmd = [sys.executable, str(STUDIES / "trainer_vs_bench.py"), "--config", str(root / "configs" / "quickstart.yaml"),
           "--pipeline", "sparse_dist", "--steps", "20", "--steady-from", "5", "--bench-steps", "5", "--bench-warmup", "2",
           "--pairs", "2", "--profile-steps", "3", "--out", str(out)]
    for pair in small:
        cmd += ["--set", pair]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((out / "trainer_vs_bench.json").read_text())
    ratios = [pair["ratio"] for pair in result["pairs"]]
    assert len(ratios) == 2 and result["ratio"] == pytest.approx(sum(ratios) / 2)
    for k in range(2):
        pair = result["pairs"][k]
        assert pair["train"]["window_steps"] == [5, 20]  # the profiled steps come after the window
        assert pair["ratio"] == pytest.approx(pair["train"]["samples_per_s_wall"] / pair["bench"]["samples_per_s_wall"])
        assert "Self CPU" in (out / f"pair{k}" / "host_profile.txt").read_text()
        parts = pair["train"]["host_parts"]  # steps 6-20 (step 5 has no "outside" before it inside the window)
        assert set(parts) == {"progress", "next", "outside"}
        assert 0 <= parts["next"]["total"] <= parts["progress"]["total"]
        assert all(p["p50"] <= p["p90"] <= p["max"] <= p["total"] for p in parts.values())
        assert pair["train"]["intra_op_threads"] >= 1  # recorded: the GPU trainer's rule sets it (train/trainer.py)
    assert "trainer host time per step" in done.stdout
    assert "median ratio of 2 interleaved pairs" in done.stdout
