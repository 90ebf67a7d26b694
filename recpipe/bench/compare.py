"""Rounds (``--rounds R``): the interleaved run order, one row merged from its rounds, and paired
comparisons with a sign test. Runs of a host-bound step vary by about 10 %, more than pipelines differ,
so A / B is taken within each round, where drift hits both sides alike (docs/benchmarking.md, "Rounds")."""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any, Sequence

from recpipe.bench.report import Row, md_section

__all__ = ["comparisons", "comparisons_md", "mean_leaves", "merge_rounds", "paired", "round_order", "sign_test_p"]


def round_order(runs: Sequence[tuple[str, str]], r: int) -> list[tuple[str, str]]:
    """The (pipeline, impl) runs of round ``r``: pipelines rotated by ``r``, implementations reversed on odd rounds."""
    names = list(dict.fromkeys(name for name, _ in runs))
    shift = r % len(names) if names else 0
    by_name = [[run for run in runs if run[0] == name] for name in names[shift:] + names[:shift]]
    return [run for impls in by_name for run in (impls[::-1] if r % 2 else impls)]


def mean_leaves(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """Key by key over dicts of the same shape (one per round): the mean of numbers
    (None if any round has None), recursively for dicts, else the first round's."""
    out: dict[str, Any] = {}
    for key, first in dicts[0].items():
        values = [d.get(key) for d in dicts]
        if isinstance(first, bool) or not all(isinstance(v, (int, float, dict)) for v in values):
            out[key] = None if any(v is None for v in values) and isinstance(first, (int, float)) else first
        elif all(isinstance(v, dict) for v in values):
            out[key] = mean_leaves(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def merge_rounds(rounds: list[Row], global_batch: int) -> Row:
    """One row from the rounds of one (pipeline, impl): steps pooled, each round's P50 kept, memory the worst
    round's, trace and cache numbers the mean; a round that did not run ok makes the row that round's."""
    first = rounds[0]
    bad = next((r for r in rounds if r.status != "ok"), None)
    if len(rounds) == 1 or bad is not None:
        out = bad or first
        out.round_p50_ms = [r.step_ms["p50"] for r in rounds if r.status == "ok"]
        return out
    # a copy of the first round's row (its first_step_s: later rounds find the compiled kernels cached)
    row = dataclasses.replace(
        first, notes=list(first.notes), round_p50_ms=[r.step_ms["p50"] for r in rounds],
        check=next((r.check for r in rounds if r.check != first.check), first.check),
        step_ms_per_step=[t for r in rounds for t in r.step_ms_per_step],
        host_ms_per_step=[t for r in rounds for t in r.host_ms_per_step],
        step_ms_p50_per_rank=[statistics.median(col) for col in zip(*(r.step_ms_p50_per_rank for r in rounds))],
        wall_s=sum(r.wall_s or 0.0 for r in rounds), build_s=max(r.build_s or 0.0 for r in rounds),
        first_step_s_rounds=[r.first_step_s for r in rounds if r.first_step_s is not None],
        memory=_merge_memory([r.memory for r in rounds]),
        trace=_merge_traces([r.trace for r in rounds]) if first.trace else {})
    row.fill_rates(global_batch)
    if first.cache and all(r.cache.get("hit_rate") is not None for r in rounds):
        row.cache = dict(mean_leaves([r.cache for r in rounds]), rounds=len(rounds))
    return row


def _merge_memory(mems: list[dict[str, Any]]) -> dict[str, Any]:
    """Per number the maximum over rounds (``reserved_over_alloc`` too: the worst round's
    ratio, not a ratio of maxima); per-rank details of the round that reserved most."""
    if not mems or not mems[0]:
        return {}
    values = {key: [m[key] for m in mems if m.get(key) is not None] for key in mems[0] if key != "per_rank"}
    out = {key: max(v) if v else None for key, v in values.items()}
    worst = max(mems, key=lambda m: m.get("peak_reserved_gib") or 0.0)
    return dict(out, **({"per_rank": worst["per_rank"]} if "per_rank" in worst else {}))


def _merge_traces(traces: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean over rounds of every number (``gpu_busy_ms_per_round`` keeps each); a phase, stream or
    host-sync site a round did not see counts 0 there; a round without a trace makes it that round's."""
    if (bad := next((t for t in traces if t.get("status") != "ok"), None)) is not None:
        return bad
    filled = [dict(t) for t in traces]
    for key in ("phases_ms", "library_ms", "streams_busy_ms"):
        names = list(dict.fromkeys(n for t in traces for n in t.get(key) or {}))
        for t in filled:
            t[key] = {n: (t.get(key) or {}).get(n, 0.0) for n in names}
    if all(t.get("host_syncs") for t in traces):
        sites = list(dict.fromkeys(n for t in traces for n in t["host_syncs"]["by_site"]))
        for t in filled:
            seen = t["host_syncs"]["by_site"]
            t["host_syncs"] = dict(t["host_syncs"], by_site={
                n: seen.get(n, {"per_step": 0.0, "blocked_ms": 0.0}) for n in sites})
    return dict(mean_leaves(filled), rounds=len(traces), gpu_busy_ms_per_round=[t.get("gpu_busy_ms") for t in traces])


def sign_test_p(wins: int, n: int) -> float | None:
    """Two-sided sign test: P(a split at least this uneven | each round a coin flip)."""
    if n < 2:
        return None
    k = min(wins, n - wins)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def paired(a: Row, b: Row) -> dict[str, Any] | None:
    """A's P50 over B's, pooled and per round (both need the same rounds, all ok)."""
    if a.status != "ok" or b.status != "ok" or not a.round_p50_ms or len(a.round_p50_ms) != len(b.round_p50_ms):
        return None
    ratios = [x / y for x, y in zip(a.round_p50_ms, b.round_p50_ms)]
    wins = sum(r < 1.0 for r in ratios)
    return {"pooled_ratio": a.step_ms["p50"] / b.step_ms["p50"], "round_ratios": ratios,
            "median_ratio": statistics.median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios),
            "rounds": len(ratios), "a_faster_rounds": wins, "sign_test_p": sign_test_p(wins, len(ratios))}


def comparisons(rows: list[Row]) -> list[dict[str, Any]]:
    """Every recpipe row against each TorchRec row of its pipeline and against recpipe's base; a row whose check
    found it training differently from the same run in lockstep is compared with nothing."""
    ok = {(r.pipeline, r.impl): r for r in rows if r.status == "ok" and not r.check.startswith("differs")}
    out = []
    for name, row in ((name, r) for (name, impl), r in ok.items() if impl == "recpipe"):
        against = [other for (n, i), other in ok.items() if n == name and i != "recpipe"]
        against += [ok[("base", "recpipe")]] if name != "base" and ("base", "recpipe") in ok else []
        pairs = [(b, paired(row, b)) for b in against]
        out += [{"a": f"{name} (recpipe)", "b": f"{b.pipeline} ({b.impl})", **p} for b, p in pairs if p]
    return out


def comparisons_md(pairs: list[dict[str, Any]]) -> list[str]:
    body = [[p["a"], p["b"], f"{p['pooled_ratio']:.3f}", f"{p['median_ratio']:.3f}",
             f"[{p['min_ratio']:.3f}, {p['max_ratio']:.3f}]", f"{p['a_faster_rounds']}/{p['rounds']}",
             "-" if p["sign_test_p"] is None else f"{p['sign_test_p']:.2g}"] for p in pairs]
    return md_section(
        "Paired comparisons", "A's P50 over B's (below 1: A is faster), pooled over all steps and within each round "
        "(the same drift on both sides); the sign test asks how likely a split at least this uneven is if each round "
        "were a coin flip.",
        ("A", "B", "A / B P50 (pooled steps)", "median per round", "range", "A faster in rounds", "sign test p"), body)
