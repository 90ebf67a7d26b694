"""What several rounds of one bench say: the run order, merged rows, paired
comparisons and the issue's targets, each computed from the measured numbers.

Rounds (``recpipe bench --rounds R``). Single runs of a host-bound step vary by about
10 % from run to run (clock boost, host jitter, allocator state), more than the
differences between pipelines. So every (pipeline, implementation) runs R times,
interleaved: round r rotates the pipeline order by r and, on odd rounds, runs
TorchRec's pipeline before recpipe's. Drift over the run then hits both sides alike.

* A merged row pools the timed steps of all its rounds (P50/P90 over R x steps) and
  keeps each round's P50 (``round_p50_ms``). Memory: per number the maximum over
  rounds (``reserved_over_alloc`` too: the worst round, not a ratio of maxima).
* A paired comparison of A and B (recpipe vs TorchRec, or a pipeline vs recpipe's
  base) divides A's P50 by B's *within each round*, then reports the median, the
  range, and in how many rounds A was faster, with a two-sided sign-test p-value
  (under "no difference" each round is a coin flip). With R = 1 it is one ratio and
  no p-value.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

from recpipe.bench.measure import mean_leaves, summarize_ms
from recpipe.bench.report import Row, grid
from recpipe.bench.trace import merge_rounds as merge_traces

__all__ = ["TARGETS", "check_targets", "merge_rounds", "paired", "round_order", "sign_test_p"]

# Issue 5's and issue 11's targets (measured in one run, same hardware).
TARGETS = {
    "vs_torchrec": 1.00,  # recpipe P50 / TorchRec P50 of the same pipeline
    "vs_base": 1.02,  # recpipe pipeline P50 / recpipe base P50
    "x_bound": 1.15,  # P50 / hardware bound (sparse_dist, fused_sparse_dist, semi_sync; prefetch on UVM)
    "reserved_over_alloc": 1.05,  # peak reserved / peak allocated, every recpipe pipeline
    "semi_sync_extra_peak": 0.10,  # semi_sync's peak over sparse_dist's, minus 1
    # issue 11 (GPU rows only: x_busy needs device kernels)
    "x_gpu_busy": 1.25,  # the fastest recpipe pipeline's P50 / its GPU busy time per step
    "fastest_vs_torchrec": 1 / 1.5,  # fastest recpipe P50 / fastest TorchRec P50 (= 1.5 x the samples/s)
}
BOUND_TARGETED = ("sparse_dist", "fused_sparse_dist", "semi_sync", "prefetch")


def round_order(runs: Sequence[tuple[str, str]], r: int) -> list[tuple[str, str]]:
    """The (pipeline, impl) runs of round ``r``: pipelines rotated by ``r``, and on odd
    rounds each pipeline's implementations in reverse order."""
    names = list(dict.fromkeys(name for name, _ in runs))
    shift = r % len(names) if names else 0
    order = []
    for name in names[shift:] + names[:shift]:
        impls = [run for run in runs if run[0] == name]
        order += impls[::-1] if r % 2 else impls
    return order


