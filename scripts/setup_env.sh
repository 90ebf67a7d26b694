#!/usr/bin/env bash
# Creates (or reuses) .venv in the checkout and installs the stack that fits this
# machine: CPU build of torch + fbgemm-gpu-cpu without a GPU, fbgemm-gpu with one.
# Versions come from scripts/versions.env only. A second run finds the stamp file
# written by the first and returns at once.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
source scripts/versions.env
PY="${PYTHON:-python3}"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=cuda; else flavour=cpu; fi
want="$(cat scripts/versions.env pyproject.toml | sha256sum | cut -c1-16)-$flavour"
stamp=.venv/.recpipe-stamp
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
echo "setup: installing the $flavour stack into .venv (versions from scripts/versions.env)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if [ "$flavour" = cpu ]; then
  "${pip[@]}" "torch==$TORCH_VERSION" "fbgemm-gpu-cpu==$FBGEMM_CPU_VERSION" "triton==$TRITON_CPU_VERSION"
else
  "${pip[@]}" "torch==$TORCH_VERSION" "fbgemm-gpu==$FBGEMM_CUDA_VERSION"
fi
"${pip[@]}" --no-deps "torchrec==$TORCHREC_VERSION"
# shellcheck disable=SC2086
"${pip[@]}" $TORCHREC_DEPS $PY_DEPS
"${pip[@]}" --no-deps --no-build-isolation -e .
echo "$want" > "$stamp"
