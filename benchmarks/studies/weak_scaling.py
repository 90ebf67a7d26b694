"""Weak scaling: a bench run's samples/s per GPU beside an earlier run's and the planner's model.

    python benchmarks/studies/weak_scaling.py runs/criteo8/bench.json --baseline runs/criteo1/bench.json --out runs/ws

reads two ``bench.json`` records (any world sizes) and writes ``weak_scaling.json`` and
``weak_scaling.md`` into ``--out`` (and prints the markdown).

Weak scaling keeps the per-GPU batch fixed and adds GPUs, so a perfect system keeps
samples/s per GPU constant: efficiency = this run's per-GPU throughput / the
baseline's (1.0 = perfect). Compared per (pipeline, implementation) present and
measured in both records. Where ``recpipe.planner.scaling.predict_scaling`` exists,
its prediction for this world size is recorded next to the measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository's packages first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from recpipe.bench.report import Row, grid  # noqa: E402
from recpipe.config import ConfigError, RecpipeConfig, config_from_dict  # noqa: E402

__all__ = ["load_record", "planner_scaling", "weak_scaling", "weak_scaling_md"]


def load_record(path: str, what: str = "--baseline") -> dict[str, Any]:
    """A ``bench.json``; ConfigError (exit 2) when it is not one."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {path!r}: no such file (give the bench.json of a run)")
    try:
        record = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{what} {path!r} is not JSON: {err}") from None
    if not isinstance(record, dict) or not isinstance(record.get("rows"), list) or "world_size" not in record:
        raise ConfigError(f"{what} {path!r} is not a recpipe bench.json (needs 'rows' and 'world_size')")
    return record


def _per_gpu(row: dict[str, Any], world: int) -> float | None:
    """Samples/s per GPU of a row dict (older records lack the column: derive it)."""
    if row.get("status") != "ok" or not row.get("samples_per_s"):
        return None
    return row.get("samples_per_s_per_gpu") or row["samples_per_s"] / world


def planner_scaling(cfg: RecpipeConfig, world_size: int, gpu_name: str) -> dict[str, Any]:
    """``predict_scaling(cfg, [world_size])``'s row, or the reason there is none.

    The module is optional (written separately); any failure in it is recorded, not
    raised, because this runs after every measurement of the bench."""
    try:
        from recpipe.planner.scaling import predict_scaling
    except ImportError as err:
        return {"reason": f"n/a: recpipe.planner.scaling not importable ({err})"}
    except AttributeError as err:
        return {"reason": f"n/a: recpipe.planner.scaling has no predict_scaling ({err})"}
    gpu = next((g for g in ("H200", "H100") if g in gpu_name), None)
    kwargs = {"gpu": gpu} if gpu else {}
    try:
        try:
            rows = predict_scaling(cfg, (world_size,), **kwargs)
        except TypeError:  # a signature without ``gpu``
            if not kwargs:
                raise
            rows = predict_scaling(cfg, (world_size,))
    except Exception as err:  # noqa: BLE001 - see the docstring
        return {"reason": f"n/a: predict_scaling raised {type(err).__name__}: {str(err)[:200]}"}
    row = next((r for r in rows if r.get("world_size") == world_size), None)
    if row is None:
        return {"reason": f"n/a: predict_scaling returned no row for world size {world_size}"}
    keep = ("world_size", "bound_ms", "bound_resource", "samples_per_s_per_gpu", "kind")
    out = {k: row[k] for k in keep if k in row}
    out["gpu_model"] = gpu or "predict_scaling's default (GPU not H100/H200)"
    return out


