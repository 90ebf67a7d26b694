"""Weak scaling: samples/s per GPU against the GPU count, recpipe's fastest beside TorchRec's.

    python -m recpipe.bench.scaling OUT/criteo_1 OUT/criteo_2 OUT/criteo_4 --out OUT/criteo_scaling

Reads the ``bench.json`` of ``recpipe bench`` runs of one config at several GPU counts (the
same per-GPU batch: ``scripts/bench_gpu.sh OUT scaling`` makes them) and writes
``scaling.md`` / ``scaling.json`` / ``scaling.png``: for each row (pipeline, implementation)
and GPU count, P50, samples/s per GPU, the per-GPU rate as a share of the same row's on the
fewest GPUs (weak-scaling efficiency: 100 % keeps the rate), x floor where the bench measured
the floor; then the fastest recpipe and the fastest TorchRec row at each count.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


__all__ = ["load_runs", "main", "markdown", "scaling_rows", "write_plot"]


def load_runs(dirs: list[Path]) -> list[dict[str, Any]]:
    """Each bench.json, sorted by world size; one config and per-GPU batch for all, or ValueError."""
    runs = []
    for d in dirs:
        path = d / "bench.json" if d.is_dir() else d
        if not path.is_file():
            raise ValueError(f"{path}: no bench.json (run recpipe bench --out {d})")
        runs.append(json.loads(path.read_text()))
    runs.sort(key=lambda r: r["world_size"])
    batches = {r["config"]["data"]["batch_size"] for r in runs}
    if len(batches) > 1:
        raise ValueError(f"the runs have different per-GPU batches {sorted(batches)}: weak scaling keeps it")
    return runs


def scaling_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (pipeline, impl, world size) that ran ok, with its efficiency against the
    same row on the fewest GPUs."""
    out, base = [], {}
    for run in runs:
        world = run["world_size"]
        for row in run["rows"]:
            if row.get("status") != "ok":
                continue
            key = (row["pipeline"], row["impl"])
            per_gpu = row["samples_per_s_per_gpu"]
            base.setdefault(key, per_gpu)
            out.append({"pipeline": row["pipeline"], "impl": row["impl"], "gpus": world, "p50_ms": row["step_ms"]["p50"],
                        "samples_per_s_per_gpu": per_gpu, "efficiency": per_gpu / base[key],
                        "x_floor": (row.get("floor") or {}).get("x_floor"),
                        "floor_ms": (row.get("floor") or {}).get("floor_ms")})
    return out


def _fastest(rows: list[dict[str, Any]], impl: str, gpus: int) -> dict[str, Any] | None:
    mine = [r for r in rows if r["impl"] == impl and r["gpus"] == gpus]
    return max(mine, key=lambda r: r["samples_per_s_per_gpu"]) if mine else None


def _cell(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def markdown(runs: list[dict[str, Any]], rows: list[dict[str, Any]], cmd: str) -> list[str]:
    first = runs[0]
    made = ", ".join(f"{r['world_size']} x {r['gpu']['name']}: `{r['command']}`" for r in runs)
    lines = ["# Weak scaling", "", f"- command: `{cmd}`", f"- runs: {made}",
             f"- per-GPU batch {first['config']['data']['batch_size']}, precision {first['config']['train']['precision']}",
             "", "| pipeline | impl | GPUs | P50 ms | samples/s per GPU | of the fewest GPUs' rate | floor ms | x floor |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['pipeline']} | {r['impl']} | {r['gpus']} | {r['p50_ms']:.2f} | {r['samples_per_s_per_gpu']:,.0f} | "
              f"{r['efficiency']:.0%} | {_cell(r['floor_ms'], '.2f')} | {_cell(r['x_floor'], '.2f')} |" for r in rows]
    lines += ["", "Fastest of each implementation:", "", "| GPUs | recpipe | samples/s per GPU | TorchRec | samples/s per GPU "
              "| recpipe / TorchRec |", "|---|---|---|---|---|---|"]
    for gpus in sorted({r["gpus"] for r in rows}):
        ours, theirs = _fastest(rows, "recpipe", gpus), _fastest(rows, "torchrec", gpus)
        ratio = ours["samples_per_s_per_gpu"] / theirs["samples_per_s_per_gpu"] if ours and theirs else None
        lines.append(f"| {gpus} | {ours['pipeline'] if ours else '-'} | "
                     f"{_cell(ours and ours['samples_per_s_per_gpu'], ',.0f')} | {theirs['pipeline'] if theirs else '-'} | "
                     f"{_cell(theirs and theirs['samples_per_s_per_gpu'], ',.0f')} | {_cell(ratio, '.2f')} |")
    return lines + ["", "Plot: `scaling.png`", ""]


def write_plot(path: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``scaling.png``: the fastest pipeline of each implementation, samples/s per GPU against the
    GPU count; ``{"written": [...], "reason": ...}`` (a plot never fails the report)."""
    try:  # matplotlib is optional and slow to import: only the plots need it
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        return {"written": [], "reason": f"matplotlib not importable: {err}"}
    try:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for impl, style in (("recpipe", "-o"), ("torchrec", "--s")):
            gpus = sorted({r["gpus"] for r in rows if r["impl"] == impl})
            best = [_fastest(rows, impl, g) for g in gpus]
            ax.plot(gpus, [b["samples_per_s_per_gpu"] / 1e6 for b in best], style, label=f"{impl} (fastest pipeline)")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("samples/s per GPU (millions)")
        ax.set_xticks(sorted({r["gpus"] for r in rows}))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        return {"written": [path.name], "reason": ""}
    except Exception as err:  # noqa: BLE001 - the numbers stay
        return {"written": [], "reason": f"plotting failed: {type(err).__name__}: {err}"}
    finally:
        plt.close("all")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="bench output directories (or bench.json files)")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        runs = load_runs(args.runs)
    except ValueError as err:
        print(f"scaling: {err}", file=sys.stderr)
        return 2
    rows = scaling_rows(runs)
    cmd = " ".join(["python -m recpipe.bench.scaling", *(sys.argv[1:] if argv is None else argv)])
    plot = write_plot(args.out / "scaling.png", rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling.json").write_text(json.dumps({"command": cmd, "rows": rows, "plots": plot}, indent=1) + "\n")
    (args.out / "scaling.md").write_text("\n".join(markdown(runs, rows, cmd)) + "\n")
    print(f"wrote {args.out / 'scaling.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
