"""torch's private names recpipe reads (see :mod:`recpipe.compat`).

Checked against torch 2.13 (``torch/nn/modules/module.py``); torch 2.11: to be checked on
the GPU machine (tests/test_compat.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn


def backward_pre_hooks(module: nn.Module) -> dict[int, Any]:
    """A module's backward pre-hooks by handle id (``_backward_pre_hooks``), to be replaced
    in place: speedups/cache_bookkeeping.py swaps FBGEMM's hook for one that replays it per
    batch. ``register_full_backward_pre_hook`` only adds; no public API replaces one."""
    return module._backward_pre_hooks
