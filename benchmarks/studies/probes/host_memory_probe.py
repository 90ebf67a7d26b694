"""Probe (run on the GPU machine with the stack activated:
`python3 benchmarks/studies/probes/host_memory_probe.py`; PROBE_ROWS / PROBE_KINDS vary it): what bounds
FBGEMM's cache insert from host memory, and what slows the compute beside it. One H100. Writes
$OUT/probe.json and prints a summary. (Its part D cycles 8 batches, so the cache warms up and few
rows miss: those TBE figures do not show the high-miss point; cache_fill_probe.py does.)

Parts:
  A. host memory variants (FBGEMM host-mapped malloc, mmap 4K, mmap THP, hugetlb 2M / 1G),
     each registered mapped: GPU random-row gather GB/s, contiguous read GB/s, random
     scatter (write-back) GB/s, CPU gather GB/s by threads.
  B. DMA (pinned staging, copy engine) H2D / D2H GB/s.
  C. Interference: an fp32 GEMM loop alone and beside (a) a 17-block spin kernel,
     (b) GPU random gathers from host, (c) DMA copies, (d) FBGEMM's locked prefetch.
  D. FBGEMM TBE steps (4 x 10M x 128 fp32, 5 % cache, Zipf 0.6, 32768 ids per table):
     prefetch alone, and a pipelined step (fwd(k) | prefetch(k+1) beside a GEMM load,
     bwd(k)) for each host memory variant swapped into tbe.weights_uvm.
"""

import sys as _sys
from pathlib import Path as _Path

if __name__ == "__main__" and {"-h", "--help"} & set(_sys.argv[1:]):
    print(__doc__)
    raise SystemExit(0)
_sys.path.insert(0, str(_Path(__file__).resolve().parents[3]))  # the repository's recpipe and benchmarks

import ctypes
import json
import os
import sys
import time

import numpy as np
import torch

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
torch.backends.cuda.matmul.allow_tf32 = False
R = {}
ROW = 128
ROWS = int(os.environ.get("PROBE_ROWS", 40_000_000))
NB = ROWS * ROW * 4
MAP_PRIVATE, MAP_ANON, MAP_HUGETLB, MAP_NORESERVE = 0x02, 0x20, 0x40000, 0x4000
PROT_RW = 0x1 | 0x2
MADV_HUGEPAGE, MADV_NOHUGEPAGE, MADV_DONTFORK = 14, 15, 10
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
cudart = torch.cuda.cudart()


def log(*a):
    print(*a, flush=True)


def sh(cmd):
    return os.popen(cmd).read().strip()


def anon_huge_kb():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages"):
            return int(line.split()[1])
    return -1


class CAI:
    def __init__(self, ptr, shape):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<f4", "data": (ptr, False), "version": 3,
                                         "strides": None}


def cuda_view(ptr, rows):
    return torch.as_tensor(CAI(ptr, (rows, ROW)), device=dev)


def cpu_view(ptr, rows):
    arr = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(rows, ROW))
    return torch.from_numpy(arr)


def register(ptr, nbytes):
    t = time.time()
    err = cudart.cudaHostRegister(ptr, nbytes, 3)  # portable | mapped
    assert int(err) == 0, err
    return time.time() - t


