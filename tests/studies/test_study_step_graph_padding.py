"""benchmarks/studies/step_graph_padding.py on CPU, small: both layouts timed, the padding
checked against the per-key loop on every timed batch, the table written."""

from __future__ import annotations

from pathlib import Path

from benchmarks.studies.step_graph_padding import main

ROOT = Path(__file__).resolve().parents[2]


def test_step_graph_padding_times_both_layouts(tmp_path: Path):
    out = tmp_path / "padding.md"
    rows = main(["--config", str(ROOT / "configs" / "quickstart.yaml"), "--set", "data.batch_size=64",
                 "--calls", "3", "--ranks", "2", "--out", str(out)])
    assert [(r["layout"], r["buckets"]) for r in rows] == [("row_wise over 2 ranks", 2), ("1 GPU, no buckets", 1)]
    assert all(r["loop_ms"] > 0 and r["vectorized_ms"] > 0 and r["stride"] == 64 for r in rows)
    text = out.read_text()
    assert "step_graph_padding.py --config" in text and "--ranks 2" in text
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert table[0].startswith("| layout |") and len(table) == 4
