"""Targets: recpipe's rows against TorchRec's, recpipe's base, the stages-alone estimate and
the GPU busy time, each with its limit, from a ``bench.json`` (and the bound study's section).

    python benchmarks/studies/targets.py runs/bench/bench.json

prints a markdown table: every check the record's rows can speak to, its measured value,
its limit and whether it is met, with the paired per-round ratio where there is one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository's packages first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from recpipe.bench.compare import paired  # noqa: E402
from recpipe.bench.report import Row, grid  # noqa: E402

__all__ = ["TARGETS", "check_targets", "targets_md", "x_bound_of"]

# Targets of recpipe against TorchRec and the hardware (measured in one run, same hardware).
TARGETS = {
    "vs_torchrec": 1.00,  # recpipe P50 / TorchRec P50 of the same pipeline
    "vs_base": 1.02,  # recpipe pipeline P50 / recpipe base P50
    "x_bound": 1.15,  # P50 / hardware bound (sparse_dist, fused_sparse_dist, semi_sync; prefetch on UVM)
    "reserved_over_alloc": 1.05,  # peak reserved / peak allocated, every recpipe pipeline
    "semi_sync_extra_peak": 0.10,  # semi_sync's peak over sparse_dist's, minus 1
    # GPU rows only: x_busy needs device kernels
    "x_gpu_busy": 1.25,  # the fastest recpipe pipeline's P50 / its GPU busy time per step
    "fastest_vs_torchrec": 1 / 1.5,  # fastest recpipe P50 / fastest TorchRec P50 (= 1.5 x the samples/s)
}
BOUND_TARGETED = ("sparse_dist", "fused_sparse_dist", "semi_sync", "prefetch")


def _find(rows: list[Row], pipeline: str, impl: str) -> Row | None:
    return next((r for r in rows if r.pipeline == pipeline and r.impl == impl and r.status == "ok"), None)


def _check(target: str, pipeline: str, value: float | None, limit: float, detail: str = "",
           extra: dict[str, Any] | None = None) -> dict[str, Any]:
    met = None if value is None else value <= limit + 1e-12
    return {"target": target, "pipeline": pipeline, "value": value, "limit": limit, "met": met, "detail": detail,
            **(extra or {})}


def check_targets(rows: list[Row], bound: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every target that this bench's rows can speak to, with the measured value; ``bound``:
    the bound study's section (its ``x_bound`` per row)."""
    x_bound = {(x["pipeline"], x["impl"]): x["x_bound"] for x in (bound or {}).get("x_bound", [])}
    out: list[dict[str, Any]] = []
    base = _find(rows, "base", "recpipe")
    for row in (r for r in rows if r.impl == "recpipe" and r.status == "ok"):
        theirs = _find(rows, row.pipeline, "torchrec")
        if theirs is not None:
            pair = paired(row, theirs)
            out.append(_check("vs_torchrec", row.pipeline, pair["pooled_ratio"], TARGETS["vs_torchrec"],
                              "recpipe P50 / TorchRec P50 (pooled steps)", {"paired": pair}))
        if base is not None and row.pipeline != "base":
            pair = paired(row, base)
            out.append(_check("vs_base", row.pipeline, pair["pooled_ratio"], TARGETS["vs_base"],
                              "P50 / recpipe base P50 (pooled steps)", {"paired": pair}))
        if x_bound.get((row.pipeline, row.impl)) is not None and row.pipeline in BOUND_TARGETED:
            resource = (bound or {}).get("bound_resource", "?")
            out.append(_check("x_bound", row.pipeline, x_bound[(row.pipeline, row.impl)], TARGETS["x_bound"],
                              f"P50 / sum of stages alone (largest on {resource})"))
        ratio = row.memory.get("reserved_over_alloc")
        if ratio is not None:
            out.append(_check("reserved_over_alloc", row.pipeline, ratio, TARGETS["reserved_over_alloc"],
                              "peak reserved / peak allocated (worst round)"))
    semi, sparse = _find(rows, "semi_sync", "recpipe"), _find(rows, "sparse_dist", "recpipe")
    if semi is not None and sparse is not None and semi.memory and sparse.memory:
        whole = semi.memory["peak_alloc_gib"] / sparse.memory["peak_alloc_gib"] - 1
        step_s, step_d = semi.memory["step_peak_alloc_above_build_gib"], sparse.memory["step_peak_alloc_above_build_gib"]
        out.append(_check("semi_sync_extra_peak", "semi_sync", whole, TARGETS["semi_sync_extra_peak"],
                          "peak allocated (model included) over sparse_dist's, minus 1"))
        out.append(_check("semi_sync_extra_peak", "semi_sync (step only)", step_s / step_d - 1 if step_d else None,
                          TARGETS["semi_sync_extra_peak"], "step peak above the model over sparse_dist's, minus 1"))
    return out + _speed_targets(rows)