def alloc(kind):
    """-> (ptr, nbytes_mapped, cleanup, info)"""
    info = {"kind": kind}
    if kind == "fbgemm_malloc":
        t = torch.ops.fbgemm.new_unified_tensor(torch.empty(0, device=dev), [ROWS * ROW], True)
        before = anon_huge_kb()
        info["anon_huge_gib"] = before / 2**20
        return t.data_ptr(), None, t, info
    size = NB
    flags = MAP_PRIVATE | MAP_ANON
    if kind.startswith("hugetlb"):
        pg = 2 << 20 if kind == "hugetlb_2m" else 1 << 30
        size = (NB + pg - 1) // pg * pg
        flags |= MAP_HUGETLB | ((21 if pg == 2 << 20 else 30) << 26)
        ptr = libc.mmap(None, size, PROT_RW, flags, -1, 0)
        if ptr in (None, ctypes.c_void_p(-1).value) or ptr == 2**64 - 1:
            raise OSError(ctypes.get_errno(), "mmap hugetlb failed")
        base = ptr
    else:
        size = NB + (2 << 20)
        ptr = libc.mmap(None, size, PROT_RW, flags, -1, 0)
        assert ptr and ptr != 2**64 - 1
        base = ptr
        ptr = (ptr + (2 << 20) - 1) // (2 << 20) * (2 << 20)
        libc.madvise(ptr, NB, MADV_HUGEPAGE if kind == "mmap_thp" else MADV_NOHUGEPAGE)
    libc.madvise(ptr, NB, MADV_DONTFORK)
    t0 = time.time()
    h0 = anon_huge_kb()
    v = cpu_view(ptr, ROWS)
    torch.set_num_threads(16)
    v.fill_(0.5)
    info["touch_s"] = time.time() - t0
    info["anon_huge_gib_added"] = (anon_huge_kb() - h0) / 2**20
    info["register_s"] = register(ptr, NB)

    def free():
        cudart.cudaHostUnregister(ptr)
        libc.munmap(base, size)
    return ptr, size, free, info


def timed(fn, reps=10, stream=None):
    s = stream or torch.cuda.current_stream()
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(s)
    for _ in range(reps):
        fn()
    b.record(s)
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


NMISS = 110_000
gen = torch.Generator(device="cpu").manual_seed(0)


def memory_part(kind):
    try:
        ptr, size, keep, info = alloc(kind)
    except Exception as e:  # noqa: BLE001
        log(kind, "unavailable:", repr(e))
        return {"kind": kind, "error": repr(e)}
    src = cuda_view(ptr, ROWS)
    cpu = cpu_view(ptr, ROWS)
    idx_cpu = torch.randperm(ROWS, generator=gen)[:NMISS]
    idx = idx_cpu.to(dev)
    # correctness: GPU read equals CPU read
    cpu[idx_cpu[:4]] = torch.arange(4 * ROW, dtype=torch.float32).view(4, ROW)
    assert torch.equal(src.index_select(0, idx[:4]).cpu(), cpu[idx_cpu[:4]]), "device view != host view"
    nbytes = NMISS * ROW * 4
    ms = timed(lambda: src.index_select(0, idx))
    info["gpu_gather_GBps"] = nbytes / ms / 1e6
    dst = torch.empty(NMISS, ROW, device=dev)
    ms = timed(lambda: src.index_copy_(0, idx, dst))
    info["gpu_scatter_GBps"] = nbytes / ms / 1e6
    ms = timed(lambda: src[5_000_000:5_000_000 + NMISS].clone())
    info["gpu_contig_read_GBps"] = nbytes / ms / 1e6
    pinned = torch.empty(NMISS, ROW, pin_memory=True)
    for th in (1, 4, 8, 16):
        torch.set_num_threads(th)
        t = time.perf_counter()
        for _ in range(5):
            torch.index_select(cpu, 0, idx_cpu, out=pinned)
        info[f"cpu_gather_GBps_t{th}"] = nbytes * 5 / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        for _ in range(5):
            cpu.index_copy_(0, idx_cpu, pinned)
        info[f"cpu_scatter_GBps_t{th}"] = nbytes * 5 / (time.perf_counter() - t) / 1e9
    torch.set_num_threads(16)
    log(kind, json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in info.items()}))
    return info, (ptr, size, keep, src)


def gemm_load(n=8):
    a = torch.randn(32768, 1024, device=dev)
    b = torch.randn(1024, 1024, device=dev)

    def run():
        for _ in range(n):
            torch.mm(a, b)
    return run


