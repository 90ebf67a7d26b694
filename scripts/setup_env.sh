#!/usr/bin/env bash
# Creates (or reuses) .venv in the checkout and installs the stack that fits this machine,
# from whatever index pip is configured with (PyPI alone is enough): torch, then fbgemm-gpu-cpu
# without a GPU or fbgemm-gpu with one, then torchrec with the needs it declares, then recpipe.
# Versions come from scripts/versions.env only; `pip check` must pass at the end. A second run
# finds the stamp file written by the first and returns at once.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
source scripts/versions.env
PY="${PYTHON:-python3}"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=cuda; else flavour=cpu; fi
want="$(cat scripts/versions.env scripts/setup_env.sh pyproject.toml | sha256sum | cut -c1-16)-$flavour"
stamp=.venv/.recpipe-stamp
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
echo "setup: installing the $flavour stack into .venv (versions from scripts/versions.env)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
vpy=.venv/bin/python
pip=("$vpy" -m pip install -q --disable-pip-version-check)
# torch alone first: the build pip finds (a CPU build from a local wheel or PyTorch's CPU index,
# else PyPI's CUDA build, which also runs on a CPU) decides whether Triton is still needed.
"${pip[@]}" "torch==$TORCH_VERSION"
if [ "$flavour" = cpu ]; then
  "${pip[@]}" "fbgemm-gpu-cpu==$FBGEMM_VERSION"
  # torchrec declares `fbgemm-gpu`, a name that PyPI gives only to the CUDA build (it needs the
  # NVIDIA driver to load). PyTorch's CPU index serves the CPU build under that name
  # (fbgemm-gpu X+cpu); from PyPI that build is fbgemm-gpu-cpu. This metadata-only distribution
  # `fbgemm-gpu X+cpu` (no files; it requires fbgemm-gpu-cpu==X) states the same on any index,
  # so torchrec installs with its declared needs and `pip check` holds.
  alias_dir=$(mktemp -d)
  trap 'rm -rf "$alias_dir"' EXIT
  cat > "$alias_dir/pyproject.toml" <<TOML
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"
[project]
name = "fbgemm-gpu"
version = "$FBGEMM_VERSION+cpu"
description = "fbgemm-gpu's CPU build, as PyTorch's CPU index names it: provided by fbgemm-gpu-cpu (recpipe's scripts/setup_env.sh)"
dependencies = ["fbgemm-gpu-cpu==$FBGEMM_VERSION"]
[tool.setuptools]
py-modules = []
packages = []
TOML
  "${pip[@]}" "$alias_dir"
  if ! "$vpy" -c "import triton" >/dev/null 2>&1; then
    "${pip[@]}" "triton==$TRITON_CPU_VERSION"
  fi
else
  "${pip[@]}" "fbgemm-gpu==$FBGEMM_VERSION"
fi
# shellcheck disable=SC2086
"${pip[@]}" "torchrec[datasets]==$TORCHREC_VERSION" $PY_DEPS
"${pip[@]}" --no-build-isolation -e .
"$vpy" -m pip check
echo "$want" > "$stamp"