def _speed_targets(rows: list[Row]) -> list[dict[str, Any]]:
    """recpipe's fastest pipeline against TorchRec's fastest, and against its GPU busy time."""
    ok = [r for r in rows if r.status == "ok" and r.step_ms.get("p50")]
    ours = min((r for r in ok if r.impl == "recpipe"), key=lambda r: r.step_ms["p50"], default=None)
    theirs = min((r for r in ok if r.impl == "torchrec"), key=lambda r: r.step_ms["p50"], default=None)
    out = []
    if ours is not None and theirs is not None:
        out.append(_check("fastest_vs_torchrec", f"{ours.pipeline} vs TorchRec {theirs.pipeline}",
                          ours.step_ms["p50"] / theirs.step_ms["p50"], TARGETS["fastest_vs_torchrec"],
                          "fastest recpipe P50 / fastest TorchRec P50 (pooled steps)"))
    if ours is not None and ours.x_busy is not None:
        out.append(_check("x_gpu_busy", ours.pipeline, ours.x_busy, TARGETS["x_gpu_busy"],
                          "fastest recpipe pipeline: P50 / GPU busy time per step (profiled steps)"))
    return out


_LABELS = {
    "vs_torchrec": "P50 at or below TorchRec's",
    "vs_base": "P50 at most 1.02 x recpipe base",
    "x_bound": "within 1.15 x the stages-alone estimate",
    "reserved_over_alloc": "peak reserved at most 1.05 x allocated",
    "semi_sync_extra_peak": "semi_sync's extra peak over sparse_dist at most 10 %",
    "fastest_vs_torchrec": "fastest recpipe at least 1.5 x the samples/s of fastest TorchRec",
    "x_gpu_busy": "fastest recpipe step at most 1.25 x its GPU busy time",
}


def _paired_cell(pair: dict[str, Any] | None) -> str:
    if not pair:
        return "-"
    p = pair["sign_test_p"]
    return (f"median {pair['median_ratio']:.3f} [{pair['min_ratio']:.3f}, {pair['max_ratio']:.3f}]; "
            f"faster in {pair['a_faster_rounds']}/{pair['rounds']} rounds"
            + ("" if p is None else f"; sign test p={p:.2g}"))


def targets_md(checks: list[dict[str, Any]], rounds: int) -> list[str]:
    """Markdown of ``check_targets``: every check with its number and verdict."""
    lines = ["## Targets", ""]
    if not checks:
        return lines + ["No target applies to the rows of this run.", ""]
    lines += [
        f"Computed from the rows above ({rounds} round{'s' if rounds != 1 else ''}; a ratio below 1 means the "
        "recpipe pipeline is faster). Paired: the ratio within each round (same drift on both sides).",
        "",
    ]
    body = []
    for c in checks:
        v = c["value"]
        shown = "-" if v is None else f"{v:+.1%}" if c["target"] == "semi_sync_extra_peak" else f"{v:.3f}"
        limit = f"{c['limit']:+.0%}" if c["target"] == "semi_sync_extra_peak" else f"{c['limit']:.2f}"
        verdict = "-" if c["met"] is None else "yes" if c["met"] else "**no**"
        body.append([_LABELS[c["target"]], c["pipeline"], shown, limit, verdict, c["detail"],
                     _paired_cell(c.get("paired"))])
    header = ("target", "pipeline", "measured", "limit", "met", "what", "paired by round")
    missed = sum(c["met"] is False for c in checks)
    return lines + [grid(header, body, markdown=True), "",
                    f"{len(checks) - missed} of {len(checks)} checks met." if missed else "Every check met.", ""]


def x_bound_of(record: dict[str, Any]) -> dict[str, Any] | None:
    """The bound section of a record, with ``x_bound`` per row (older records kept it on the rows)."""
    bound = record.get("bound")
    if bound is None or "x_bound" in bound:
        return bound
    rows = [{"pipeline": r["pipeline"], "impl": r["impl"], "x_bound": r["x_bound"]} for r in record["rows"]
            if r.get("x_bound") is not None]
    return dict(bound, x_bound=rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("record", help="a bench.json")
    args = parser.parse_args(argv)
    record = json.loads(Path(args.record).read_text())
    rows = [Row.from_dict(r) for r in record["rows"]]
    print("\n".join(targets_md(check_targets(rows, x_bound_of(record)), record["bench"]["rounds"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