SPIN_SRC = r"""
extern "C" __global__ void spin(long long cycles) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) { }
}
"""


def interference(src_cuda):
    """GEMM loop time alone and beside other work on a side stream."""
    res = {}
    side = torch.cuda.Stream(priority=-1)
    load = gemm_load()
    base = timed(load, reps=5)
    res["gemm_alone_ms"] = base
    try:
        import cupy as cp
        mod = cp.RawModule(code=SPIN_SRC)
        spin = mod.get_function("spin")
        nsm = torch.cuda.get_device_properties(0).multi_processor_count
        blocks = (nsm + 7) // 8

        def with_spin():
            with torch.cuda.stream(side):
                with cp.cuda.ExternalStream(side.cuda_stream):
                    spin((blocks,), (1024,), (cp.int64(int(1.98e9 * base / 1e3 * 1.2)),))
            load()
        res["gemm_beside_spin17x1024_ms"] = timed(with_spin, reps=5)
        res["spin_blocks"] = blocks
    except Exception as e:  # noqa: BLE001
        res["spin_error"] = repr(e)
    idx = torch.randperm(src_cuda.shape[0], device=dev)[:NMISS]

    def with_gather():
        with torch.cuda.stream(side):
            for _ in range(6):
                src_cuda.index_select(0, idx)
        load()
    res["gemm_beside_host_gather_ms"] = timed(with_gather, reps=5)
    pinned = torch.empty(NMISS * 4, ROW, pin_memory=True)
    hbm = torch.empty(NMISS * 4, ROW, device=dev)

    def with_dma():
        with torch.cuda.stream(side):
            for _ in range(3):
                hbm.copy_(pinned, non_blocking=True)
                pinned.copy_(hbm, non_blocking=True)
        load()
    res["gemm_beside_dma_ms"] = timed(with_dma, reps=5)
    nbytes = pinned.numel() * 4
    res["dma_h2d_GBps"] = nbytes / timed(lambda: hbm.copy_(pinned, non_blocking=True)) / 1e6
    res["dma_d2h_GBps"] = nbytes / timed(lambda: pinned.copy_(hbm, non_blocking=True)) / 1e6
    log("interference", json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}))
    return res


def make_tbe():
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, OptimType, SplitTableBatchedEmbeddingBagsCodegen)
    T = 4
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(ROWS // T, ROW, EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA)] * T,
        optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05, cache_load_factor=0.05,
        prefetch_pipeline=True, uvm_host_mapped=True, gather_uvm_cache_stats=True)
    return tbe, T


def zipf_batches(T, rows_per, n, B=32768, alpha=0.6):
    out = []
    g = torch.Generator(device=dev).manual_seed(1)
    b = 1 - alpha
    scale = (rows_per + 0.5) ** b - 0.5 ** b
    for _ in range(n):
        u = torch.rand(T * B, device=dev, generator=g, dtype=torch.float64)
        r = (torch.floor((0.5 ** b + u * scale) ** (1 / b) + 0.5).long() - 1).clamp_(0, rows_per - 1)
        ids = (r * 2654435761) % rows_per
        out.append((ids, torch.arange(T * B + 1, device=dev, dtype=torch.long)))
    return out


PSTREAM = None


