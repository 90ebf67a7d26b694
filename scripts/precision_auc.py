"""Does fp16 + bf16 training keep the model's quality? Eval AUC of fp16 tables with bf16
communication against fp32 tables with fp32 communication, same config and seed
(the target: within 0.002 after 2000 steps).

    .venv/bin/python scripts/precision_auc.py --config configs/quickstart.yaml --out runs/precision_auc \\
        --report benchmarks/results/cpu/precision_auc.md
    # on a GPU machine (one process per GPU; stochastic rounding of fp16 updates is on there):
    python3 scripts/precision_auc.py --config configs/quickstart.yaml --out runs/precision_auc_gpu \\
        --set train.device=cuda --set distributed.backend=nccl --report runs/precision_auc_gpu/report.md

Runs ``recpipe train`` twice (subprocesses, the config's ``distributed.nproc`` ranks
each) with the same config, seed and data, differing only in:

* ``fp32``: every table ``weights_precision: fp32``, ``sharding.comm_precision`` fp32 both ways;
* ``fp16_bf16``: every table ``weights_precision: fp16`` (``sharding.default`` and every
  ``sharding.tables`` entry, so that no entry keeps a precision of its own), comms bf16 both ways.

Each run trains ``--steps`` steps and evaluates on ``--eval-batches`` batches per rank
(synthetic data: the same fixed eval set for both runs of a seed). ``--seeds 0,1,2``
runs one such pair per seed (the target is per pair; more seeds show how far the
difference moves with the initialisation and the data). Writes OUT/precision_auc.json and
the markdown report (``--report``, default OUT/precision_auc.md): command, versions,
the resolved config, both AUCs at every evaluation, the final difference against
``--tolerance``, and the Hanley-McNeil standard error of one AUC on this eval set
(the two runs score the same samples, so the standard error of their difference is
smaller than the unpaired sqrt(2) x SE). Exit code 0 when the difference is within
the tolerance, 1 when it is not (the report is written either way).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recpipe.config import RecpipeConfig, load_config  # noqa: E402

EVAL_LINE = re.compile(r"^step (\d+): eval auc ([0-9.]+)\s+ne ([0-9.]+)\s+logloss ([0-9.]+)", re.MULTILINE)


def variant_overrides(cfg: RecpipeConfig, weights: str, comms: str) -> list[str]:
    """--set overrides giving every table ``weights`` and both comm directions ``comms``."""
    out = [f"sharding.default.weights_precision={weights}"]
    out += [f"sharding.tables.{name}.weights_precision={weights}" for name in cfg.sharding.tables]
    return out + [f"sharding.comm_precision.forward={comms}", f"sharding.comm_precision.backward={comms}"]


VARIANTS = {"fp32": ("fp32", "fp32"), "fp16_bf16": ("fp16", "bf16")}


def common_overrides(args: argparse.Namespace, run_dir: Path) -> list[str]:
    return [
        *args.overrides,
        f"train.steps={args.steps}",
        f"data.synthetic.num_eval_batches={args.eval_batches}",
        f"train.eval_every={args.eval_every}",
        "train.progress=false",
        "checkpoint.dir=null",  # never resume a run of another variant
        f"logging.run_dir={_relative(str(run_dir))}",
    ]


def run_variant(args: argparse.Namespace, name: str, out: Path) -> dict:
    run_dir = out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    base = load_config(args.config, args.overrides)
    overrides = common_overrides(args, run_dir) + variant_overrides(base, *VARIANTS[name])
    cfg = load_config(args.config, overrides)  # checked here, before the run starts
    cmd = [_relative(sys.executable), "-m", "recpipe", "train", "--config", args.config]
    for s in overrides:
        cmd += ["--set", s]
    print(f"[{name}] {shlex.join(cmd)}", flush=True)
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    (run_dir / "train.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"[{name}] recpipe train exited {proc.returncode}; log: {run_dir / 'train.log'}\n"
                         + proc.stderr[-3000:])
    summary = json.loads((run_dir / "summary.json").read_text())
    evals = [{"step": int(s), "auc": float(a), "ne": float(n), "logloss": float(b)} for s, a, n, b in EVAL_LINE.findall(proc.stdout)]
    warnings = sorted({line.split("UserWarning: ", 1)[1] for line in proc.stderr.splitlines() if "UserWarning: " in line})
    print(f"[{name}] eval AUC {summary['eval_auc']:.5f} after {summary['steps']} steps ({wall:.0f} s)", flush=True)
    return {"name": name, "command": shlex.join(cmd), "overrides": overrides, "wall_s": round(wall, 1),
            "summary": summary, "evals": evals, "warnings": warnings, "config": cfg.model_dump(mode="json")}


def eval_label_counts(cfg: RecpipeConfig) -> tuple[int, int]:
    """(positives, negatives) of the eval split over all ranks (weight-0 padding excluded)."""
    from recpipe.data import make_dataloader

    pos = neg = 0
    world = cfg.distributed.nproc
    for rank in range(world):
        for batch in make_dataloader(cfg, rank=rank, world_size=world, split="eval"):
            kept = batch.weights > 0
            p = int(batch.labels[kept].sum())
            pos, neg = pos + p, neg + int(kept.sum()) - p
    return pos, neg


def hanley_mcneil_se(auc: float, pos: int, neg: int) -> float:
    """Standard error of an AUC from ``pos`` positive and ``neg`` negative samples
    (Hanley & McNeil 1982)."""
    q1, q2 = auc / (2 - auc), 2 * auc * auc / (1 + auc)
    var = (auc * (1 - auc) + (pos - 1) * (q1 - auc * auc) + (neg - 1) * (q2 - auc * auc)) / (pos * neg)
    return math.sqrt(var)


def versions(device: str) -> dict:
    import fbgemm_gpu
    import torch
    import torchrec

    out = {"python": platform.python_version(), "torch": torch.__version__, "torchrec": torchrec.__version__,
           "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "?"), "cuda": torch.version.cuda,
           "machine": platform.machine(), "cpu": _cpu_name(), "cpus": __import__("os").cpu_count()}
    if device == "cuda" and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True)
    out["recpipe_commit"] = commit.stdout.strip() + (" (+ uncommitted changes)" if dirty.stdout.strip() else "")
    return out


def _relative(path: str) -> str:
    """``path`` relative to the repository when inside it (a command that runs from any checkout)."""
    p = Path(path).absolute()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else path


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def render(record: dict) -> str:
    v, stats = record["versions"], record["eval_set"]
    lines = [
        f"# Eval AUC: fp16 tables + bf16 comms vs fp32 ({record['device']})",
        "",
        f"- command: `{record['command']}`",
        f"- versions: Python {v['python']}, torch {v['torch']}, torchrec {v['torchrec']}, fbgemm-gpu {v['fbgemm_gpu']}, "
        f"CUDA {v['cuda']}; {v.get('gpu') or v['cpu']} ({v['cpus']} CPUs); recpipe {v['recpipe_commit']}",
        f"- config: `{record['config']}` with the overrides of each run (below); {record['world_size']} ranks, "
        f"{record['batch_size']} samples per rank and step, {record['steps']} steps; seeds {record['seeds']} "
        "(both runs of a pair share the seed: same initial weights, same batches)",
        f"- eval set: {stats['samples']:,} samples ({stats['batches_per_rank']} batches per rank x {record['world_size']} ranks "
        f"x {record['batch_size']}; seed {record['seeds'][0]}), {stats['positives']:,} positive; standard error of one "
        f"AUC on it (Hanley-McNeil): {stats['auc_se']:.5f}. Both runs of a pair score the same samples, so the "
        "standard error of their difference is below the unpaired sqrt(2) x that",
        "",
        "| seed | run | tables | comms | final eval AUC | eval NE | eval log loss | train samples/s | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for pair in record["pairs"]:
        for r in pair["runs"]:
            s, (w, c) = r["summary"], VARIANTS[r["name"]]
            lines.append(f"| {pair['seed']} | {r['name']} | {w} | {c} | {s['eval_auc']:.5f} | {s['eval_ne']:.5f} | "
                         f"{s['eval_logloss']:.5f} | {s['samples_per_s']:,.0f} | {r['wall_s']:.0f} |")
    lines.append("")
    for pair in record["pairs"]:
        verdict = "within" if pair["passed"] else "**outside**"
        lines.append(f"- seed {pair['seed']}: **difference (fp16_bf16 - fp32) {pair['difference']:+.5f}**, {verdict} the "
                     f"target of +-{record['tolerance']} ({abs(pair['difference']) / stats['auc_se']:.2f} standard "
                     "errors of one AUC)")
    lines += ["", "Eval AUC at every evaluation (4 decimals, as the trainer logs them):", "",
              "| seed | step | fp32 | fp16_bf16 | difference |", "|---|---|---|---|---|"]
    for pair in record["pairs"]:
        a, b = pair["runs"]
        by_step = {e["step"]: e["auc"] for e in b["evals"]}
        lines += [f"| {pair['seed']} | {e['step']} | {e['auc']:.4f} | {by_step[e['step']]:.4f} | "
                  f"{by_step[e['step']] - e['auc']:+.4f} |" for e in a["evals"] if e["step"] in by_step]
    warned = sorted({w for pair in record["pairs"] for r in pair["runs"] for w in r["warnings"]})
    lines += ["", "Warnings of the runs:", ""] + ([f"- {w}" for w in warned] or ["- none"])
    if record["device"] == "cpu":
        lines += ["", "On CPU, FBGEMM's fp16 kernels round embedding updates to nearest (stochastic rounding, "
                  "on by default for fp16 tables, runs on CUDA only) and torchrec sends bf16 comms as fp16 over "
                  "Gloo: this run checks fp16 tables with round-to-nearest updates and fp16 comms. The GPU run "
                  "(`--set train.device=cuda`) checks the configuration as users get it."]
    lines += ["", "Commands of the runs:", ""]
    lines += [f"    {r['command']}" for pair in record["pairs"] for r in pair["runs"]]
    lines += ["", "Resolved config of the fp16_bf16 run of the first seed (the fp32 run differs only in the precisions):",
              "", "```yaml", record["resolved_config_yaml"].rstrip(), "```", ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--out", default="runs/precision_auc", help="run directories and precision_auc.json")
    p.add_argument("--report", default=None, help="markdown report (default OUT/precision_auc.md)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--eval-batches", type=int, default=512, help="eval batches per rank (data.synthetic.num_eval_batches)")
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--tolerance", type=float, default=0.002)
    p.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")], default=[0],
                   help="comma-separated train.seed values, one fp32/fp16_bf16 pair each (default 0)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for both runs (repeatable), e.g. train.device=cuda")
    return p.parse_args(argv)


def run_pair(args: argparse.Namespace, seed: int, out: Path) -> dict:
    pair_args = argparse.Namespace(**{**vars(args), "overrides": [*args.overrides, f"train.seed={seed}"]})
    runs = [run_variant(pair_args, name, out / f"seed{seed}") for name in VARIANTS]
    diff = runs[1]["summary"]["eval_auc"] - runs[0]["summary"]["eval_auc"]
    return {"seed": seed, "runs": runs, "difference": diff, "passed": abs(diff) <= args.tolerance}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    pairs = [run_pair(args, seed, out) for seed in args.seeds]
    first = argparse.Namespace(**{**vars(args), "overrides": [*args.overrides, f"train.seed={args.seeds[0]}"]})
    cfg = load_config(args.config, common_overrides(first, out / f"seed{args.seeds[0]}" / "fp16_bf16") + variant_overrides(
        load_config(args.config, first.overrides), *VARIANTS["fp16_bf16"]))
    pos, neg = eval_label_counts(cfg)
    device = pairs[0]["runs"][0]["summary"]["device"]
    record = {
        "command": shlex.join([_relative(sys.executable), *sys.argv]),
        "config": args.config, "device": device, "versions": versions(device),
        "world_size": cfg.distributed.nproc, "batch_size": cfg.data.batch_size, "steps": args.steps,
        "seeds": args.seeds, "tolerance": args.tolerance,
        "eval_set": {"batches_per_rank": args.eval_batches, "samples": pos + neg, "positives": pos,
                     "auc_se": hanley_mcneil_se(pairs[0]["runs"][0]["summary"]["eval_auc"], pos, neg)},
        "pairs": pairs, "passed": all(p["passed"] for p in pairs),
        "resolved_config_yaml": cfg.to_yaml(),
    }
    (out / "precision_auc.json").write_text(json.dumps(record, indent=2) + "\n")
    report = Path(args.report) if args.report else out / "precision_auc.md"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(render(record))
    for p in pairs:
        a, b = (r["summary"]["eval_auc"] for r in p["runs"])
        print(f"seed {p['seed']}: fp32 {a:.5f}, fp16_bf16 {b:.5f}, difference {p['difference']:+.5f} "
              f"({'within' if p['passed'] else 'OUTSIDE'} +-{args.tolerance})", flush=True)
    print(f"report: {report}", flush=True)
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
