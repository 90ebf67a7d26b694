"""Probe: the prefetch pipeline over several passes on one model,
as the cache sweep study runs them (sweep.measure_model): per pass the P50 and slowest of 30 timed
steps, FBGEMM's cache counters, the cache-line lock sums (before, mid-pass, after the drain) and
FBGEMM's prefetch lists. Variants `FILL:MODE`: cache_fill triton or fbgemm; between passes the
cache emptied (`reset`: FBGEMM's flush + reset_cache_states) or not (`noreset`). It found the
missing fence at the start of a pass (Streams.start_pass); benchmarks/README.md has its numbers.
On the GPU machine, stack activated, from the checkout root:
    torchrun --standalone --nproc-per-node 1 benchmarks/studies/probes/segment_probe.py OUT.json \
        [LOAD_FACTOR=0.2] [ZIPF=0.6] [VARIANTS=triton:reset,fbgemm:reset,triton:noreset] [PASSES=4]"""

import sys as _sys
from pathlib import Path as _Path

if __name__ == "__main__" and {"-h", "--help"} & set(_sys.argv[1:]):
    print(__doc__)
    raise SystemExit(0)
_sys.path.insert(0, str(_Path(__file__).resolve().parents[3]))  # the repository's recpipe and benchmarks

import json
import sys
import time

import torch
from tqdm import tqdm

from benchmarks.studies.sweep import empty_cache
from recpipe.bench.measure import COUNTERS, read_counters
from recpipe.bench.run import RunResult, build_run, fresh_batches, untimed_steps
from recpipe.bench.runner import pregenerate
from recpipe.config import load_config
from recpipe.distributed import init_process_group
from recpipe.pipelines.prefetch import cached_tbes

out_path = sys.argv[1]
LF, ALPHA = float(sys.argv[2]) if len(sys.argv) > 2 else 0.2, float(sys.argv[3]) if len(sys.argv) > 3 else 0.6
variants = (sys.argv[4] if len(sys.argv) > 4 else "triton:reset,fbgemm:reset,triton:noreset").split(",")
SEGS = int(sys.argv[5]) if len(sys.argv) > 5 else 4
base = [f"data.batch_size=32768", "train.progress=false", f"data.synthetic.zipf_alpha={ALPHA}"] + [
    f"sharding.tables.t_cat_{i}.cache_load_factor={LF}" for i in range(4)]
cfg0 = load_config("configs/bench/uvm_caching.yaml", base)
device = init_process_group(cfg0)
batches = pregenerate(cfg0, 0, 1, 43, device)
bar = tqdm(disable=True)
results = []


def locks(model):
    return [int(t.lxu_cache_locking_counter.sum()) for t in cached_tbes(model)]


def lists(model):
    return [(len(t.lxu_cache_locations_list), len(t.timesteps_prefetched), t.timestep) for t in cached_tbes(model)]


for variant in variants:
    fill, mode = variant.split(":")
    cfg = load_config("configs/bench/uvm_caching.yaml", base + [f"pipeline.cache_fill={fill}"])
    info = RunResult()
    t0 = time.perf_counter()
    sharded, pipe = build_run(cfg, "recpipe", device, info)
    model = sharded.model
    print(variant, "built", time.perf_counter() - t0, flush=True)
    for seg in range(SEGS):
        rec = {"variant": variant, "segment": seg, "locks_before": locks(model), "lists_before": lists(model)}
        if mode == "reset" or seg == 0:
            empty_cache(model)
        it = fresh_batches(batches)
        untimed_steps(pipe, it, bar, 10)
        torch.cuda.synchronize()
        c0 = read_counters(model)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(30)]
        for a, b in ev:
            a.record()
            pipe.progress(it)
            b.record()
        torch.cuda.synchronize()
        c1 = read_counters(model)
        ms = sorted(a.elapsed_time(b) for a, b in ev)
        rec["steps_ms"] = [round(a.elapsed_time(b), 2) for a, b in ev]
        rec["p50"] = ms[15]
        rec["max"] = ms[-1]
        rec["delta"] = {k: sum(c[k] for c in c1) - sum(c[k] for c in c0) for k in COUNTERS}
        rec["occupied"] = sum(c["occupied"] for c in c1) / sum(c["slots"] for c in c1)
        rec["locks_mid"] = locks(model)
        untimed_steps(pipe, it, bar)
        torch.cuda.synchronize()
        rec["locks_after"] = locks(model)
        rec["lists_after"] = lists(model)
        print(json.dumps({k: v for k, v in rec.items() if k != "steps_ms"}), flush=True)
        results.append(rec)
    del pipe, sharded, model
    torch.cuda.empty_cache()
json.dump(results, open(out_path, "w"), indent=1)
