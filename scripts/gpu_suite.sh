#!/usr/bin/env bash
# The GPU gate: every `gpu`-marked test, run on a GPU machine, and the record of it.
#
#   scripts/gpu_suite.sh --commit SHA --out DIR [--part K/N] [--previous DIR]
#
# Runs `python3 -m pytest -m gpu` over tests/ (or part K of N: the test files split into N
# groups of about equal test counts, so that each part fits one call of a time-limited
# machine), with pytest's JUnit XML report in DIR/gpu_suite_partK.xml, then writes
# DIR/gpu_suite.md from every part's XML found in DIR and in --previous (the parts run
# earlier): the commit, the device, the stack's versions and every test with its outcome.
# Copy DIR/gpu_suite.md to benchmarks/gpu_suite.md. The rule (README, Contributing): a change
# under recpipe/ or tests/ lands with a benchmarks/gpu_suite.md whose commit has the same
# recpipe/ and tests/ trees and no failure.
#
# On this project's GPU machines the embedding stack travels as .devstack/ (sourced here
# when present); elsewhere the current Python environment must have it.
set -euo pipefail
cd "$(dirname "$0")/.."
commit="" out="" part="1/1" previous=""
while [ $# -gt 0 ]; do
  case "$1" in
    --commit) commit="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --part) part="$2"; shift 2 ;;
    --previous) previous="$2"; shift 2 ;;
    *) echo "gpu_suite.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -n "$commit" ] && [ -n "$out" ] || { echo "usage: scripts/gpu_suite.sh --commit SHA --out DIR [--part K/N] [--previous DIR]" >&2; exit 2; }
if [ -f .devstack/activate.sh ]; then source .devstack/activate.sh; fi
mkdir -p "$out"
k="${part%/*}"
files=$(python3 scripts/gpu_suite_report.py files --part "$part")
set +e
# shellcheck disable=SC2086
python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider --junitxml="$out/gpu_suite_part$k.xml" $files
status=$?
set -e
python3 scripts/gpu_suite_report.py render --commit "$commit" --out "$out/gpu_suite.md" "$out"/gpu_suite_part*.xml \
  ${previous:+$(ls "$previous"/gpu_suite_part*.xml 2>/dev/null | grep -v "part$k.xml")}
exit $status