def merge_rounds(rounds: list[Row], global_batch: int) -> Row:
    """One row from the same (pipeline, impl) measured in each round. A round that
    did not run ok makes the merged row that round's status (the first such)."""
    first = rounds[0]
    bad = next((r for r in rounds if r.status != "ok"), None)
    if len(rounds) == 1 or bad is not None:
        out = bad or first
        out.round_p50_ms = [r.step_ms["p50"] for r in rounds if r.status == "ok"]
        return out
    row = Row(pipeline=first.pipeline, impl=first.impl, pipeline_class=first.pipeline_class, options=first.options,
              config_overrides=first.config_overrides, notes=list(first.notes),
              torchrec_pipelined_modules=first.torchrec_pipelined_modules)
    row.step_ms_per_step = [t for r in rounds for t in r.step_ms_per_step]
    row.steps = len(row.step_ms_per_step)
    row.step_ms = summarize_ms(row.step_ms_per_step)
    row.round_p50_ms = [r.step_ms["p50"] for r in rounds]
    row.host_ms_per_step = [t for r in rounds for t in r.host_ms_per_step]
    row.host_ms = summarize_ms(row.host_ms_per_step) if row.host_ms_per_step else {}
    row.step_ms_p50_per_rank = [statistics.median(col) for col in zip(*(r.step_ms_p50_per_rank for r in rounds))]
    world = len(row.step_ms_p50_per_rank) or 1
    row.samples_per_s = global_batch / (row.step_ms["p50"] / 1e3)
    row.samples_per_s_per_gpu = row.samples_per_s / world
    row.wall_s = sum(r.wall_s or 0.0 for r in rounds)
    row.samples_per_s_wall = global_batch * row.steps / row.wall_s if row.wall_s else None
    row.build_s = max(r.build_s or 0.0 for r in rounds)
    row.memory = _merge_memory([r.memory for r in rounds])
    if first.trace:
        row.trace = merge_traces([r.trace for r in rounds])
        row.gpu_busy_ms = row.trace.get("gpu_busy_ms")
        row.x_busy = row.step_ms["p50"] / row.gpu_busy_ms if row.gpu_busy_ms else None
    if first.cache:
        with_numbers = all(r.cache.get("hit_rate") is not None for r in rounds)
        row.cache = dict(mean_leaves([r.cache for r in rounds]), rounds=len(rounds)) if with_numbers else first.cache
    return row


def _merge_memory(mems: list[dict[str, Any]]) -> dict[str, Any]:
    if not mems or not mems[0]:
        return {}
    out: dict[str, Any] = {}
    for key in mems[0]:
        if key in ("per_rank", "reserved_by_stream"):  # the worst round's, below
            continue
        values = [m[key] for m in mems if m.get(key) is not None]
        out[key] = max(values) if values else None
    worst = max(mems, key=lambda m: m.get("peak_reserved_gib") or 0.0)
    for key in ("per_rank", "reserved_by_stream"):
        if key in worst:
            out[key] = worst[key]
    return out


def sign_test_p(wins: int, n: int) -> float | None:
    """Two-sided sign test: P(a split at least this uneven | each round a coin flip)."""
    if n < 2:
        return None
    k = min(wins, n - wins)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def paired(a: Row, b: Row) -> dict[str, Any] | None:
    """A's P50 over B's, per round (both need the same rounds, all ok)."""
    if a.status != "ok" or b.status != "ok" or not a.round_p50_ms or len(a.round_p50_ms) != len(b.round_p50_ms):
        return None
    ratios = [x / y for x, y in zip(a.round_p50_ms, b.round_p50_ms)]
    wins = sum(r < 1.0 for r in ratios)
    return {
        "pooled_ratio": a.step_ms["p50"] / b.step_ms["p50"],
        "round_ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
        "rounds": len(ratios),
        "a_faster_rounds": wins,
        "sign_test_p": sign_test_p(wins, len(ratios)),
    }


def _find(rows: list[Row], pipeline: str, impl: str) -> Row | None:
    return next((r for r in rows if r.pipeline == pipeline and r.impl == impl and r.status == "ok"), None)


def _check(target: str, pipeline: str, value: float | None, limit: float, detail: str = "",
           extra: dict[str, Any] | None = None) -> dict[str, Any]:
    met = None if value is None else value <= limit + 1e-12
    return {"target": target, "pipeline": pipeline, "value": value, "limit": limit, "met": met, "detail": detail,
            **(extra or {})}


def check_targets(rows: list[Row], bound: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every target that this bench's rows can speak to, with the measured value."""
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
        if row.x_bound is not None and row.pipeline in BOUND_TARGETED:
            resource = (bound or {}).get("bound_resource", "?")
            out.append(_check("x_bound", row.pipeline, row.x_bound, TARGETS["x_bound"],
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
    """Issue 11: recpipe's fastest pipeline against TorchRec's fastest, and against its GPU busy time."""
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
