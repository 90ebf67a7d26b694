"""benchmarks/studies/memory_at_peak.py: the allocator history replayed to the peak (live
blocks by site and stream, the free blocks' last occupants, the free holes at the peak
allocated), streams named by role, the script on CPU (a saved snapshot analysed; a
measurement refused without CUDA) and a small measurement on one GPU."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import torch

import benchmarks.studies.memory_at_peak as m

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "configs" / "bench" / "smoke_cpu.yaml")
MiB = 2**20


def test_memory_at_peak_replays_the_allocator_history_to_the_peak():
    def frames(path: str, line: int) -> list[dict]:
        return [{"filename": "/usr/lib/python3/torch/nn/functional.py", "line": 1, "name": "linear"},
                {"filename": f"/site/{path}", "line": line, "name": "f"}]

    mib = 2**20
    trace = [
        {"action": "alloc", "addr": 1, "size": 4 * mib, "stream": 0, "frames": frames("recpipe/runtime/steps.py", 10)},
        {"action": "alloc", "addr": 2, "size": 8 * mib, "stream": 7, "frames": frames("torchrec/distributed/dist_data.py", 5)},
        {"action": "free_requested", "addr": 1, "size": 4 * mib, "stream": 0, "frames": []},
        {"action": "alloc", "addr": 3, "size": 2 * mib, "stream": 0, "frames": frames("recpipe/runtime/steps.py", 10)},
        {"action": "free_completed", "addr": 1, "size": 4 * mib, "stream": 0, "frames": []},
        {"action": "free_completed", "addr": 99, "size": mib, "stream": 0, "frames": []},  # allocated before recording
        {"action": "alloc", "addr": 4, "size": 1 * mib, "stream": 0, "frames": []},
    ]
    best, alive = m.peak_live(trace)
    assert best == 14 * mib and set(alive) == {1, 2, 3}  # freed only at free_completed
    summary = m.summarize(trace, {0: "compute", 7: "dist"})
    assert summary["by_site"] == [("torchrec/distributed/dist_data.py:5 f", 8 * mib),
                                  ("recpipe/runtime/steps.py:10 f", 6 * mib)]
    assert summary["by_stream"] == [("dist", 8 * mib), ("compute", 6 * mib)]


def test_memory_at_peak_names_the_last_occupant_of_each_free_block():
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


def _holes_snapshot() -> dict:
    """One 100 MiB segment of stream 7 whose peak allocated (65 MiB) leaves two free holes."""
    grad = [{"filename": "/site/torchrec/distributed/comm_ops.py", "line": 1235, "name": "recat"}]
    segments = [{"device": 0, "address": 0, "total_size": 100 * MiB, "stream": 7, "blocks": [
        {"address": 0, "size": 10 * MiB, "state": "active_allocated"},
        {"address": 10 * MiB, "size": 90 * MiB, "state": "inactive"}]}]
    trace = [
        {"action": "alloc", "addr": 10 * MiB, "size": 20 * MiB, "stream": 7, "frames": grad},
        {"action": "alloc", "addr": 60 * MiB, "size": 25 * MiB, "stream": 7, "frames": grad},  # the peak: 55 MiB
        {"action": "free_completed", "addr": 10 * MiB, "size": 20 * MiB, "stream": 7, "frames": grad},
        {"action": "free_completed", "addr": 60 * MiB, "size": 25 * MiB, "stream": 7, "frames": grad},
    ]
    return {"segments": segments, "device_traces": [trace]}


def test_the_script_analyses_a_saved_snapshot_on_cpu(tmp_path: Path, capsys):
    """``--snapshot``: the free holes at the peak allocated of a saved snapshot, no GPU needed."""
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(_holes_snapshot()))
    assert m.main(["--snapshot", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"## {path}") and "| 7 | 0.098 | 0.054 | 0.044 | 2 |" in out
    assert "| 30.0 | 7 | `(before recording)` | `(not reused)` |" in out
    assert "| 15.0 | 7 | `(before recording)` | `(not reused)` |" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_a_measurement_without_cuda_says_it_needs_cuda(tmp_path: Path):
    with pytest.raises(SystemExit, match="memory_at_peak needs CUDA"):
        m.main(["--config", SMOKE, "--out", str(tmp_path)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_memory_at_peak_on_one_gpu(tmp_path: Path):
    """The study end to end on one GPU, as the published reports ran it (smaller)."""
    out = tmp_path / "mem"
    overrides = ["train.device=cuda", "distributed.backend=nccl", "distributed.nproc=1", "data.batch_size=512"]
    assert m.main(["--config", SMOKE, *(x for o in overrides for x in ("--set", o)), "--pipelines",
                   "sparse_dist,semi_sync", "--warmup", "3", "--steps", "2", "--out", str(out)]) == 0
    md = (out / "memory_at_peak.md").read_text()
    assert md.count("rank 0: extra at peak") == 2 and "## sparse_dist" in md and "## semi_sync" in md
    assert "`python benchmarks/studies/memory_at_peak.py --config" in md and "| compute |" in md
    assert "peak reserved / peak allocated over the recorded steps" in md
    assert sorted(p.name for p in out.glob("*.pickle")) == ["snapshot_semi_sync_rank0.pickle",
                                                           "snapshot_sparse_dist_rank0.pickle"]
