"""Evaluation speed: the plain loop against each pipeline's eval schedule (``train.eval_pipelined``).

    python benchmarks/studies/eval_speed.py --out runs/eval_speed
    python benchmarks/studies/eval_speed.py --config configs/bench/uvm_caching.yaml --pipelines prefetch,sparse_dist --out runs/eval_speed_uvm
    python benchmarks/studies/eval_speed.py --device cpu --out runs/eval_speed_cpu   # a tiny model on CPU: the script runs

On the config's model (default ``configs/bench/dlrm_criteo.yaml``: Criteo-sized DLRM, 8192
samples a batch), with ``--eval-batches`` eval batches of the synthetic click log made
before any timing and pinned (as ``recpipe bench`` makes its batches), each pipeline of
``--pipelines`` evaluates them both ways through :class:`recpipe.pipelines.evaluation.Evaluation`
with the trainer's metrics (``ClickMetrics`` on the model's logits): the plain loop (one batch
at a time on the compute stream) and the pipeline's eval schedule. Every (pipeline, way) first
runs one untimed pass over ``--warmup-batches`` batches (lazy initialisation, the input
sources learned on a first batch); then ``--rounds`` interleaved rounds, each timing one full
pass of every (pipeline, way), the two ways in alternating order from round to round. A
pass's samples/s: its samples over the wall time from the first fetch to the end of the
last forward (a device synchronize on CUDA), the trainer's eval samples/s. Reported per
round and as P50 over the rounds, with the ratio pipelined / plain; the metrics of every
pass of a pipeline must be equal (exit 1 otherwise), as the trainer's are with either way.

With the whole-step CUDA graph (``--set pipeline.step_graph=true --pipelines sparse_dist,base``,
CUDA only) each such pipeline first trains ``--train-steps`` batches of the train split
untimed (its step is captured), then ``--train-steps`` timed ones: its training samples/s,
against which both ways of its evaluation are reported (eval / train). The pipelined way
then replays the captured eval forward (``recpipe.speedups.step_graph.EvalGraph``; its replays and
eager batches are recorded), the plain loop runs the forward eagerly.

Pipelines share one model where their sharding is the same (the prefetch pipeline's
cache-line locking builds another). Writes OUT/eval_speed.json (the resolved config,
versions, GPU, every pass) and OUT/eval_speed.md.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository's packages first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.studies.common import command, config_parser, gpu_names, write_report  # noqa: E402

DEFAULT_CONFIG = "configs/bench/dlrm_criteo.yaml"
# --device cpu: a model that evaluates in milliseconds on one Gloo rank (the script's path, not a measurement)
TINY = ["train.device=cpu", "distributed.backend=gloo", "distributed.nproc=1", "data.batch_size=256",
        "data.num_workers=0", "data.pin_memory=false", "model.embedding_dim=16",
        "model.num_embeddings_per_feature=[" + ", ".join(["2000"] * 4 + ["500"] * 22) + "]",
        "model.dense_arch_layer_sizes=[64, 16]", "model.over_arch_layer_sizes=[64, 32, 1]"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = config_parser(__doc__, config_default=DEFAULT_CONFIG)
    p.add_argument("--pipelines", default="sparse_dist,fused_sparse_dist,base",
                   help="comma-separated pipeline names (default sparse_dist,fused_sparse_dist,base)")
    p.add_argument("--eval-batches", type=int, default=None,
                   help="eval batches per rank (default 300; 16 with --device cpu)")
    p.add_argument("--warmup-batches", type=int, default=10, help="batches of each untimed first pass (default 10)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds (default 3)")
    p.add_argument("--train-steps", type=int, default=50,
                   help="with pipeline.step_graph: untimed, then timed training steps before the evaluations "
                        "(default 50)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default): the config as it is; cpu: a tiny model on one Gloo rank (overrides "
                        "the config's model and data sizes: the script's path, not a measurement)")
    p.add_argument("--out", default="runs/eval_speed", help="directory for eval_speed.json and eval_speed.md")
    args = p.parse_args(argv)
    args.command = command("eval_speed", argv)
    if args.eval_batches is None:
        args.eval_batches = 16 if args.device == "cpu" else 300
    for name in ("eval_batches", "warmup_batches", "rounds", "train_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def eval_pass(pipe: Any, pipelined: bool, batches: list, device: torch.device) -> dict[str, Any]:
    """One evaluation of ``batches`` as the trainer runs it: seconds, samples, metrics."""
    from recpipe.bench.measure import synchronize
    from recpipe.bench.run import fresh_batches
    from recpipe.pipelines.evaluation import Evaluation
    from recpipe.train.metrics import ClickMetrics, click_outputs

    metrics = ClickMetrics(device)
    fed = list(fresh_batches(batches, device))  # pinned before the clock starts
    synchronize(device)
    started = time.perf_counter()
    samples = 0
    for result, padding in Evaluation(pipe, pipelined=pipelined).run(fed):
        logits, labels, weights = click_outputs(result[1])
        if padding:
            weights = torch.zeros_like(labels)
        else:
            samples += labels.numel()
        metrics.update(logits, labels, torch.ones_like(labels) if weights is None else weights)
    synchronize(device)  # host sync: the last forward and metrics update are done
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "samples": samples, "metrics": metrics.compute()}


def train_pass(pipe: Any, batches: list, device: torch.device) -> float:
    """Seconds to train ``batches`` through ``pipe``, from the first fetch to the end of the last step."""
    from recpipe.bench.measure import synchronize
    from recpipe.bench.run import fresh_batches

    it = fresh_batches(batches, device)
    synchronize(device)
    started = time.perf_counter()
    while True:
        try:
            pipe.progress(it)
        except StopIteration:
            break
    synchronize(device)
    return time.perf_counter() - started


def step_graph_of(pipe: Any) -> Any:
    """The pipeline's step graph (``pipeline.step_graph``), or None."""
    return next((a for a in pipe.applied if getattr(a, "evaluation", None) is not None), None)