def tbe_steps(tbe, batches, load, overlap, steps=24, warm=20):
    """Pipelined steps: fwd(k) ; prefetch(k+1) on side stream (overlap) or inline ; load ; bwd(k)."""
    compute = torch.cuda.current_stream()
    pstream = PSTREAM
    n = len(batches)
    with torch.cuda.stream(pstream):
        tbe.prefetch(*batches[0], forward_stream=compute)
    times, pre = [], []
    for k in range(warm + steps):
        compute.wait_stream(pstream)
        a = torch.cuda.Event(enable_timing=True)
        a.record(compute)
        out = tbe(*batches[k % n])
        pa, pb = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if overlap:
            with torch.cuda.stream(pstream):
                pa.record(pstream)
                tbe.prefetch(*batches[(k + 1) % n], forward_stream=compute)
                pb.record(pstream)
        else:
            pstream.wait_stream(compute)
            with torch.cuda.stream(pstream):
                pa.record(pstream)
                tbe.prefetch(*batches[(k + 1) % n], forward_stream=compute)
                pb.record(pstream)
            compute.wait_stream(pstream)
        if load is not None:
            load()
        out.sum().backward()
        b = torch.cuda.Event(enable_timing=True)
        b.record(compute)
        if k >= warm:
            times.append((a, b))
            pre.append((pa, pb))
    compute.wait_stream(pstream)
    tbe(*batches[(warm + steps) % n]).sum().backward()  # consume the last prefetch
    torch.cuda.synchronize()
    st = sorted(x.elapsed_time(y) for x, y in times)
    pt = sorted(x.elapsed_time(y) for x, y in pre)
    return {"step_p50_ms": st[len(st) // 2], "prefetch_p50_ms": pt[len(pt) // 2]}


def set_uvm(tbe, t):
    try:
        tbe.weights_uvm = t
    except TypeError:
        tbe.weights_uvm = torch.nn.Parameter(t, requires_grad=False)


def main():
    R["env"] = {"thp_enabled": sh("cat /sys/kernel/mm/transparent_hugepage/enabled"),
                "thp_defrag": sh("cat /sys/kernel/mm/transparent_hugepage/defrag"),
                "meminfo": sh("grep -E 'MemTotal|MemFree|Huge' /proc/meminfo"),
                "nproc": os.cpu_count(), "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name(0),
                "iommu": sh("ls /sys/kernel/iommu_groups 2>/dev/null | wc -l"),
                "lspci": sh("cat /sys/bus/pci/devices/*/current_link_speed /sys/bus/pci/devices/*/current_link_width 2>/dev/null | sort | uniq -c")}
    log(json.dumps(R["env"], indent=1))
    sys.path.insert(0, "/tmp/site")
    import fbgemm_gpu  # noqa: F401
    # hugetlb pools
    need2m = NB // (2 << 20) + 1
    os.system(f"echo {need2m} > /proc/sys/vm/nr_hugepages")
    R["env"]["hugepages_2m_after"] = sh("grep HugePages_Total /proc/meminfo")
    global PSTREAM
    PSTREAM = torch.cuda.Stream(priority=-1)
    load = gemm_load()
    tbe, T = make_tbe()
    batches = zipf_batches(T, ROWS // T, 8)
    R["tbe"] = {}
    # compute floor: load only
    R["gemm_load_ms"] = timed(load, reps=5)
    kinds = os.environ.get("PROBE_KINDS", "fbgemm_malloc,mmap_4k,mmap_thp,hugetlb_2m").split(",")
    R["memory"] = {}
    orig = tbe.weights_uvm
    for kind in kinds:
        got = memory_part(kind)
        if isinstance(got, dict):
            R["memory"][kind] = got
            continue
        info, (ptr, size, keep, src) = got
        R["memory"][kind] = info
        if kind == kinds[0]:
            R["interference"] = interference(src)
        # TBE with this memory as its host rows
        flat = src.view(-1)[: orig.numel()]
        set_uvm(tbe, flat)
        r = {}
        r["serial"] = tbe_steps(tbe, batches, load, overlap=False)
        r["overlap"] = tbe_steps(tbe, batches, load, overlap=True)
        r["overlap_noload"] = tbe_steps(tbe, batches, None, overlap=True)
        st = tbe.get_uvm_cache_stats().tolist()
        r["stats"] = st
        R["tbe"][kind] = r
        log("tbe", kind, json.dumps(r))
        set_uvm(tbe, orig)
        del src, flat
        torch.cuda.synchronize()
        if callable(keep):
            keep()
        del keep
    json.dump(R, open(os.path.join(OUT, "probe.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
