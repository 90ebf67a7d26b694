"""Weak-scaling columns: this run's samples/s per GPU beside an earlier ``bench.json``.

Weak scaling keeps the per-GPU batch fixed and adds GPUs, so a perfect system keeps
samples/s per GPU constant: efficiency = this run's per-GPU throughput / the
baseline's (1.0 = perfect). Compared per (pipeline, implementation) present and
measured in both records. Where ``recpipe.planner.scaling.predict_scaling`` exists,
its prediction for this world size is recorded next to the measurement.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from recpipe.config import ConfigError, RecpipeConfig

__all__ = ["load_baseline", "planner_scaling", "weak_scaling"]


def load_baseline(path: str) -> dict[str, Any]:
    """An earlier ``bench.json``; ConfigError (exit 2) when it is not one."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--baseline {path!r}: no such file (give the bench.json of an earlier run)")
    try:
        record = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"--baseline {path!r} is not JSON: {err}") from None
    if not isinstance(record, dict) or not isinstance(record.get("rows"), list) or "world_size" not in record:
        raise ConfigError(f"--baseline {path!r} is not a recpipe bench.json (needs 'rows' and 'world_size')")
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
    """The ``weak_scaling`` section: per measured row its samples/s per GPU, the
    prediction beside it, and (with a baseline) the baseline's and the efficiency.
    The same numbers go on each row's ``weak_scaling``."""
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
        row.weak_scaling = entry
        out["rows"].append({"pipeline": row.pipeline, "impl": row.impl, **entry})
    if baseline is not None and not any("efficiency" in r for r in out["rows"]):
        out["reason"] = "no (pipeline, impl) measured in both runs"
    return out
