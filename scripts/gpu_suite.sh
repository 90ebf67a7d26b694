#!/usr/bin/env bash
# The GPU gate: every `gpu`-marked test on the GPUs of this machine, and the record of it.
#
#   scripts/gpu_suite.sh --commit SHA --out DIR [--gpus N] [--test-timeout S] [--deadline S]
#
# Each test runs on as many GPUs as it needs (1, 2 or 4), the parts at once on the machine's
# GPUs (scripts/gpu_suite.py says how they are split and scheduled); DIR/gpu_suite.md is
# the record, DIR/part*.log each part's output. Copy DIR/gpu_suite.md to
# benchmarks/gpu_suite.md. The rule (README, Contributing): a change under recpipe/ or
# tests/ lands with a benchmarks/gpu_suite.md whose commit has the same recpipe/ and tests/
# trees, 0 failed and 0 skipped for want of GPUs: run it on a machine with 4 GPUs.
#
# On this project's GPU machines the embedding stack travels as .devstack/ (sourced here
# when present); elsewhere the current Python environment must have it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .devstack/activate.sh ]; then source .devstack/activate.sh; fi
exec python3 scripts/gpu_suite.py run "$@"