def weak_scaling(
    cfg: RecpipeConfig, rows: list[Any], world: int, gpu_name: str, baseline: dict[str, Any] | None,
    baseline_path: str | None,
) -> dict[str, Any]:
    """Per measured row its samples/s per GPU, the prediction beside it, and (with a
    baseline) the baseline's and the efficiency."""
    prediction = planner_scaling(cfg, world, gpu_name)
    predicted = prediction.get("samples_per_s_per_gpu")
    out: dict[str, Any] = {"world_size": world, "prediction": prediction, "rows": []}
    base_rows: dict[tuple[str, str], dict[str, Any]] = {}
    if baseline is not None:
        base_world = int(baseline["world_size"])
        base_rows = {(r.get("pipeline"), r.get("impl")): r for r in baseline["rows"]}
        out.update(baseline=baseline_path, baseline_world_size=base_world,
                   baseline_gpu=baseline.get("gpu", {}).get("name"), baseline_date=baseline.get("date"))
    for row in rows:
        if row.status != "ok":
            continue
        entry: dict[str, Any] = {"world_size": world, "samples_per_s_per_gpu": row.samples_per_s_per_gpu}
        if predicted:
            entry.update(predicted_samples_per_s_per_gpu=predicted,
                         measured_over_predicted=row.samples_per_s_per_gpu / predicted)
        base = base_rows.get((row.pipeline, row.impl))
        then = _per_gpu(base, out["baseline_world_size"]) if base is not None else None
        if then is not None:
            entry.update(baseline_world_size=out["baseline_world_size"], baseline_samples_per_s_per_gpu=then,
                         efficiency=row.samples_per_s_per_gpu / then)
        out["rows"].append({"pipeline": row.pipeline, "impl": row.impl, **entry})
    if baseline is not None and not any("efficiency" in r for r in out["rows"]):
        out["reason"] = "no (pipeline, impl) measured in both runs"
    return out


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def weak_scaling_md(ws: dict[str, Any]) -> list[str]:
    lines = ["## Weak scaling", ""]
    pred = ws.get("prediction", {})
    if "samples_per_s_per_gpu" in pred:
        lines.append(
            f"Planner model at world size {ws['world_size']} (`predict_scaling`, not a measurement; GPU model "
            f"{pred.get('gpu_model')}): bound {_f(pred.get('bound_ms'), '.3f')} ms ({pred.get('bound_resource', '?')}), "
            f"{pred['samples_per_s_per_gpu']:,.0f} samples/s per GPU.")
    else:
        lines.append(f"Planner model: {pred.get('reason', 'n/a')}")
    if "baseline" in ws:
        lines.append(f"Baseline `{ws['baseline']}`: {ws['baseline_world_size']} x {ws.get('baseline_gpu')}, "
                     f"{ws.get('baseline_date')}; efficiency = samples/s per GPU here / in the baseline (1 = perfect).")
    else:
        lines.append("No `--baseline` given: no efficiency columns.")
    lines.append("")
    if not ws["rows"]:
        return lines + ["No pipeline was measured.", ""]
    with_base = "baseline" in ws
    header = ["pipeline", "impl", "GPUs", "samples/s/GPU", "predicted samples/s/GPU", "measured/predicted"]
    header += ["baseline GPUs", "baseline samples/s/GPU", "efficiency"] if with_base else []
    body = []
    for r in ws["rows"]:
        cells = [r["pipeline"], r["impl"], str(r["world_size"]), _f(r["samples_per_s_per_gpu"], ",.0f"),
                 _f(r.get("predicted_samples_per_s_per_gpu"), ",.0f"), _f(r.get("measured_over_predicted"), ".3f")]
        if with_base:
            cells += [_f(r.get("baseline_world_size"), "d"), _f(r.get("baseline_samples_per_s_per_gpu"), ",.0f"),
                      _f(r.get("efficiency"), ".3f")]
        body.append(cells)
    lines += [grid(header, body, markdown=True), ""]
    return lines + ([ws["reason"], ""] if ws.get("reason") else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="the bench.json of the run")
    parser.add_argument("--baseline", default=None, metavar="BENCH_JSON", help="the bench.json of a run on fewer GPUs")
    parser.add_argument("--out", default=None, help="directory for weak_scaling.json and weak_scaling.md")
    args = parser.parse_args(argv)
    try:
        record = load_record(args.run, "run")
        baseline = load_record(args.baseline) if args.baseline else None
    except ConfigError as err:
        print(f"weak_scaling: {err}", file=sys.stderr)
        return 2
    cfg = config_from_dict(record["config"], f"the config of {args.run}")
    rows = [Row.from_dict(r) for r in record["rows"]]
    ws = weak_scaling(cfg, rows, int(record["world_size"]), record["gpu"]["name"], baseline, args.baseline)
    text = "\n".join(weak_scaling_md(ws))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "weak_scaling.json").write_text(json.dumps(ws, indent=2) + "\n")
        (Path(args.out) / "weak_scaling.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
