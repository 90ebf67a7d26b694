"""Does a compiled dense step (``pipeline.compile``) train as well as the eager one?

Compiled kernels round differently from eager ones, so the two do not train bit for
bit alike; what must hold is the quality. This trains one config eagerly and compiled,
same seeds, with ``recpipe train``, and compares the final eval AUC seed by seed: the
mean difference, its standard error over the seeds, and each run's AUC.

    python benchmarks/studies/compile_quality.py --config configs/quickstart.yaml --seeds 0,1,2 \\
        --set train.steps=1500 --set train.eval_every=0 --out OUT   # benchmarks/results/cpu/compile_quality.md
    python3 benchmarks/studies/compile_quality.py --config configs/dcnv2.yaml --seeds 0,1,2 \\
        --set train.device=cuda --set train.precision=bf16 --set distributed.nproc=1 --out ...

Writes ``compile_quality.json`` and ``compile_quality.md`` in ``--out``; the last line
printed is the verdict (``|mean difference| <= max(0.001, standard error)``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository's packages first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.studies.common import ROOT, command, config_parser, write_report  # noqa: E402


def train(config: str, seed: int, compiled: bool, overrides: list[str], work: Path) -> dict:
    run = work / f"{'compiled' if compiled else 'eager'}_{seed}"
    args = [sys.executable, "-m", "recpipe", "train", "--config", config, "--set", f"train.seed={seed}",
            "--set", f"logging.run_dir={run}", "--set", "train.progress=false",
            "--set", f"pipeline.compile={'true' if compiled else 'false'}"]
    for pair in overrides:
        args += ["--set", pair]
    started = time.perf_counter()
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])  # the repository's recpipe
    done = subprocess.run(args, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    summary = json.loads((run / "summary.json").read_text())
    return {"seed": seed, "compiled": compiled, "eval_auc": summary["eval_auc"], "eval_ne": summary.get("eval_ne"),
            "seconds": round(time.perf_counter() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = config_parser(__doc__)
    parser.add_argument("--seeds", default="0,1,2", help="train.seed values, comma-separated (default 0,1,2)")
    parser.add_argument("--out", default=None, help="directory for compile_quality.{json,md} (default: print only)")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        runs = [train(args.config, seed, compiled, args.overrides, Path(tmp)) for seed in seeds
                for compiled in (False, True)]
    by_seed = {s: {r["compiled"]: r["eval_auc"] for r in runs if r["seed"] == s} for s in seeds}
    diffs = [by_seed[s][True] - by_seed[s][False] for s in seeds]
    mean = sum(diffs) / len(diffs)
    se = (math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)) / math.sqrt(len(diffs))
          if len(diffs) > 1 else float("nan"))
    same = abs(mean) <= max(0.001, se if se == se else 0.0)
    record = {"command": command("compile_quality", argv), "config": args.config, "overrides": args.overrides,
              "runs": runs, "auc_difference_mean": mean, "auc_difference_se": se, "same_quality": same}
    lines = [f"# Compiled vs eager dense step: eval AUC ({args.config})", "",
             f"Command: `{record['command']}`", "", f"Overrides: {' '.join(args.overrides) or 'none'}", "",
             "| seed | eager AUC | compiled AUC | compiled - eager |", "|---|---|---|---|"]
    lines += [f"| {s} | {by_seed[s][False]:.5f} | {by_seed[s][True]:.5f} | {d:+.5f} |" for s, d in zip(seeds, diffs)]
    lines += ["", f"Mean difference {mean:+.5f}, standard error {se:.5f} over {len(seeds)} seeds: "
                  f"{'the same quality' if same else 'NOT the same quality'} (|mean| <= max(0.001, SE))."]
    print("\n".join(lines))
    if args.out:
        write_report(Path(args.out), "compile_quality", record, lines)
    print(f"compile quality: mean AUC difference {mean:+.5f} (SE {se:.5f}): {'same' if same else 'differs'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
