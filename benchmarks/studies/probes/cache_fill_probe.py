"""Probe (`python3 benchmarks/studies/probes/cache_fill_probe.py` on the
GPU machine, from the checkout root, stack activated): pipeline.cache_fill=triton against FBGEMM's
populate on one real TBE (4 x 10M x 128 fp32, 5 % cache, Zipf 0.6, 32768 ids per table), in a
prefetch-pipeline loop (fwd(k) | prefetch(k+1) on a side stream, a GEMM load, bwd(k)), for several
SM counts and tiles of the move kernel; with and without the GEMM load. Writes
$OUT/fill_probe.json."""

import sys as _sys
from pathlib import Path as _Path

if __name__ == "__main__" and {"-h", "--help"} & set(_sys.argv[1:]):
    print(__doc__)
    raise SystemExit(0)
_sys.path.insert(0, str(_Path(__file__).resolve().parents[3]))  # the repository's recpipe and benchmarks

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from recpipe.speedups import cache_fill  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
torch.backends.cuda.matmul.allow_tf32 = False
ROWS, D, T, B = 10_000_000, 128, 4, 32768
R = {}


def log(*a):
    print(*a, flush=True)


def make_tbe():
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, OptimType, SplitTableBatchedEmbeddingBagsCodegen)
    return SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(ROWS, D, EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA)] * T,
            optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05, cache_load_factor=0.05,
            prefetch_pipeline=True, uvm_host_mapped=True, gather_uvm_cache_stats=True)


def batches(n, alpha=0.6, seed=1):
    g = torch.Generator(device=dev).manual_seed(seed)
    b = 1 - alpha
    scale = (ROWS + 0.5) ** b - 0.5 ** b
    out = []
    for _ in range(n):
        u = torch.rand(T * B, device=dev, generator=g, dtype=torch.float64)
        r = (torch.floor((0.5 ** b + u * scale) ** (1 / b) + 0.5).long() - 1).clamp_(0, ROWS - 1)
        out.append(((r * 2654435761) % ROWS, torch.arange(T * B + 1, device=dev, dtype=torch.long)))
    return out


A = torch.randn(32768, 1024, device=dev)
W = torch.randn(1024, 1024, device=dev)


def load(n=8):
    for _ in range(n):
        torch.mm(A, W)


def run(tbe, data, sms, steps=20, warm=30, gemm=8):
    compute = torch.cuda.current_stream()
    ps = PS
    ctx = (lambda: cache_fill.routing(sms)) if sms else (lambda: __import__("contextlib").nullcontext())
    with torch.cuda.stream(ps), ctx():
        tbe.prefetch(*data[0], forward_stream=compute)
    ev, pre, host = [], [], []
    for k in range(warm + steps):
        compute.wait_stream(ps)
        t0 = time.perf_counter()
        a = torch.cuda.Event(enable_timing=True)
        a.record(compute)
        out = tbe(*data[k % len(data)])
        pa, pb = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(ps), ctx():
            pa.record(ps)
            tbe.prefetch(*data[(k + 1) % len(data)], forward_stream=compute)
            pb.record(ps)
        load(gemm)
        out.sum().backward()
        b = torch.cuda.Event(enable_timing=True)
        b.record(compute)
        if k >= warm:
            ev.append((a, b))
            pre.append((pa, pb))
            host.append(time.perf_counter() - t0)
        if k == warm - 1:
            stats0 = tbe.get_uvm_cache_stats().clone()
    compute.wait_stream(ps)
    tbe(*data[0]).sum().backward()
    torch.cuda.synchronize()
    st = sorted(x.elapsed_time(y) for x, y in ev)
    pt = sorted(x.elapsed_time(y) for x, y in pre)
    hs = sorted(host)
    return {"step_p50_ms": round(st[len(st) // 2], 3), "prefetch_p50_ms": round(pt[len(pt) // 2], 3),
            "host_p50_ms": round(1e3 * hs[len(hs) // 2], 3),
            "stats_per_step": [round(x, 1) for x in ((tbe.get_uvm_cache_stats() - stats0) / steps).tolist()]}


def main():
    global PS
    PS = torch.cuda.Stream(priority=-1)
    data = batches(40)
    t0 = time.time()
    tbe = make_tbe()
    log("tbe built", round(time.time() - t0, 1), "s")
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); load(8); e.record(); torch.cuda.synchronize()
    R["gemm8_ms"] = s.elapsed_time(e)
    for gemm in (8, 0):
        for sms, rows, warps in ((0, 0, 0), (8, 32, 8), (4, 128, 32), (4, 64, 16), (2, 128, 32), (8, 64, 16),
                                 (6, 128, 32)):
            cache_fill.ROWS_PER_TILE, cache_fill.WARPS = rows or 32, warps or 8
            key = f"gemm{gemm}_{'fbgemm' if not sms else f'triton{sms}x{rows}w{warps}'}"
            try:
                R[key] = run(tbe, data, sms, gemm=gemm)
            except Exception as e:  # noqa: BLE001
                R[key] = {"error": repr(e)[:300]}
            log(key, json.dumps(R[key]))
    json.dump(R, open(os.path.join(OUT, "fill_probe.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