def _groups(cfg: Any, names: list[str]) -> tuple[list[tuple[Any, list[tuple[str, Any]]]], dict[str, str]]:
    """Pipelines by the model they run on (the same sharding and cache-line locking share one),
    and the skipped ones with why."""
    from recpipe.bench.run import config_for_pipeline

    groups: list[tuple[Any, list[tuple[str, Any]]]] = []
    skipped = {}
    for name in names:
        cfg_p, _, why = config_for_pipeline(cfg, name)
        if cfg_p is None:
            skipped[name] = why
            continue
        key = (cfg_p.sharding.model_dump_json(), cfg_p.cache_line_locking)
        group = next((g for g in groups if (g[0].sharding.model_dump_json(), g[0].cache_line_locking) == key), None)
        if group is None:
            groups.append((cfg_p, [(name, cfg_p)]))
        else:
            group[1].append((name, cfg_p))
    return groups, skipped


def worker(cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    """One rank: make the batches, run every pass, rank 0 writes the record."""
    from recpipe.bench.report import environment
    from recpipe.bench.run import gather
    from recpipe.data import make_dataloader
    from recpipe.distributed import init_process_group
    from recpipe.models import make_model
    from recpipe.builder import make_pipeline
    from recpipe.pipelines.evaluation import Evaluation
    from recpipe.sharding import shard_model

    device = init_process_group(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    started = time.perf_counter()
    batches = list(itertools.islice(iter(make_dataloader(cfg, rank=rank, world_size=world, split="eval")),
                                    args.eval_batches))
    if device.type == "cuda":
        batches = [b if b.dense_features.is_pinned() else b.pin_memory() for b in batches]
    made_s = time.perf_counter() - started
    groups, skipped = _groups(cfg, [n for n in args.pipelines.split(",") if n])
    passes: list[dict[str, Any]] = []
    training: dict[str, dict[str, Any]] = {}
    train_batches: list = []
    schedules: dict[str, dict[str, str]] = {}
    builds: list[dict[str, Any]] = []
    for group_cfg, members in groups:
        torch.manual_seed(group_cfg.train.seed)
        built = time.perf_counter()
        sharded = shard_model(make_model(group_cfg), group_cfg, device)
        builds.append({"pipelines": [name for name, _ in members], "seconds": time.perf_counter() - built})
        pipes = {}
        for name, cfg_p in members:
            pipe = make_pipeline(cfg_p, sharded.model, sharded.optimizer, device)
            pipe.detach()  # attached again by each evaluation (a model has one pipeline attached at a time)
            pipes[name] = pipe
            schedules[name] = {"plain": Evaluation(pipe, False).schedule.name, "pipelined": Evaluation(pipe).schedule.name}
            if step_graph_of(pipe) is not None:
                train_batches = train_batches or list(itertools.islice(
                    iter(make_dataloader(cfg, rank=rank, world_size=world, split="train")), 2 * args.train_steps))
                training[name] = train_rate(pipe, train_batches, device, rank)

        def timed(name: str, pipelined: bool, rnd: int, warm: bool = False) -> None:
            pipe = pipes[name]
            pipe.attach()
            try:
                result = eval_pass(pipe, pipelined, batches[: args.warmup_batches] if warm else batches, device)
            finally:
                pipe.detach()
            if warm:
                return
            seconds = max(gather(result["seconds"]))
            samples = sum(gather(result["samples"]))
            passes.append({"pipeline": name, "way": "pipelined" if pipelined else "plain", "round": rnd,
                           "seconds": seconds, "samples": samples, "samples_per_s": samples / seconds,
                           "metrics": result["metrics"]})
            if rank == 0:
                print(f"eval_speed: {name} {'pipelined' if pipelined else 'plain'} round {rnd + 1}: "
                      f"{samples / seconds:,.0f} samples/s ({seconds:.2f} s)", flush=True)

        for name in pipes:
            for pipelined in (False, True):
                timed(name, pipelined, -1, warm=True)
        for name in training:  # the eval graph captured in the warm-up pass: the timed passes replay it
            training[name]["eval_graph_before_timing"] = step_graph_of(pipes[name]).evaluation.summary()
        for rnd in range(args.rounds):
            for name in pipes:
                for pipelined in ((False, True) if rnd % 2 == 0 else (True, False)):
                    timed(name, pipelined, rnd)
        for name in training:
            training[name]["eval_graph"] = step_graph_of(pipes[name]).evaluation.summary()
        del pipes, sharded
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    record = {
        "study": "eval_speed",
        "config": cfg.model_dump(mode="json"),
        **environment(device, world, gpu_names(device)),
        "command": args.command,
        "options": {k: v for k, v in vars(args).items() if k != "command"},
        "eval_batches_per_rank": len(batches), "batch_size": cfg.data.batch_size, "batches_made_s": made_s,
        "model_builds": builds, "wall_s": time.perf_counter() - started,
        "schedules": schedules, "skipped": skipped, "passes": passes, "training": training,
        "summary": summarize(passes, training),
    }
    if rank == 0:
        write(Path(args.out), record)
    return record


def train_rate(pipe: Any, batches: list, device: torch.device, rank: int) -> dict[str, Any]:
    """Train the first half of ``batches`` untimed (a step graph captures its step), then time the
    second half: samples/s over every rank and ms a step."""
    from recpipe.bench.run import gather

    half = len(batches) // 2
    pipe.attach()
    try:
        train_pass(pipe, batches[:half], device)
        seconds = max(gather(train_pass(pipe, batches[half:], device)))
    finally:
        pipe.detach()
    samples = sum(gather(sum(b.labels.numel() for b in batches[half:])))
    graph = step_graph_of(pipe)
    if rank == 0:
        print(f"eval_speed: {pipe.name} training: {samples / seconds:,.0f} samples/s "
              f"({1e3 * seconds / (len(batches) - half):.2f} ms a step); {graph}", flush=True)
    return {"samples_per_s": samples / seconds, "step_ms": 1e3 * seconds / (len(batches) - half),
            "step_graph": graph.summary()}


def summarize(passes: list[dict[str, Any]], training: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Per pipeline: each way's samples/s by round and P50, the ratio of the P50s and of each
    round, and whether every pass gave the same metrics; where it trained first (a step
    graph), each way's P50 over its training samples/s."""
    from recpipe.bench.measure import percentile

    out: dict[str, Any] = {}
    for name in dict.fromkeys(p["pipeline"] for p in passes):
        mine = [p for p in passes if p["pipeline"] == name]
        by_way = {way: sorted((p for p in mine if p["way"] == way), key=lambda p: p["round"])
                  for way in ("plain", "pipelined")}
        rates = {way: [p["samples_per_s"] for p in ps] for way, ps in by_way.items()}
        p50 = {way: percentile(r, 50) for way, r in rates.items()}
        first = mine[0]["metrics"]
        out[name] = {
            "samples_per_s": rates, "samples_per_s_p50": p50,
            "ratio_p50": p50["pipelined"] / p50["plain"],
            "ratio_by_round": [b / a for a, b in zip(rates["plain"], rates["pipelined"])],
            "metrics_equal": all(p["metrics"] == first for p in mine), "metrics": first,
        }
        if name in (training or {}):
            out[name]["eval_over_train"] = {way: r / training[name]["samples_per_s"] for way, r in p50.items()}
    return out


def write(out: Path, record: dict[str, Any]) -> None:
    summary = record["summary"]
    lines = [
        "# Evaluation speed: plain loop against the pipeline's eval schedule", "",
        f"{record['gpu']['name']}, {record['world_size']} rank(s); torch {record['versions']['torch']}, "
        f"fbgemm-gpu {record['versions']['fbgemm_gpu']}, torchrec {record['versions']['torchrec']}"
        f"{', CUDA ' + record['versions']['cuda'] if record['versions']['cuda'] else ''}.",
        f"{record['eval_batches_per_rank']} eval batches of {record['batch_size']} per rank, "
        f"{record['options']['rounds']} interleaved rounds; samples/s of a whole pass (trainer's metrics "
        f"included), P50 over the rounds. `{record['command']}`", "",
        "| pipeline | eval schedule | plain samples/s | pipelined samples/s | pipelined / plain | by round | metrics equal |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = len(lines)
    for name, s in summary.items():
        rounds = ", ".join(f"{r:.3f}" for r in s["ratio_by_round"])
        lines.append(f"| {name} | {record['schedules'][name]['pipelined']} | {s['samples_per_s_p50']['plain']:,.0f} | "
                     f"{s['samples_per_s_p50']['pipelined']:,.0f} | {s['ratio_p50']:.3f} | {rounds} | "
                     f"{'yes' if s['metrics_equal'] else 'NO'} |")
    for name, why in record["skipped"].items():
        lines.append(f"| {name} | skipped: {why} | | | | | |")
    if record.get("training"):
        lines += ["", "| pipeline | training samples/s | ms a step | plain / training | pipelined / training | "
                  "eval graph (timed passes) |", "|---|---|---|---|---|---|"]
        for name, t in record["training"].items():
            ratio = summary[name]["eval_over_train"]
            timed = {k: t["eval_graph"][k] - t["eval_graph_before_timing"][k] for k in t["eval_graph"]}
            lines.append(f"| {name} | {t['samples_per_s']:,.0f} | {t['step_ms']:.2f} | {ratio['plain']:.3f} | "
                         f"{ratio['pipelined']:.3f} | {timed['replays']} replays, {timed['eager']} eager |")
    write_report(out, "eval_speed", record, lines)
    print("\n".join(lines[rows:]))
    print(f"wrote {out / 'eval_speed.json'} and {out / 'eval_speed.md'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from recpipe.bench.runner import launch
    from recpipe.config import load_config
    from recpipe.distributed import torchrun_overrides

    overrides = [*args.overrides, *(TINY if args.device == "cpu" else []),
                 f"data.synthetic.num_eval_batches={args.eval_batches}", *torchrun_overrides()]
    cfg = load_config(args.config, overrides)
    record = launch(worker, cfg, args)
    if record is None:  # ranks in other processes: rank 0 wrote it
        record = json.loads((Path(args.out) / "eval_speed.json").read_text())
    unequal = [name for name, s in record["summary"].items() if not s["metrics_equal"]]
    if unequal:
        print(f"eval_speed: the metrics differ between passes of {unequal}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
