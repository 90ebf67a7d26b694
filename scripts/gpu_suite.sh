#!/usr/bin/env bash
# The GPU gate: every `gpu`-marked test, run on a GPU machine, and the record of it.
#
#   scripts/gpu_suite.sh --commit SHA --out DIR [--part K/N] [--previous DIR]
#   scripts/gpu_suite.sh --commit SHA --out DIR --one-gpu-parts N
#
# Runs `python3 -m pytest -m gpu` over tests/ (or part K of N: the test files split into N
# groups of about equal test counts, so that each part fits one call of a time-limited
# machine), with pytest's JUnit XML report in DIR/gpu_suite_partK.xml, then writes
# DIR/gpu_suite.md from every part's XML found in DIR and in --previous (the parts run
# earlier): the commit, the device, the stack's versions and every test with its outcome.
#
# --one-gpu-parts N runs the N parts at once on a machine with N GPUs, part K on GPU K-1 alone
# (CUDA_VISIBLE_DEVICES), so every test sees one GPU, as on a one-GPU machine: the suite in
# the time of its longest part, the cases that need two GPUs skipped and listed as such.
#
# Copy DIR/gpu_suite.md to benchmarks/gpu_suite.md. The rule (README, Contributing): a change
# under recpipe/ or tests/ lands with a benchmarks/gpu_suite.md whose commit has the same
# recpipe/ and tests/ trees and no failure.
#
# On this project's GPU machines the embedding stack travels as .devstack/ (sourced here
# when present); elsewhere the current Python environment must have it.
set -euo pipefail
cd "$(dirname "$0")/.."
commit="" out="" part="1/1" previous="" gpus=""
while [ $# -gt 0 ]; do
  case "$1" in
    --commit) commit="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --part) part="$2"; shift 2 ;;
    --previous) previous="$2"; shift 2 ;;
    --one-gpu-parts) gpus="$2"; shift 2 ;;
    *) echo "gpu_suite.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
usage="usage: scripts/gpu_suite.sh --commit SHA --out DIR [--part K/N] [--previous DIR] | [--one-gpu-parts N]"
[ -n "$commit" ] && [ -n "$out" ] || { echo "$usage" >&2; exit 2; }
if [ -f .devstack/activate.sh ]; then source .devstack/activate.sh; fi
mkdir -p "$out"

run_part() {  # run_part K/N: pytest over part K's files, JUnit XML in $out
  local files
  files=$(python3 scripts/gpu_suite_report.py files --part "$1")
  # shellcheck disable=SC2086
  python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider --durations=0 \
    --junitxml="$out/gpu_suite_part${1%/*}.xml" $files
}

status=0
if [ -n "$gpus" ]; then
  visible=$(python3 -c "import torch; print(torch.cuda.device_count())")
  [ "$visible" -ge "$gpus" ] || { echo "gpu_suite.sh: --one-gpu-parts $gpus needs $gpus GPUs, $visible visible" >&2; exit 2; }
  pids=()
  for k in $(seq 1 "$gpus"); do
    CUDA_VISIBLE_DEVICES=$((k - 1)) run_part "$k/$gpus" > "$out/gpu_suite_part$k.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  for k in $(seq 1 "$gpus"); do echo "== part $k/$gpus"; tail -n 60 "$out/gpu_suite_part$k.log"; done
  export CUDA_VISIBLE_DEVICES=0  # the record's device line: what each test saw
else
  run_part "$part" || status=$?
  k="${part%/*}"
fi
python3 scripts/gpu_suite_report.py render --commit "$commit" --out "$out/gpu_suite.md" "$out"/gpu_suite_part*.xml \
  ${previous:+$(ls "$previous"/gpu_suite_part*.xml 2>/dev/null | grep -v "part${k:-0}.xml")}
exit $status
