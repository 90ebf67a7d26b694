"""Which build of fbgemm-gpu is installed, read without importing it, so that a CUDA build on a
machine without the NVIDIA driver (PyPI's ``fbgemm-gpu`` is the CUDA build) is one line before
anything starts, not a failed library load in every process. Imports nothing heavy."""

from __future__ import annotations

import ctypes
import importlib.util
import json
from pathlib import Path

from recpipe.errors import ConfigError

# The NVIDIA driver's library that fbgemm-gpu's CUDA build links against.
DRIVER_LIBRARY = "libnvidia-ml.so.1"


def fbgemm_target() -> dict[str, str]:
    """fbgemm-gpu's build record (``version``, ``variant``: ``cpu``, ``cuda``, ...), the file its
    own ``__init__`` reads; {} when fbgemm-gpu is not installed or has no such file."""
    spec = importlib.util.find_spec("fbgemm_gpu")
    if spec is None or not spec.submodule_search_locations:
        return {}
    path = Path(next(iter(spec.submodule_search_locations))) / "docs" / "target.default.json.py"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def has_nvidia_driver() -> bool:
    try:
        ctypes.CDLL(DRIVER_LIBRARY)
    except OSError:
        return False
    return True


def check_fbgemm_build() -> None:
    """Refuse a CUDA build of fbgemm-gpu where the NVIDIA driver is missing (it cannot load)."""
    target = fbgemm_target()
    if target.get("variant") != "cuda" or has_nvidia_driver():
        return
    version = target.get("version", "")
    # From PyPI alone the CPU build is fbgemm-gpu-cpu, which installs the same fbgemm_gpu module.
    cpu_build = f"fbgemm-gpu-cpu=={version}" if version else "fbgemm-gpu-cpu"
    raise ConfigError(
        f"the installed fbgemm-gpu {version} is its CUDA build, which needs the NVIDIA driver "
        f"({DRIVER_LIBRARY} is not found); without a GPU install its CPU build: pip install 'recpipe[cpu]' "
        "--extra-index-url https://download.pytorch.org/whl/cpu, or from PyPI alone: "
        f"pip uninstall -y fbgemm-gpu && pip install {cpu_build} (docs/install.md)")
