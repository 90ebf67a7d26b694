"""Probe: which op launches each kernel of the compute stream, and
for how long, per step. Runs recpipe's prefetch and TorchRec's on configs/bench/uvm_caching.yaml
(32768 samples, Zipf 0.6), and recpipe's sparse_dist with the four tables in HBM; profiles 3 steps
after 10 untimed ones (CPU and CUDA activity), maps every kernel to the innermost CPU op and the
autograd node around its launch, and prints the largest (owner, kernel) pairs on the busiest stream.
On the GPU machine, stack activated, from the checkout root:
    torchrun --standalone --nproc-per-node 1 benchmarks/studies/probes/kernel_owner_probe.py OUT.json"""

import sys as _sys
from pathlib import Path as _Path

if __name__ == "__main__" and {"-h", "--help"} & set(_sys.argv[1:]):
    print(__doc__)
    raise SystemExit(0)
_sys.path.insert(0, str(_Path(__file__).resolve().parents[3]))  # the repository's recpipe and benchmarks

import bisect
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

from recpipe.bench.run import build_run, config_for_pipeline, fresh_batches, untimed_steps
from recpipe.bench.runner import pregenerate
from recpipe.bench.trace import parse_chrome_trace
from recpipe.config import load_config
from recpipe.distributed import init_process_group

HBM = "+".join(f"sharding.tables.t_cat_{i}.kernel=fused+sharding.tables.t_cat_{i}.cache_load_factor=null" for i in range(4))
RUNS = [("prefetch", "recpipe"), ("prefetch", "torchrec"), (f"sparse_dist:{HBM}", "recpipe")]
STEPS = 3

base = load_config("configs/bench/uvm_caching.yaml", ["data.batch_size=32768", "train.progress=false",
                                                       "data.synthetic.zipf_alpha=0.6", *sys.argv[2:]])
device = init_process_group(base)
batches = pregenerate(base, 0, 1, 10 + STEPS + 4, device)
report = {}
for label, impl in RUNS:
    cfg, _, skip = config_for_pipeline(base, label)
    assert not skip, skip
    sharded, pipe = build_run(cfg, impl, device)
    it = fresh_batches(batches)
    untimed_steps(pipe, it, tqdm(disable=True), 10)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            pipe.progress(it)
        torch.cuda.synchronize()
    untimed_steps(pipe, it, tqdm(disable=True))
    del pipe, sharded
    torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.json"
        prof.export_chrome_trace(str(path))
        trace = parse_chrome_trace(json.loads(path.read_text()))
    ranges = defaultdict(list)
    for r in trace.ranges:
        ranges[r.tid].append(r)
    for rs in ranges.values():
        rs.sort(key=lambda r: r.start)
    starts = {tid: [r.start for r in rs] for tid, rs in ranges.items()}

    def owner(corr):
        tid, t = trace.launches.get(corr, (None, None))
        if tid is None:
            return "?", "?"
        rs = ranges[tid][: bisect.bisect_right(starts[tid], t)]
        around = [r for r in rs if r.end >= t]
        inner = around[-1].name if around else "-"
        node = next((r.name.replace("autograd::engine::evaluate_function: ", "bwd:") for r in reversed(around)
                     if r.name.startswith("autograd::engine::evaluate_function")), "")
        step = next((r.name for r in around if r.name.startswith(("recpipe.", "## "))), "")
        return f"{step} {node}".strip(), inner
    busy = defaultdict(float)
    for op in trace.device_ops:
        busy[op.tid] += op.end - op.start  # a device op's tid is its stream
    compute = max(busy, key=busy.get)
    table = defaultdict(float)
    for op in trace.device_ops:
        if op.tid != compute:
            continue
        where, inner = owner(op.correlation)
        table[(where, inner, op.name[:70])] += (op.end - op.start) / 1000 / STEPS
    rows = sorted(table.items(), key=lambda kv: -kv[1])
    name = f"{label.split(':')[0]}{'(hbm)' if ':' in label else ''}/{impl}"
    report[name] = {"compute_stream_ms": busy[compute] / 1000 / STEPS,
                    "rows": [[w, i, k, round(ms, 4)] for (w, i, k), ms in rows]}
    print(f"\n== {name}: compute stream {busy[compute] / 1000 / STEPS:.2f} ms/step busy")
    for (w, i, k), ms in rows[:45]:
        print(f"{ms:7.3f}  {w[:60]:60s} {i[:38]:38s} {k[:60]}")
json.dump(report, open(sys.argv[1], "w"), indent=1)
