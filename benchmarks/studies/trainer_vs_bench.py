"""Does ``recpipe train`` keep up with ``recpipe bench``? Samples/s of both, and the time
from the built model to the first trained step.

    python3 benchmarks/studies/trainer_vs_bench.py --config configs/bench/dlrm_criteo.yaml --pipeline sparse_dist --out runs/tvb
    python3 benchmarks/studies/trainer_vs_bench.py --config configs/bench/dlrm_criteo.yaml --pipeline sparse_dist --out runs/tvb_bin \\
        --binary-rows 4000000

1. ``recpipe bench`` (subprocess) times the pipeline on pre-generated pinned batches:
   its wall-clock samples/s over the timed steps (``samples_per_s_wall`` in bench.json).
2. The trainer runs as ``recpipe train`` does (``distributed.nproc`` local processes,
   the config's loader, metrics and logging; ``train.eval_every=0`` so no evaluation
   falls inside the window). Two hooks time it without changing what it does: the
   moment ``shard_model`` returns (the model is built), and every ``progress()``
   call; at step 1 and every ``sync_every`` steps (a multiple of ``train.log_every``,
   where the trainer synchronizes anyway) the device is synchronized and the clock
   read. Steady samples/s = samples between the first mark at or after ``--steady-from``
   and the last mark, over the wall time between them (metrics and logging included).
   The clock is synchronized only at step 1, at ``--steady-from`` and at the last step
   (``--sync-every 0``, the default) so that the measurement adds no drain of its own.
3. ``--binary-rows N``: first write N synthetic Criteo-layout TSV lines
   (scripts/synthetic_tsv.py) in one file per core, convert them with ``recpipe data
   convert`` into OUT/data, and run both on ``data.source=binary`` (shuffled).
4. ``--pairs N``: bench and trainer N times, interleaved, each pair in OUT/pair<k>; the
   median of the pairs' ratios is the result (one pair is worth little where the bench
   itself varies by 5-10 % from run to run, as on the H100 hosts measured).
5. ``--profile-steps N`` (a diagnosis): after the steady window, rank 0's host is profiled
   over N more steps (torch.profiler, Python stacks) into OUT/host_profile.txt.
6. ``--profile-eval`` (a diagnosis): rank 0's host is profiled over the trainer's final
   evaluation (torch.profiler, Python stacks) into OUT/eval_host_profile.txt, beside the
   evaluation's samples/s and its time waiting for batches (``train.eval`` of the JSON).
7. ``--replay N`` (a diagnosis): the trainer reads N batches of the config's loader
   made before training and cycles them (``data.factory`` = :func:`replay`), so the
   loader's cost is out of its loop; the difference to a normal run is the loader's.

8. Always: the trainer's host time per step in the steady window, split into the time
   inside ``progress()``, the part of it blocked in the loader's ``next()``, and the
   trainer's own work between two calls (metrics, logging, the bar): P50/P90/max and
   totals, printed and in ``train.host_parts`` of the JSON.

Prints both rates, their ratio and the first-step time (targets: ratio >= 0.95,
first step <= 10 s), and writes OUT/trainer_vs_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository's packages first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.studies.common import ROOT, config_parser  # noqa: E402
from recpipe.bench.measure import summarize_ms  # noqa: E402
from recpipe.bench.report import Row  # noqa: E402
from recpipe.config import RecpipeConfig, load_config  # noqa: E402
from recpipe.distributed import shutdown_process_group  # noqa: E402
from recpipe.launcher import launch_local  # noqa: E402


def make_binary_data(args: argparse.Namespace, out: Path) -> list[str]:
    """Synthetic TSV -> binary dataset in OUT/data; returns the --set overrides that use it."""
    from recpipe.data.binary_format import Layout
    from recpipe.data.spec import DataSpec
    from recpipe.data.convert import convert

    files = os.cpu_count() or 1
    tsv = out / "tsv"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "synthetic_tsv.py"), "--config", args.config,
                    *sum((["--set", s] for s in args.overrides), []), "--out", str(tsv),
                    "--lines", str(args.binary_rows), "--files", str(files)], check=True)
    cfg = load_config(args.config, args.overrides)
    started = time.perf_counter()
    report = convert(Layout.from_spec(DataSpec.from_config(cfg)), [str(tsv / f"day_{i}.tsv") for i in range(files)], out / "data",
                     progress=False)
    print("\n".join(report.lines()) + f" ({time.perf_counter() - started:.1f} s)", flush=True)
    return ["data.source=binary", f"data.binary.train_dir={out / 'data'}", "data.shuffle=true"]


def read_bench(args: argparse.Namespace, out: Path) -> dict:
    rows = map(Row.from_dict, json.loads((out / "bench" / "bench.json").read_text())["rows"])
    row = next(r for r in rows if r.pipeline == args.pipeline and r.impl == "recpipe")
    if row.status != "ok":
        raise SystemExit(f"the bench of {args.pipeline} did not run: {row.status} {row.reason}")
    return {"samples_per_s_wall": row.samples_per_s_wall, "samples_per_s_p50": row.samples_per_s,
            "step_ms_p50": row.step_ms["p50"], "steps": row.steps}


def run_bench(args: argparse.Namespace, overrides: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "recpipe", "bench", "--config", args.config, "--pipelines", args.pipeline,
           "--steps", str(args.bench_steps), "--warmup", str(args.bench_warmup), "--no-plots", "--out", str(out / "bench")]
    for s in overrides:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return read_bench(args, out)


def replay(cfg: RecpipeConfig, *, rank: int, world_size: int, split: str, epoch: int, start_batch: int):
    """``data.factory`` of ``--replay``: ``data.options["replay"]`` batches of the
    config's own loader (``data.source``, kept beside the factory), made before the
    first step, then cycled."""
    from recpipe.data import make_dataloader

    if split != "train":
        return None
    real = cfg.model_copy(update={"data": cfg.data.model_copy(update={"factory": None, "options": {}})})
    loader = make_dataloader(real, rank=rank, world_size=world_size, split=split, epoch=epoch)
    made = [batch for batch, _ in zip(loader, range(int(cfg.data.options["replay"])))]
    return (made[i % len(made)] for i in range(cfg.train.steps - start_batch))


def train_worker(cfg: RecpipeConfig, out: str, sync_every: int, steady_from: int, profile_steps: int = 0,
                 profile_eval: bool = False) -> None:
    """One rank of ``recpipe train`` with two clocks attached (see the module docstring);
    ``profile_steps`` > 0: rank 0's host is profiled (torch.profiler, Python stacks) over
    that many steps after the steady window (``host_profile.txt``); ``profile_eval``: over
    the final evaluation (``eval_host_profile.txt``)."""
    import torch.distributed as dist

    from recpipe.train import trainer as trainer_module

    device = trainer_module.start_rank(cfg)  # as recpipe train does
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    built: list[float] = []
    shard_model = trainer_module.shard_model

    def timed_shard_model(*a, **k):
        sharded = shard_model(*a, **k)
        sync()
        built.append(time.perf_counter())
        return sharded

    trainer_module.shard_model = timed_shard_model
    try:
        trainer = trainer_module.Trainer(cfg, device)
    finally:
        trainer_module.shard_model = shard_model
    marks: list[tuple[int, float]] = []  # (steps trained, synchronized clock)
    progress = trainer.pipeline.progress
    steps = 0

    last = cfg.train.steps - profile_steps  # the clock's window ends before the profiled steps
    profiler = None

    # Where the host's time goes in the steady window, per step: inside progress()
    # (of which blocked in the loader's next()), and outside it (the trainer's own
    # per-step and log-point work).
    parts: dict[str, list[float]] = {"progress": [], "next": [], "outside": []}
    waited = [0.0]
    ended = [None]

    class TimedIter:
        def __init__(self, it):
            self.it = it

        def __iter__(self):
            return self

        def __next__(self):
            t = time.perf_counter()
            try:
                return next(self.it)
            finally:
                waited[0] += time.perf_counter() - t

    def timed_progress(batches):
        nonlocal steps, profiler
        began, waited[0] = time.perf_counter(), 0.0
        output = progress(TimedIter(batches))  # StopIteration at a segment's end passes through
        now = time.perf_counter()
        steps += 1
        if steady_from < steps <= last and ended[0] is not None:
            parts["progress"].append(now - began)
            parts["next"].append(waited[0])
            parts["outside"].append(began - ended[0])
        if steps in (1, steady_from, last) or (sync_every and steps % sync_every == 0):
            sync()
            marks.append((steps, time.perf_counter()))
        if profile_steps and steps == last and dist.get_rank() == 0:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True)
            profiler.__enter__()
        elif profiler is not None and steps == cfg.train.steps:
            profiler.__exit__(None, None, None)
            table = profiler.key_averages(group_by_stack_n=6).table(sort_by="self_cpu_time_total", row_limit=60)
            Path(out, "host_profile.txt").write_text(f"host profile of steps {last + 1}-{steps}, rank 0 "
                                                     f"(torch.profiler, CPU, Python stacks)\n{table}\n")
        ended[0] = time.perf_counter()
        return output

    trainer.pipeline.progress = timed_progress
    if profile_eval and dist.get_rank() == 0:
        evaluate = trainer.evaluate

        def profiled_evaluate():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
                metrics = evaluate()
            table = prof.key_averages(group_by_stack_n=6).table(sort_by="self_cpu_time_total", row_limit=60)
            Path(out, "eval_host_profile.txt").write_text(
                f"host profile of the evaluation after step {trainer.position.step}, rank 0 (torch.profiler, CPU, "
                f"Python stacks; {trainer.last_eval_samples_per_s or 0:,.0f} samples/s under the profiler)\n{table}\n")
            return metrics

        trainer.evaluate = profiled_evaluate
    trainer.fit()
    if dist.get_rank() == 0:
        record = {"built": built[0], "marks": marks, "global_batch": cfg.data.batch_size * dist.get_world_size(),
                  "trainer_summary": trainer.summary(), "host_parts": parts,
                  "intra_op_threads": torch.get_num_threads(),
                  "eval": {"samples_per_s": trainer.last_eval_samples_per_s,
                           "loader_wait_s": trainer.last_eval_loader_wait_s, "profiled": profile_eval}}
        Path(out, "train_marks.json").write_text(json.dumps(record))
    shutdown_process_group()


def steady(record: dict, steady_from: int) -> dict:
    marks = record["marks"]
    start = next((m for m in marks if m[0] >= steady_from and m[0] > 1), None)
    end = marks[-1]
    if start is None or end[0] <= start[0]:
        raise SystemExit(f"too few steps for a steady window from step {steady_from}: marks at {[m[0] for m in marks]}")
    rate = (end[0] - start[0]) * record["global_batch"] / (end[1] - start[1])
    return {"samples_per_s_wall": rate, "window_steps": [start[0], end[0]],
            "first_step_s": marks[0][1] - record["built"],
            "trainer_reported_samples_per_s": record["trainer_summary"]["samples_per_s"],
            "host_parts": host_parts(record["host_parts"]), "intra_op_threads": record.get("intra_op_threads"),
            "eval": record.get("eval")}


def host_parts(parts: dict[str, list[float]]) -> dict:
    """Per-step host time (ms) in the steady window: the total and the bench's statistics of each part."""
    return {name: {"total": 1e3 * sum(values), **summarize_ms([1e3 * v for v in values])}
            for name, values in parts.items() if values}


