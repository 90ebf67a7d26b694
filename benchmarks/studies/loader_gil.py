"""How much does the loader slow a host-bound training loop? A CPU microbenchmark of the GIL.

    python3 benchmarks/studies/loader_gil.py --config configs/bench/dlrm_criteo.yaml --steps 100 --rounds 3

The "training loop" is Python-heavy host work like a torchrec/FBGEMM step on a GPU
host (many small torch ops on tiny tensors, calibrated to ``--step-ms`` alone), and
takes one batch of the config's loader per step. Loader modes, interleaved over
``--rounds`` rounds (per mode, the median over rounds of each round's mean):

* ``none``: batches made before the loop and cycled (no loader at work: the ceiling);
* ``inline``: ``data.num_workers=0``, each batch made in the loop;
* ``thread k`` / ``process k``: ``data.num_workers=k``, ``data.workers_kind=thread|process``.

Per mode: the loop's own work per step (``busy``, wall time), split by the kernel's
scheduler statistics of the loop's thread (``/proc/thread-self/schedstat``) into
time on a CPU, time runnable but waiting for a core (other processes: producer
processes, or anything else on a loaded machine) and the rest, time blocked: the
GIL, held by producer threads. Then the wait for the next batch, steps/s, and the
training process's CPU per step (producer threads included, producer processes
not). On a machine with fewer free cores than producers + 1, producer processes
take cores from the loop (``core wait``) where threads would take the GIL: read
those rows with the core count and the load in mind. ``--json PATH`` writes the rows.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository's packages first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.studies.common import config_parser  # noqa: E402
from recpipe.config import load_config  # noqa: E402
from recpipe.data import make_dataloader  # noqa: E402


def busy_step(n: int, x: torch.Tensor) -> torch.Tensor:
    """``n`` rounds of three small torch ops: Python and dispatcher work, as in a host-bound step."""
    for _ in range(n):
        x = (x * 1.0001).add_(0.5).clamp_(max=1e6)
    return x


class SchedStat:
    """Seconds this thread has spent on a CPU (exact: CLOCK_THREAD_CPUTIME_ID) and
    runnable in a run queue (schedstat: complete whenever the thread runs)."""

    def __init__(self) -> None:
        self.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)  # the calling thread's

    def read(self) -> tuple[float, float]:
        queued = int(os.pread(self.fd, 128, 0).split()[1]) * 1e-9
        return time.thread_time(), queued


def calibrate(step_ms: float) -> int:
    x, n = torch.ones(16), 200
    for _ in range(3):  # warm up, then scale n to the wanted duration
        t = time.perf_counter()
        busy_step(n, x)
        n = max(1, int(n * step_ms / ((time.perf_counter() - t) * 1e3)))
    return n


def run_mode(cfg_args: tuple, mode: str, k: int, steps: int, warmup: int, n: int) -> dict:
    config, overrides = cfg_args
    sets = list(overrides) + ([f"data.num_workers={k}", f"data.workers_kind={mode}"] if mode in ("thread", "process")
                              else ["data.num_workers=0"])
    cfg = load_config(config, sets)
    loader = make_dataloader(cfg, rank=0, world_size=1, split="train")
    if mode == "none":
        it = itertools.cycle(list(itertools.islice(iter(loader), 4)))
    else:
        it = iter(loader)
    x, sched = torch.ones(16), SchedStat()
    busy, on_cpu, queued, wait = [], [], [], []
    for s in range(warmup + steps):
        if s == warmup:
            cpu0, t0 = time.process_time(), time.perf_counter()
        t = time.perf_counter()
        next(it)
        t1 = time.perf_counter()
        c1, q1 = sched.read()
        busy_step(n, x)
        c2, q2 = sched.read()
        t2 = time.perf_counter()
        if s >= warmup:
            wait.append(t1 - t)
            busy.append(t2 - t1)
            on_cpu.append(c2 - c1)
            queued.append(q2 - q1)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    os.close(sched.fd)
    if hasattr(it, "close"):
        it.close()
    ms = lambda xs: statistics.fmean(xs) * 1e3  # noqa: E731
    return {"mode": mode, "workers": k, "busy_ms": ms(busy), "on_cpu_ms": ms(on_cpu), "core_wait_ms": ms(queued),
            "gil_wait_ms": ms(busy) - ms(on_cpu) - ms(queued), "batch_wait_ms": ms(wait), "steps_per_s": steps / seconds,
            "samples_per_s": steps * cfg.data.batch_size / seconds, "cpu_ms_per_step": cpu / steps * 1e3}


def main(argv: list[str] | None = None) -> None:
    p = config_parser(__doc__, config_default="configs/bench/dlrm_criteo.yaml")
    p.add_argument("--workers", default="1,4", help="producer counts for the thread and process modes")
    p.add_argument("--step-ms", type=float, default=9.4, help="the loop's work per step alone (the H100 step: 9.4 ms)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the loop's ops are tiny: one intra-op thread, as on a busy GPU host
    n = calibrate(args.step_ms)
    modes = [("none", 0), ("inline", 0)] + [(m, int(k)) for k in args.workers.split(",") for m in ("thread", "process")]
    print(f"{os.cpu_count()} CPUs, loop: {n} x 3 small torch ops (~{args.step_ms} ms alone), "
          f"{args.steps} steps x {args.rounds} rounds per mode", flush=True)
    results: dict = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode, k in modes:
            results[(mode, k)].append(run_mode((args.config, args.overrides), mode, k, args.steps, args.warmup, n))
    rows = []
    print("| loader | busy ms/step | on CPU | core wait | GIL wait | batch wait | steps/s | samples/s | "
          "process CPU ms/step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (mode, k), runs in results.items():
        row = {key: statistics.median(r[key] for r in runs) for key in runs[0] if key not in ("mode", "workers")}
        row.update(mode=mode, workers=k)
        rows.append(row)
        name = mode if mode in ("none", "inline") else f"{mode} x{k}"
        print(f"| {name} | {row['busy_ms']:.2f} | {row['on_cpu_ms']:.2f} | {row['core_wait_ms']:.2f} | "
              f"{row['gil_wait_ms']:.2f} | {row['batch_wait_ms']:.2f} | {row['steps_per_s']:.1f} | "
              f"{row['samples_per_s']:,.0f} | {row['cpu_ms_per_step']:.2f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "cpus": os.cpu_count(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
