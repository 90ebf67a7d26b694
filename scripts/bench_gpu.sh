#!/usr/bin/env bash
# The benchmark runs published under benchmarks/, on every GPU of this machine.
#
#   scripts/bench_gpu.sh OUT_DIR [SUITE ...]
#
# SUITE: criteo (8192 samples/GPU, host-bound on one H100), gpu_bound (65536/GPU),
# opt_heavy (Adam on a 52M-parameter over-arch), uvm (prefetch pipeline on UVM-cached
# tables, recpipe beside TorchRec's PrefetchTrainPipelineSparseDist), multipass (the
# multi-pass prefetch sweep on 2M-row cached tables at pooling 40), and the speed features
# beside TorchRec: criteo_step_graph (Criteo-sized, bf16: CUDA graphs, compile, one graph per
# step), mlperf (MLPerf DLRM-DCNv2's shapes, compiled, profiled by kernel class) and
# gpu_bound_compile (65536/GPU, bf16, compiled on both sides: TorchRec's TrainPipelinePT2), and
# scaling: both of those models on 1, 2, 4 (and 8) GPUs of this host, recpipe's sparse_dist (also with its host-sync levers) and
# its step graph beside TorchRec's, then python -m recpipe.bench.scaling's report and plot
# (samples/s per GPU against the GPU count) in OUT_DIR/scaling/<config>/.
# Default: all but scaling.
# Every suite runs each pipeline in ROUNDS interleaved rounds (default 3) with the stages
# timed alone (benchmarks/studies/bound.py: recpipe bench's rows plus the estimate); the
# multipass suite is benchmarks/studies/multipass.py. One process per GPU (torchrun) when
# the machine has several.
# Each suite's bench.json / bench.md / PNGs go to OUT_DIR/SUITE/, its log to OUT_DIR/SUITE.log.
set -uo pipefail
out=${1:?usage: scripts/bench_gpu.sh OUT_DIR [SUITE ...]}
shift
suites=("$@")
[ ${#suites[@]} -gt 0 ] || suites=(criteo gpu_bound opt_heavy uvm multipass criteo_step_graph mlperf gpu_bound_compile)
rounds=${ROUNDS:-3}
nproc=${NPROC:-$(nvidia-smi -L | wc -l)}
export PYTHONUNBUFFERED=1
common=(--with-torchrec --rounds "$rounds" --set train.progress=false)
four=base,sparse_dist,fused_sparse_dist,semi_sync

bench() {  # bench SUITE STUDY ARGS...: one study's bench (bound or multipass), on all GPUs
    local suite=$1 study=benchmarks/studies/$2.py
    shift 2
    mkdir -p "$out"
    echo "== $suite: $study $* (nproc $nproc)"
    if [ "$nproc" -gt 1 ]; then
        torchrun --standalone --nproc-per-node "$nproc" "$study" "$@" --out "$out/$suite" 2>&1
    else
        python3 "$study" "$@" --out "$out/$suite" 2>&1
    fi | grep -v "compat_table\|WARNING:root" | tee "$out/$suite.log"
}

speed() {  # speed SUITE ARGS...: recpipe bench rows of the speed features, on all GPUs
    local suite=$1
    shift
    mkdir -p "$out"
    echo "== $suite: recpipe bench $* (nproc $nproc)"
    if [ "$nproc" -gt 1 ]; then
        torchrun --standalone --nproc-per-node "$nproc" -m recpipe bench "$@" --out "$out/$suite" 2>&1
    else
        python3 -m recpipe bench "$@" --out "$out/$suite" 2>&1
    fi | grep -v "compat_table\|WARNING:root" | tee "$out/$suite.log"
}

scaling() {  # the Criteo-sized and MLPerf-shaped models on 1, 2, 4, ... GPUs of this host, and the report
    local n cfg name
    for cfg in dlrm_criteo mlperf_dcnv2; do
        for n in 1 2 4 8; do
            [ "$n" -le "$nproc" ] || continue
            name=${cfg}_$n
            echo "== scaling: $cfg on $n GPU(s)"
            mkdir -p "$out/scaling"
            torchrun --standalone --nproc-per-node "$n" -m recpipe bench --config configs/bench/$cfg.yaml \
                --set train.precision=bf16 --set pipeline.cuda_graphs=true --set data.synthetic.num_batches=60 \
                "${common[@]}" --rounds "${ROUNDS:-2}" --steps 30 --warmup 10 --trace-steps 3 \
                --pipelines "sparse_dist,sparse_dist:recat_cache=true+splits_exchange=host,sparse_dist:compile=true+step_graph=true+cuda_graphs=false" \
                --out "$out/scaling/$name" 2>&1 | grep -v "compat_table\|WARNING:root" | tee "$out/scaling/$name.log"
        done
        python3 -m recpipe.bench.scaling "$out"/scaling/${cfg}_[0-9]* --out "$out/scaling/$cfg"
    done
}

status=0
for suite in "${suites[@]}"; do
    case $suite in
    criteo) bench criteo bound --config configs/bench/dlrm_criteo.yaml --pipelines $four "${common[@]}" \
        --steps 100 --warmup 10 --set data.synthetic.num_batches=120 ;;
    gpu_bound) bench gpu_bound bound --config configs/bench/dlrm_criteo_gpu_bound.yaml --pipelines $four "${common[@]}" \
        --steps 50 --warmup 8 --set data.synthetic.num_batches=70 ;;
    opt_heavy) bench opt_heavy bound --config configs/bench/optimizer_heavy.yaml --pipelines $four "${common[@]}" \
        --steps 60 --warmup 8 --set data.synthetic.num_batches=80 ;;
    uvm) bench uvm bound --config configs/bench/uvm_caching.yaml --pipelines prefetch,sparse_dist "${common[@]}" \
        --steps 60 --warmup 8 --set data.synthetic.num_batches=80 ;;
    multipass) bench multipass multipass --config configs/bench/uvm_caching.yaml --pipelines prefetch --rounds 1 \
        --passes 1,2,4,8,12 --steps 30 --warmup 6 --set train.progress=false --set data.synthetic.num_batches=50 \
        --set 'model.num_embeddings_per_feature=[2000000,2000000,2000000,2000000,1000000,1000000,1000000,1000000,1000000,1000000,1000000,1000000,100000,100000,100000,100000,100000,100000,100000,100000,100000,100000,100000,100000,100000,100000]' \
        --set 'data.synthetic.mean_pooling_factors=[40,40,40,40,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]' \
        --set sharding.prefetch_min_pass_size=65536 ;;
    criteo_step_graph) speed criteo_step_graph --config configs/bench/dlrm_criteo.yaml --set train.precision=bf16 \
        --set pipeline.cuda_graphs=true "${common[@]}" --steps 50 --warmup 10 --trace-steps 3 \
        --pipelines "base,sparse_dist,sparse_dist:compile=true,sparse_dist:step_graph=true+cuda_graphs=false,sparse_dist:compile=true+step_graph=true+cuda_graphs=false" ;;
    mlperf) speed mlperf --config configs/bench/mlperf_dcnv2.yaml "${common[@]}" --steps 40 --warmup 10 --trace-steps 3 \
        --profile --pipelines "base,sparse_dist,sparse_dist:compile=true,sparse_dist:compile=true+step_graph=true+cuda_graphs=false" ;;
    gpu_bound_compile) speed gpu_bound_compile --config configs/bench/dlrm_criteo_gpu_bound.yaml --set train.precision=bf16 \
        --set pipeline.compile=true --set pipeline.cuda_graphs=true "${common[@]}" --steps 30 --warmup 8 --trace-steps 3 \
        --profile --pipelines "base,sparse_dist,sparse_dist:step_graph=true+cuda_graphs=false" ;;
    scaling) scaling ;;
    *) echo "unknown suite $suite (criteo gpu_bound opt_heavy uvm multipass criteo_step_graph mlperf gpu_bound_compile scaling)" >&2; exit 2 ;;
    esac
    rc=$?
    [ $rc -eq 0 ] || { echo "== $suite exited $rc"; status=1; }
done
exit $status