def run_cli(args: argparse.Namespace, overrides: list[str], out: Path) -> dict:
    """``recpipe train`` as a user runs it (a new process: imports, launch and start-up included),
    for ``--steps``: its summary.json's steady samples/s (the device's time over the log intervals
    after the start-up; the figure over every step beside it), the
    final evaluation's samples/s (``--set data.synthetic.num_eval_batches=N`` sizes it), the
    start-up to the first timed step, the producers ``data.num_workers`` gave, and its lines
    about the loader."""
    run = out / "cli"
    cmd = [sys.executable, "-m", "recpipe", "train", "--config", args.config]
    for s in [*overrides, f"train.steps={args.steps}", "train.eval_every=0", "checkpoint.dir=null",
              f"logging.run_dir={run}", "train.progress=false"]:
        cmd += ["--set", s]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    (out / "cli.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"recpipe train ended with {done.returncode}: {(done.stdout + done.stderr)[-2000:]}")
    summary = json.loads((run / "summary.json").read_text())
    said = [line for line in done.stdout.splitlines() if line.startswith(("data.num_workers auto", "the loader bounded",
                                                                          "start-up:"))]
    return {"samples_per_s": summary["steady_samples_per_s"], "samples_per_s_with_startup": summary["samples_per_s"],
            "eval_samples_per_s": summary["eval_samples_per_s"], "eval_loader_wait_s": summary.get("eval_loader_wait_s"),
            "startup_s": summary["startup"]["to_first_timed_step_s"], "startup": summary["startup"],
            "num_workers": summary["num_workers"], "loader_wait_s": summary["loader_wait_s"],
            "train_time_s": summary["train_time_s"], "steps": summary["steps"], "eval_auc": summary["eval_auc"],
            "said": said}


def measure_pair(args: argparse.Namespace, overrides: list[str], out: Path) -> dict:
    """``recpipe bench``, then the trainer, into ``out``: both rates and their ratio."""
    out.mkdir(parents=True, exist_ok=True)
    bench = read_bench(args, out) if args.skip_bench else run_bench(args, overrides, out)
    train_overrides = [*overrides, f"train.steps={args.steps + args.profile_steps}", "train.eval_every=0",
                       "checkpoint.dir=null", f"logging.run_dir={out / 'train'}"]
    cfg = load_config(args.config, train_overrides)
    if args.replay:  # beside data.source, which validation would refuse: the factory reads it (see replay)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        data = cfg.data.model_copy(update={"factory": "trainer_vs_bench:replay", "options": {"replay": args.replay}})
        cfg = cfg.model_copy(update={"data": data})
    launch_local(train_worker, cfg.distributed.nproc, cfg, str(out), args.sync_every, args.steady_from,
                 args.profile_steps, args.profile_eval)
    train = steady(json.loads((out / "train_marks.json").read_text()), args.steady_from)
    pair = {"bench": bench, "train": train, "ratio": train["samples_per_s_wall"] / bench["samples_per_s_wall"]}
    if args.cli:
        cli = run_cli(args, overrides, out)
        if cli["samples_per_s"] is None:  # no log interval after the start-up: train.log_every below --steps
            raise SystemExit(f"recpipe train logged no interval after its start-up: set train.log_every below {args.steps}")
        pair.update(cli=cli, cli_ratio=cli["samples_per_s"] / bench["samples_per_s_wall"])
    return pair


def versions() -> str:
    import fbgemm_gpu
    import torchrec

    return (f"torch {torch.__version__}, CUDA {torch.version.cuda}, fbgemm-gpu {getattr(fbgemm_gpu, '__version__', '?')}, "
            f"torchrec {getattr(torchrec, '__version__', '?')}")


def render(result: dict) -> str:
    """The result as a markdown section: one row per pair."""
    lines = [f"## {Path(result['config']).name}: `{' '.join(o for o in result['overrides'] if not o.startswith('pipeline.name'))}`",
             "", f"{result['device']} ({result['cores']} cores), {result['versions']}. `{result['command']}`", "",
             "| pair | bench samples/s (P50 step ms) | trainer, steady window | ratio | `recpipe train` samples/s | ratio "
             "| its final eval samples/s | eval / train | start-up s | data.num_workers | waiting for batches s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, pair in enumerate(result["pairs"], 1):
        b, t, c = pair["bench"], pair["train"], pair.get("cli")
        cells = [str(k), f"{b['samples_per_s_wall']:,.0f} ({b['step_ms_p50']:.2f})", f"{t['samples_per_s_wall']:,.0f}",
                 f"{pair['ratio']:.3f}"]
        cells += ([f"{c['samples_per_s']:,.0f}", f"{pair['cli_ratio']:.3f}", f"{c['eval_samples_per_s']:,.0f}",
                   f"{c['eval_samples_per_s'] / c['samples_per_s']:.2f}", f"{c['startup_s']}", str(c["num_workers"]),
                   f"{c['loader_wait_s']:.2f}"] if c else ["", "", "", "", "", "", ""])
        lines.append("| " + " | ".join(cells) + " |")
    said = [line for pair in result["pairs"] if "cli" in pair for line in pair["cli"]["said"]]
    return "\n".join(lines + ([""] + [f"    {line}" for line in said] if said else [])) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = config_parser(__doc__)
    parser.add_argument("--pipeline", default="sparse_dist")
    parser.add_argument("--steps", type=int, default=800, help="trainer steps")
    parser.add_argument("--steady-from", type=int, default=200, help="first step of the trainer's steady window")
    parser.add_argument("--bench-steps", type=int, default=300)
    parser.add_argument("--bench-warmup", type=int, default=20)
    parser.add_argument("--binary-rows", type=int, default=0, help="train on a binary dataset of this many rows")
    parser.add_argument("--replay", type=int, default=0, metavar="N",
                        help="diagnosis: the trainer cycles N batches made before training (no loader in the loop)")
    parser.add_argument("--sync-every", type=int, default=0,
                        help="also synchronize and read the clock every this many steps (0: only at step 1, "
                             "--steady-from and the last step)")
    parser.add_argument("--skip-bench", action="store_true", help="reuse OUT/bench/bench.json")
    parser.add_argument("--pairs", type=int, default=1,
                        help="bench then trainer this many times, interleaved (OUT/pair<k>); the median ratio counts")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after the steady window, profile rank 0's host over this many more steps "
                             "(OUT/host_profile.txt: top functions by self CPU time, with Python stacks)")
    parser.add_argument("--profile-eval", action="store_true",
                        help="profile rank 0's host over the trainer's final evaluation (OUT/eval_host_profile.txt)")
    parser.add_argument("--cli", action="store_true",
                        help="also run `recpipe train` as a user does (start-up, evaluation and loader figures)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    overrides = [*args.overrides, f"pipeline.name={args.pipeline}"]
    if args.binary_rows:
        overrides += make_binary_data(args, out)
    pairs = [measure_pair(args, overrides, out if args.pairs == 1 else out / f"pair{k}") for k in range(args.pairs)]
    result = {"config": args.config, "overrides": overrides, "pipeline": args.pipeline, "pairs": pairs,
              "ratio": statistics.median(pair["ratio"] for pair in pairs),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
              "versions": versions(), "command": " ".join(["python3", "benchmarks/studies/trainer_vs_bench.py",
                                                              *(argv if argv is not None else sys.argv[1:])])}
    if len(pairs) == 1:  # the fields of one pair at the top, as before --pairs
        result.update(bench=pairs[0]["bench"], train=pairs[0]["train"])
    (out / "trainer_vs_bench.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "trainer_vs_bench.md").write_text(render(result))
    for k, pair in enumerate(pairs):
        bench, train = pair["bench"], pair["train"]
        tag = f"[pair {k + 1}/{len(pairs)}] " if len(pairs) > 1 else ""
        print(f"{tag}bench   {args.pipeline}: {bench['samples_per_s_wall']:,.0f} samples/s (wall, {bench['steps']} steps "
              f"on pre-generated batches; P50 step {bench['step_ms_p50']:.2f} ms)")
        print(f"{tag}trainer {args.pipeline}: {train['samples_per_s_wall']:,.0f} samples/s (wall, steps "
              f"{train['window_steps'][0]}-{train['window_steps'][1]}, loader, metrics and logging included; "
              f"the trainer's own figure, which leaves out metrics: {train['trainer_reported_samples_per_s']:,.0f}); "
              f"ratio {pair['ratio']:.3f}")
        parts = train["host_parts"]
        print(f"{tag}trainer host time per step, ms (P50 / P90 / max; total over the window): " + "; ".join(
            f"{name} {p['p50']:.2f} / {p['p90']:.2f} / {p['max']:.1f}; {p['total']:.0f}" for name, p in parts.items()))
        ev = train.get("eval") or {}
        if ev.get("samples_per_s"):
            print(f"{tag}trainer's final evaluation: {ev['samples_per_s']:,.0f} samples/s, {ev['loader_wait_s']:.3f} s of it "
                  f"waiting for batches" + (" (under the profiler: eval_host_profile.txt)" if ev.get("profiled") else ""))
        if "cli" in pair:
            cli = pair["cli"]
            print(f"{tag}recpipe train: {cli['samples_per_s']:,.0f} samples/s ({pair['cli_ratio']:.3f} x the bench); final "
                  f"evaluation {cli['eval_samples_per_s']:,.0f} samples/s "
                  f"({cli['eval_samples_per_s'] / cli['samples_per_s']:.2f} x training, {cli['eval_loader_wait_s']} s of it "
                  f"waiting for batches); start-up {cli['startup_s']} s; "
                  f"data.num_workers {cli['num_workers']}, {cli['loader_wait_s']:.2f} s waiting for batches")
            print("\n".join(f"{tag}  said: {line}" for line in cli["said"]))
    first = max(pair["train"]["first_step_s"] for pair in pairs)
    what = "ratio" if len(pairs) == 1 else f"median ratio of {len(pairs)} interleaved pairs"
    print(f"{what} {result['ratio']:.3f} (target >= 0.95); first trained step within {first:.1f} s after the model "
          f"was built (target <= 10 s); {out / 'trainer_vs_bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
