"""Numerics of a model's dense part: ``train.precision`` = ``fp32`` | ``tf32`` | ``bf16``.

* ``fp32``: plain float32, no autocast; on CUDA the float32 matmul precision is
  torch's default, ``"highest"`` (see below).
* ``tf32``: float32 tensors, TF32 tensor-core matmuls on CUDA
  (``torch.set_float32_matmul_precision("high")``). CPUs have no TF32: on CPU it
  is fp32, with a warning.
* ``bf16``: the dense forward (and so its backward) under
  ``torch.autocast(device_type, torch.bfloat16)``: matmuls and their saved
  activations in bfloat16, weights and optimizer state stay float32 (autocast casts
  a bf16 copy per forward), the loss in float32. The embedding tables, FBGEMM's
  lookup and the pooled embeddings stay float32: autocast has no rule for the TBE
  op. The interaction (``recpipe.models.dlrm.DenseHead``) casts the pooled embeddings
  to bf16 where they meet the bf16 dense output, so DLRM's products and DCNv2's cross
  network keep their ``[B, (F+1) D]`` activations in bf16 (half the bytes of their
  elementwise work, no float32 round trips); the gradient reaching the pooled
  embeddings is cast back to fp32 by the cast's backward (tests/test_precision.py
  checks the dtypes).

The float32 matmul precision is process-wide and read when each kernel is
launched, the backward's included, so it cannot be scoped to the forward. Every
forward of a wrapped model on CUDA sets it to its own precision ("high" for tf32,
"highest" otherwise), so the backward that follows runs with it and two models of
different precision in one process (the bench's rows, tests) do not leak into
each other. ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` forces TF32 in cuBLAS whatever
this says: a warning names it when the precision is not tf32.

:class:`~recpipe.models.dlrm.RecModel` applies the precision itself (it computes
its loss outside autocast from the logits cast to float). Any other model whose
``forward(batch)`` returns ``(loss, output)`` gets it from :func:`with_precision`,
which installs a :class:`PrecisionForward` on the instance: visible in ``repr``,
removable with :func:`remove_precision`, module names and state-dict keys
unchanged. Its loss is computed by the user's code under autocast, where torch
keeps losses (BCE, cross entropy, ...) in float32, and is cast to float32.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, ContextManager

import torch
from torch import nn

from recpipe.errors import job_warning

__all__ = ["PRECISIONS", "PrecisionForward", "check_precision", "precision_context", "remove_precision",
           "with_precision"]

PRECISIONS = ("fp32", "tf32", "bf16")
_NULL = contextlib.nullcontext()  # reusable: entering it does nothing


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: choose one of {', '.join(PRECISIONS)} (train.precision)")
    return precision


def _device_type(module: nn.Module) -> str:
    """Where the module computes: the device of its first parameter or buffer that is
    not on meta (the dense layers; sharded tables are not registered parameters)."""
    for t in (*module.parameters(), *module.buffers()):
        if t.device.type != "meta":
            return t.device.type
    return "cpu"


class Numerics:
    """The per-model state behind :func:`precision_context`: the device type is
    resolved at the first forward (after DistributedModelParallel placed the dense
    layers), and each warning is given once per model."""

    def __init__(self, precision: str) -> None:
        self.precision = check_precision(precision)
        self.device_type: str | None = None

    def resolve(self, module: nn.Module) -> None:
        """Where the module computes, found once (after DistributedModelParallel placed it)."""
        if self.device_type is None:
            self.device_type = _device_type(module)
            self._warn_once()

    def context(self, module: nn.Module) -> ContextManager[Any]:
        # Inside a compiled region (recpipe.speedups.compile) only the autocast is traced: the
        # device was resolved and the matmul precision set by the eager code around it.
        if not torch.compiler.is_compiling():
            self.resolve(module)
            if self.device_type == "cuda":
                want = "high" if self.precision == "tf32" else "highest"
                if torch.get_float32_matmul_precision() != want:
                    torch.set_float32_matmul_precision(want)
        if self.precision == "bf16":
            # No cast cache: each forward casts each weight once anyway (DLRM uses each once),
            # and CUDA graph capture of autocast regions needs it off (make_graphed_callables).
            return torch.autocast(self.device_type, dtype=torch.bfloat16, cache_enabled=False)
        return _NULL

    def _warn_once(self) -> None:
        if self.precision == "tf32" and self.device_type != "cuda":
            job_warning(f"train.precision='tf32' has no effect on {self.device_type} (no TF32 there): "
                        "the model runs in fp32", stacklevel=4)
        override = os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "0") not in ("", "0")
        if override and self.precision != "tf32" and self.device_type == "cuda":
            job_warning(f"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE is set: cuBLAS uses TF32 for fp32 matmuls although "
                        f"train.precision={self.precision!r}; unset it, or set train.precision=tf32", stacklevel=4)


def precision_context(module: nn.Module) -> ContextManager[Any]:
    """The context the dense forward of ``module`` runs in (autocast for bf16, else a
    null context); ``module._numerics`` is set by RecModel or :func:`with_precision`."""
    return module._numerics.context(module)


class PrecisionForward:
    """Instance ``forward`` installed by :func:`with_precision`: the module's own
    forward under its precision, the loss returned in float32."""

    def __init__(self, module: nn.Module, precision: str) -> None:
        self.module = module
        self.precision = precision
        self.inner = type(module).forward.__get__(module)

    def __repr__(self) -> str:
        return f"PrecisionForward({type(self.module).__name__}, precision={self.precision!r}; recpipe.models.precision)"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with precision_context(self.module):
            loss, output = self.inner(*args, **kwargs)
        return loss.float(), output


def with_precision(model: nn.Module, precision: str) -> nn.Module:
    """``model`` with its forward run under ``precision`` (fp32 too: it resets the
    matmul precision a tf32 model may have left). The same object is returned:
    parameter names do not change."""
    check_precision(precision)
    if "forward" in vars(model):
        raise ValueError(f"with_precision: {type(model).__name__} already has an instance forward "
                         f"({vars(model)['forward']!r}); apply the precision before other wrappers")
    model._numerics = Numerics(precision)
    model.forward = PrecisionForward(model, precision)
    return model


def remove_precision(model: nn.Module) -> nn.Module:
    """Undo :func:`with_precision` (a model without one is returned as is)."""
    if isinstance(vars(model).get("forward"), PrecisionForward):
        del model.forward
        del model._numerics
    return model
