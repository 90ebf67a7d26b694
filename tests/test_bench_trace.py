"""The bench's profiled-step numbers (recpipe.bench.trace) and UVM-cache metrics
(recpipe.bench.measure): interval arithmetic on synthetic intervals, kernel classes of
real kernel names, a synthetic GPU trace (two streams, a memcpy, FBGEMM cache ops), a real
CPU profile of a fake pipeline with phase ranges, combining ranks and rounds, the cache
counters' math."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import record_function

from recpipe.bench.compare import mean_leaves, merge_rounds
from recpipe.bench.report import Row, gpu_time_table, rows_md
from recpipe.bench.trace import (
    KERNEL_CLASSES,
    combine_ranks,
    intersection_length,
    kernel_class,
    merge_intervals,
    parse_chrome_trace,
    phase_name,
    profile_progress,
    summarize_trace,
    union_length,
)
from recpipe.bench.measure import COUNTERS, cache_metrics, counter_delta, populate_op


def test_union_of_intervals():
    assert union_length([]) == 0.0
    assert union_length([(0, 1)]) == 1.0
    assert union_length([(0, 2), (1, 3)]) == 3.0  # overlap counted once
    assert union_length([(5, 6), (0, 1), (0.5, 2), (1.5, 1.7)]) == 3.0  # unsorted, nested
    assert union_length([(0, 1), (1, 2)]) == 2.0  # touching
    assert union_length([(3, 3), (4, 2)]) == 0.0  # empty and reversed intervals add nothing
    assert merge_intervals([(2, 3), (0, 1), (0.5, 1.5), (1, 1.2)]) == [(0, 1.5), (2, 3)]


def test_intersection_of_unions():
    assert intersection_length([(0, 10)], [(2, 3), (5, 7)]) == 3.0
    assert intersection_length([(0, 2), (4, 6)], [(1, 5)]) == 2.0
    assert intersection_length([(0, 1)], [(1, 2)]) == 0.0
    assert intersection_length([(0, 4), (1, 3)], [(2, 8), (2, 5)]) == 2.0  # each side merged first
    assert intersection_length([], [(0, 1)]) == 0.0


# Kernel names as CUPTI reports them (demangled) on H100/H200 with torch 2.11, cuBLAS 12,
# FBGEMM 1.6, NCCL 2.2x, and inductor's Triton kernels.
REAL_KERNELS = {
    "gemm": ["void cutlass::Kernel2<cutlass_80_simt_sgemm_256x128_8x4_nn_align1>(cutlass_80_simt_sgemm_256x128_8x4_nn_"
             "align1::Params)",
             "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x8_stage3_warpsize2x2x1_ffma_aligna4_alignc4_"
             "execute_kernel_trt",
             "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_"
             "kernel__5x_cublas",
             "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT",
             "void cublasLt::splitKreduce_kernel<32, 16, int, float, float, float, float, false, true, false>("
             "cublasLt::cublasSplitKParams<float>, float const*, float const*, float*, float const*, float const*, "
             "float const*, float const*, float*, void*, long, float*, int*)",
             "triton_tem_fused_addmm_relu_0", "triton_mm"],
    "elementwise": ["triton_poi_fused__to_copy_add_mul_sigmoid_3",
                    "void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor<float, float, float, "
                    "at::native::binary_internal::MulFunctor<float> >, std::array<char*, 2ul> >(int, at::native::"
                    "AUnaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> >, "
                    "std::array<char*, 2ul>)",
                    "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::"
                    "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::"
                    "{lambda()#7}::operator()() const::{lambda(float)#1}>(at::TensorIteratorBase&, at::native::"
                    "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::"
                    "{lambda()#7}::operator()() const::{lambda(float)#1} const&)::{lambda(int)#1}>(int, ...)",
                    "void at::native::unrolled_elementwise_kernel<at::native::FillFunctor<float>, std::array<char*, "
                    "1ul>, 4, TrivialOffsetCalculator<0, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, "
                    "at::native::memory::LoadWithoutCast, at::native::memory::StoreWithoutCast>(...)"],
    "reduction": ["triton_red_fused__to_copy_sum_1", "triton_per_fused_native_layer_norm_2",
                  "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, "
                  "float, float, float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::"
                  "MeanOps<float, float, float, float>, unsigned int, float, 4, 4>)"],
    "tbe_forward": ["void split_embedding_codegen_forward_unweighted_kernel<float, float, float, long, 1, 32, false>("
                    "at::PackedTensorAccessor64<float, 1, at::RestrictPtrTraits> const, ...)",
                    "void fbgemm_gpu::split_embedding_codegen_forward_unweighted_v2_kernel<float, float, float, long>("
                    "...)",
                    "void split_embedding_nobag_codegen_forward_unweighted_small_kernel<float, float, float, long, 4>("
                    "...)"],
    "tbe_backward": ["void split_embedding_backward_codegen_rowwise_adagrad_unweighted_kernel_cta_per_row_1<float, "
                     "float, float, long, 1, 32>(...)",
                     "void split_embedding_backward_codegen_rowwise_adagrad_unweighted_kernel_warp_per_row_1<float, "
                     "float, float, long, 1, 32>(...)"],
    "optimizer": ["void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
                  "namespace)::TensorListMetadata<3>, at::native::(anonymous namespace)::PointwiseOpScalarFunctor<"
                  "float, 3, 2, 2>, std::multiplies<float>, float>(...)",
                  "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::"
                  "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, "
                  "4, (at::native::ADAM_MODE)1, false>, double*, double, double, double, double, double, bool, float*, "
                  "float*>(...)"],
    "communication": ["ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
                      "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                      "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)"],
    "other": ["void (anonymous namespace)::lru_cache_insert_kernel<float, float>(...)",
              "void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 2, 128, 1>(...)",
              "_move_kernel"],
}


def test_kernel_classes_of_real_kernel_names():
    for cls, names in REAL_KERNELS.items():
        for name in names:
            assert kernel_class(name) == cls, (cls, name)
    assert kernel_class("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy") == "copies"
    assert kernel_class("Memset (Device)", "gpu_memset") == "copies"
    assert set(REAL_KERNELS) | {"copies"} == set(KERNEL_CLASSES)


def test_phase_names():
    assert phase_name("recpipe.input_dist_wait") == ("recpipe", "input_dist_wait")
    assert phase_name("## forward ##") == ("torchrec", "forward")
    assert phase_name("## wait_sparse_data_dist 12 ##") == ("torchrec", "wait_sparse_data_dist")
    assert phase_name("## sharded_module_prefetch 3 ##") == ("torchrec", "sharded_module_prefetch")
    assert phase_name("## load batch 5 from dataloader (host) ##") == ("torchrec", "load batch from dataloader (host)")
    assert phase_name("## KJTListAwaitable wait() ##") == ("library", "KJTListAwaitable wait()")
    assert phase_name("aten::mm") is None and phase_name("bench.progress") is None


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def _gpu_trace() -> dict:
    """Two steps of 100 us: compute kernels on stream 7, a cache prefetch on stream 9
    (launched inside fbgemm::lru_cache_populate), a memcpy on stream 8, an NCCL kernel."""
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}}]
    corr = iter(range(1, 100))
    for step in range(2):
        t0 = 1000.0 + 100 * step
        events.append(_x("user_annotation", "bench.progress", t0, 60))
        events.append(_x("user_annotation", "recpipe.forward", t0 + 5, 20))
        events.append(_x("user_annotation", "recpipe.prefetch", t0 + 30, 20))
        events.append(_x("user_annotation", "## KJTListAwaitable wait() ##", t0 + 52, 4))
        events.append(_x("cpu_op", "fbgemm::lru_cache_populate", t0 + 31, 10))
        for kind, launch, start, dur, stream, name in (
            ("kernel", t0 + 6, t0 + 10, 30, 7, "gemm"),  # compute 10..40
            ("kernel", t0 + 32, t0 + 30, 20, 9, "lru_cache_insert_kernel"),  # cache 30..50: 10 us overlapped
            ("gpu_memcpy", t0 + 8, t0 + 45, 10, 8, "Memcpy HtoD"),  # 45..55
            ("kernel", t0 + 9, t0 + 70, 10, 10, "ncclDevKernel_AllToAll"),  # 70..80
        ):
            c = next(corr)
            events.append(_x("cuda_runtime", "cudaLaunchKernel", launch, 1, correlation=c))
            events.append(_x(kind, name, start, dur, tid=stream, stream=stream, correlation=c))
    return {"traceEvents": events}


def test_summary_of_a_gpu_trace():
    s = summarize_trace(parse_chrome_trace(_gpu_trace()), steps=2, device_type="cuda")
    # per step: union of 10..55 (compute, cache, memcpy) and 70..80 (NCCL) = 55 us
    assert s["gpu_busy_ms"] == pytest.approx(0.055)
    assert s["nccl_busy_ms"] == pytest.approx(0.010)
    assert s["device_ops_per_step"] == 4
    assert s["streams_busy_ms"] == {"7": pytest.approx(0.03), "8": pytest.approx(0.01), "9": pytest.approx(0.02),
                                    "10": pytest.approx(0.01)}
    assert s["host_ms_per_call"] == [0.06, 0.06] and s["host_ms_p50"] == pytest.approx(0.06)
    assert s["window_ms"] == pytest.approx((1180 - 1000) / 2 / 1e3)  # first call to the last kernel's end
    assert s["phases_ms"] == {"forward": pytest.approx(0.02), "prefetch": pytest.approx(0.02)}
    assert s["phase_source"] == "recpipe" and s["outside_phases_ms"] == pytest.approx(0.02)
    assert s["library_ms"] == {"KJTListAwaitable wait()": pytest.approx(0.004)}
    cache = s["cache"]
    assert cache["gpu_ms"] == pytest.approx(0.02) and cache["overlap_ms"] == pytest.approx(0.015)  # gemm + memcpy
    assert cache["overlap_compute_ms"] == pytest.approx(0.010)  # the gemm only: not the memcpy
    assert cache["exposed_ms"] == pytest.approx(0.005) and cache["overlap_fraction"] == pytest.approx(0.75)
    assert cache["by_op_ms"] == {"fbgemm::lru_cache_populate": pytest.approx(0.02)}
    assert cache["insert_kernels_ms"] == pytest.approx(0.02) and cache["streams"] == [9]
    # by kernel class, summed per step: the gemm, the memcpy, the NCCL kernel, the cache insert (other)
    assert s["kernel_classes_ms"] == {**dict.fromkeys(KERNEL_CLASSES, 0.0), "gemm": pytest.approx(0.03),
                                      "copies": pytest.approx(0.01), "communication": pytest.approx(0.01),
                                      "other": pytest.approx(0.02)}
    row = Row("prefetch", "recpipe", trace=dict(s, status="ok"))
    table = gpu_time_table([row, Row("base", "recpipe")])
    assert table.splitlines()[0].startswith("| pipeline | impl | GPU busy ms | NCCL busy ms | window ms | busy ms by "
                                            "stream | elementwise | gemm | tbe_forward |")
    assert ("| prefetch | recpipe | 0.055 | 0.010 | 0.09 | 7: 0.03, 8: 0.01, 9: 0.02, 10: 0.01 | 0.000 (0%) | "
            "0.030 (43%) |") in table and table.endswith("| 0.030 |")
    assert gpu_time_table([Row("base", "recpipe")]) == ""  # no kernels (CPU): no table
    assert "## GPU time by kernel class" in "\n".join(rows_md([row]))


def test_recpipes_cache_insert_counts_as_cache_work():
    """pipeline.cache_fill (recpipe's insert): the populate is a record_function range (not an op), its
    row-moving kernel is ``_move_kernel``; both count as FBGEMM's do."""
    trace = _gpu_trace()
    for event in trace["traceEvents"]:
        if event.get("name") == "fbgemm::lru_cache_populate":
            event["cat"], event["name"] = "user_annotation", "recpipe::lru_cache_populate"
        if event.get("name") == "lru_cache_insert_kernel":
            event["name"] = "_move_kernel"
    cache = summarize_trace(parse_chrome_trace(trace), steps=2, device_type="cuda")["cache"]
    assert cache["by_op_ms"] == {"recpipe::lru_cache_populate": pytest.approx(0.02)}
    assert cache["insert_kernels_ms"] == pytest.approx(0.02) and cache["gpu_ms"] == pytest.approx(0.02)


def test_host_syncs_by_site():
    """Per step: an .item() in the input dist's wait (a copy to pageable memory), a
    cudaStreamSynchronize in the backward on the autograd thread, a pinned copy (not a
    sync) and a synchronize outside the calls (not counted)."""
    events = list(_gpu_trace()["traceEvents"])
    corr = iter(range(500, 600))
    for step in range(2):
        t0 = 1000.0 + 100 * step
        events.append(_x("user_annotation", "recpipe.input_dist_wait", t0 + 1, 4))
        events.append(_x("cpu_op", "aten::item", t0 + 1, 3))
        events.append(_x("cpu_op", "aten::_local_scalar_dense", t0 + 1.5, 2))
        c = next(corr)
        events.append(_x("cuda_runtime", "cudaMemcpyAsync", t0 + 2, 1.5, correlation=c))
        events.append(_x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", t0 + 3, 0.2, tid=7, stream=7, correlation=c))
        c = next(corr)  # a copy into pinned memory returns at once: not a sync
        events.append(_x("cuda_runtime", "cudaMemcpyAsync", t0 + 4, 0.1, correlation=c))
        events.append(_x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", t0 + 4.5, 0.2, tid=7, stream=7, correlation=c))
        events.append(_x("user_annotation", "recpipe.backward", t0 + 52, 6))  # the engine's thread
        events.append(_x("cpu_op", "fbgemm::split_embedding_backward_codegen_adagrad", t0 + 53, 4, tid=2))
        events.append(_x("cuda_runtime", "cudaStreamSynchronize", t0 + 54, 2, tid=2))
        events.append(_x("cuda_runtime", "cudaDeviceSynchronize", t0 + 80, 5))  # after the call
    s = summarize_trace(parse_chrome_trace(events), steps=2, device_type="cuda")
    hs = s["host_syncs"]
    assert hs["per_step"] == 2 and hs["blocked_ms"] == pytest.approx(0.0035)
    assert hs["by_site"] == {
        "backward: fbgemm::split_embedding_backward_codegen_adagrad": {"per_step": 1, "blocked_ms": pytest.approx(0.002)},
        "input_dist_wait: aten::item > aten::_local_scalar_dense": {"per_step": 1,
                                                                    "blocked_ms": pytest.approx(0.0015)},
    }
    # rounds: a site one round did not see counts 0 there
    other = dict(s, host_syncs={"per_step": 1.0, "blocked_ms": 0.001, "by_site": {"x: y": {"per_step": 1.0,
                                                                                        "blocked_ms": 0.001}}})
    merged = _merged_trace([dict(s, status="ok"), dict(other, status="ok")])["host_syncs"]
    assert merged["per_step"] == 1.5 and merged["by_site"]["x: y"] == {"per_step": 0.5, "blocked_ms": 0.0005}
    assert merged["by_site"]["input_dist_wait: aten::item > aten::_local_scalar_dense"]["per_step"] == 0.5
    text = "\n".join(rows_md([Row("sparse_dist", "recpipe", trace=dict(s, status="ok"))]))
    assert "## Host syncs" in text and "| sparse_dist | recpipe | 2.0 | 0.004 |" in text
    assert "backward: fbgemm::split_embedding_backward_codegen_adagrad (1.0, 0.002)" in text


def _merged_trace(traces: list[dict]) -> dict:
    """The trace of a row merged from rounds with these traces (``compare.merge_rounds``)."""
    rows = [Row("x", "recpipe", step_ms={"p50": 1.0}, step_ms_per_step=[1.0], round_p50_ms=[1.0], trace=t)
            for t in traces]
    return merge_rounds(rows, global_batch=1).trace


def test_a_cpu_trace_has_no_busy_time_and_a_bad_trace_is_refused():
    events = _gpu_trace()["traceEvents"]
    cpu = [e for e in events if e.get("cat") not in ("kernel", "gpu_memcpy", "cuda_runtime")]
    s = summarize_trace(parse_chrome_trace(cpu), steps=2, device_type="cpu")
    assert s["gpu_busy_ms"] is None and s["gpu_busy_reason"].startswith("n/a: CPU run") and "cache" not in s
    with pytest.raises(ValueError, match="expected 3 'bench.progress' ranges"):
        summarize_trace(parse_chrome_trace(cpu), steps=3, device_type="cpu")


class _FakePipeline:
    """progress() with recpipe.<step> ranges, as the engine opens them under a profiler."""

    def progress(self, it):
        x = next(it)
        with record_function("recpipe.forward"):
            y = x @ x
        with record_function("recpipe.backward"):
            y.sum().item()


def test_profile_progress_on_cpu_reads_phases_from_a_real_trace(tmp_path):
    it = iter([torch.randn(64, 64) for _ in range(3)])
    pipe = _FakePipeline()
    s = profile_progress(lambda: pipe.progress(it), 3, torch.device("cpu"), op_tables=(str(tmp_path / "p.txt"), "fake"))
    assert s["steps"] == 3 and len(s["host_ms_per_call"]) == 3 and s["gpu_busy_ms"] is None
    assert set(s["phases_ms"]) == {"forward", "backward"} and s["phase_source"] == "recpipe"
    assert all(v > 0 for v in s["phases_ms"].values())
    # per step, phase time (nested in the calls, disjoint here) is at most the calls' mean
    assert sum(s["phases_ms"].values()) <= sum(s["host_ms_per_call"]) / 3 * 1.001
    assert "aten::mm" in (tmp_path / "p.txt").read_text()


def test_combine_ranks_and_rounds():
    def rank(busy, host, phase):
        return {"status": "ok", "steps": 5, "gpu_busy_ms": busy, "host_ms_p50": host, "window_ms": 10.0,
                "host_ms_per_call": [host] * 5, "phases_ms": {"forward": phase}, "nccl_busy_ms": 1.0}

    row = combine_ranks([rank(4.0, 2.0, 1.0), rank(5.0, 1.0, 3.0)])
    assert (row["gpu_busy_ms"], row["host_ms_p50"]) == (5.0, 2.0)  # the slowest rank's
    assert row["phases_ms"] == {"forward": 1.0} and "host_ms_per_call" not in row  # rank 0's details
    assert [p["gpu_busy_ms"] for p in row["per_rank"]] == [4.0, 5.0]
    failed = combine_ranks([rank(4.0, 2.0, 1.0), {"status": "failed", "reason": "boom"}])
    assert failed == {"status": "failed", "reason": "rank 1: boom"}
    second = dict(rank(6.0, 2.0, 3.0), phases_ms={"forward": 3.0, "load batch": 1.0})
    merged = _merged_trace([combine_ranks([rank(4.0, 2.0, 1.0)]), combine_ranks([second])])
    assert merged["gpu_busy_ms"] == 5.0 and merged["phases_ms"] == {"forward": 2.0, "load batch": 0.5}
    assert merged["rounds"] == 2 and merged["gpu_busy_ms_per_round"] == [4.0, 6.0]
    cpu = [dict(rank(4.0, 2.0, 1.0), gpu_busy_ms=None), rank(6.0, 2.0, 1.0)]
    assert mean_leaves(cpu)["gpu_busy_ms"] is None  # one round without: no mean


def _counters(**kw) -> dict:
    return {**dict.fromkeys(COUNTERS, 0), "occupied": 0, "filled": 0, "slots": 1000, "row_bytes": 512, **kw}


def test_cache_metrics_arithmetic():
    before = [_counters(calls=10, requested=1000, unique=400, unique_misses=100, occupied=100)]
    after = [_counters(calls=14, requested=1800, unique=800, unique_misses=260, conflict_unique_misses=20,
                       conflict_misses=30, occupied=200)]
    delta = counter_delta(before, after)
    assert delta == [_counters(calls=4, requested=800, unique=400, unique_misses=160, conflict_unique_misses=20,
                               conflict_misses=30, occupied=200, filled=100)]
    other = [_counters(unique=100, unique_misses=10, row_bytes=256), _counters(unique=100, unique_misses=30)]
    work = {"gpu_ms": 0.5, "overlap_ms": 0.4, "exposed_ms": 0.1, "overlap_fraction": 0.8, "insert_kernels_ms": 0.1,
            "by_op_ms": {"fbgemm::lru_cache_populate": 0.4, "fbgemm::linearize_cache_indices": 0.05}}
    m = cache_metrics([delta, other], steps=4, traced=[work, None])
    assert m["populate_op"] == "fbgemm::lru_cache_populate"
    assert m["hit_rate"] == pytest.approx(1 - (160 + 40) / (400 + 200))  # over TBEs and ranks
    # rank 0 fetches (160 - 20) x 512 B in 4 steps: more than rank 1 (10 x 256 + 30 x 512)
    assert m["rows_fetched_per_step"] == 35 and m["bytes_fetched_per_step"] == 35 * 512
    assert m["uvm_lookups_per_step"] == 7.5 and m["unique_per_step"] == 100 and m["requested_per_step"] == 200
    # 140 rows fetched, 100 slots newly filled: 40 evictions in 4 steps; 200 of 1000 slots hold a row
    assert m["evicted_per_step"] == 10 and m["occupancy"] == 0.2
    assert m["h2d_GB_per_s_populate"] == pytest.approx(35 * 512 / 0.4e-3 / 1e9)
    assert m["h2d_GB_per_s_insert"] == pytest.approx(35 * 512 / 0.1e-3 / 1e9)
    assert m["overlap_fraction"] == 0.8 and len(m["per_rank"]) == 2
    assert m["per_rank"][1]["bytes_fetched_per_step"] == (10 * 256 + 30 * 512) / 4 and "gpu_ms" not in m["per_rank"][1]
    assert cache_metrics([[_counters()]], steps=1, traced=[None])["hit_rate"] is None  # nothing looked up
    # recpipe's insert (the prefetch pipeline's cache_fill): its range times the bandwidth, FBGEMM's op is absent
    ours = dict(work, by_op_ms={"recpipe::lru_cache_populate": 0.2, "fbgemm::linearize_cache_indices": 0.05})
    m = cache_metrics([delta], steps=4, traced=[ours], populate="recpipe::lru_cache_populate")
    assert m["h2d_GB_per_s_populate"] == pytest.approx(35 * 512 / 0.2e-3 / 1e9)
    assert cache_metrics([delta], steps=4, traced=[ours])["h2d_GB_per_s_populate"] is None  # FBGEMM's: not run


def test_populate_op_is_the_insert_the_pipeline_runs():
    from recpipe.speedups.cache_fill import CacheFill

    class Prefetch:
        applied = [CacheFill(sms=4)]  # recpipe's insert, on 4 SMs

    class Fallback:
        applied = []  # FBGEMM's (pipeline.cache_fill=false, or no Triton)

    assert populate_op(Prefetch()) == "recpipe::lru_cache_populate"
    assert populate_op(Fallback()) == populate_op(object()) == "fbgemm::lru_cache_populate"
