"""Probe: the critical path of recpipe's prefetch step, from CUDA
events in 30 timed steps, no profiler. It records the forward, backward and optimizer steps
(compute stream), the prefetch step (prefetch stream) and FBGEMM's backward pre-hook (compute: its
wait for the prefetch stream, the lock decrement, the location recompute). It prints their median
times from the step's start. configs/bench/uvm_caching.yaml at 32768 samples, Zipf 0.6; more
--set style overrides after OUT.json. On the GPU machine, stack activated, from the checkout root:
    torchrun --standalone --nproc-per-node 1 benchmarks/studies/probes/critical_path_probe.py OUT.json"""

import sys as _sys
from pathlib import Path as _Path

if __name__ == "__main__" and {"-h", "--help"} & set(_sys.argv[1:]):
    print(__doc__)
    raise SystemExit(0)
_sys.path.insert(0, str(_Path(__file__).resolve().parents[3]))  # the repository's recpipe and benchmarks

import json
import statistics
import sys

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen as TBE
from tqdm import tqdm

from recpipe.bench.run import build_run, fresh_batches, untimed_steps
from recpipe.bench.runner import pregenerate
from recpipe.config import load_config
from recpipe.distributed import init_process_group
from recpipe.pipelines.prefetch import PrefetchPipeline

cfg = load_config("configs/bench/uvm_caching.yaml", ["data.batch_size=32768", "train.progress=false",
                                                      "data.synthetic.zipf_alpha=0.6", *sys.argv[2:]])
device = init_process_group(cfg)
batches = pregenerate(cfg, 0, 1, 43, device)
rec = {"on": False, "marks": []}


def mark(name):
    if rec["on"]:
        e = torch.cuda.Event(enable_timing=True)
        e.record(torch.cuda.current_stream())
        rec["marks"].append((name, e))


real_hook = TBE._update_cache_counter_and_locations


def hook(self, module, grad_input):
    mark("hook_before")
    out = real_hook(self, module, grad_input)
    mark("hook_after")
    return out


TBE._update_cache_counter_and_locations = hook
real_step = PrefetchPipeline.step_function


def step_function(self, name):
    fn = real_step(self, name)
    if name not in ("prefetch", "forward", "backward", "optimizer"):
        return fn

    def wrapped(pipe, b):
        mark(name + "_start")
        fn(pipe, b)
        mark(name + "_end")
    return wrapped


PrefetchPipeline.step_function = step_function
sharded, pipe = build_run(cfg, "recpipe", device)
it = fresh_batches(batches)
untimed_steps(pipe, it, tqdm(disable=True), 10)
torch.cuda.synchronize()
rec["on"] = True
step_ev = []
for _ in range(30):
    a = torch.cuda.Event(enable_timing=True)
    a.record()
    rec["marks"].append(("step", a))
    pipe.progress(it)
end = torch.cuda.Event(enable_timing=True)
end.record()
rec["marks"].append(("step", end))
torch.cuda.synchronize()
rec["on"] = False
untimed_steps(pipe, it, tqdm(disable=True))
t0 = rec["marks"][0][1]
seq = [(n, t0.elapsed_time(e)) for n, e in rec["marks"]]
steps = [i for i, (n, _) in enumerate(seq) if n == "step"]
per = []
for a, b in zip(steps, steps[1:]):
    s0 = seq[a][1]
    per.append([(n, round(t - s0, 3)) for n, t in seq[a:b]] + [("next_step", round(seq[b][1] - s0, 3))])
summary = {}
for p in per[5:]:
    d = dict()
    for n, t in p:
        d.setdefault(n, t)
    hooks = [t for n, t in p if n == "hook_before"], [t for n, t in p if n == "hook_after"]
    summary.setdefault("hook_ms", []).append(sum(b - a for a, b in zip(*hooks)))
    for n, t in d.items():
        summary.setdefault(n, []).append(t)
print("median ms from step start:", {k: round(statistics.median(v), 3) for k, v in summary.items()})
print("one step:", per[10])
json.dump({"per_step": per}, open(sys.argv[1], "w"))
