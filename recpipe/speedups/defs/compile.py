"""``pipeline.compile``: the dense modules compiled by torch.compile (inductor); the
implementation and its measurements are in ``recpipe.speedups.compile``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from recpipe.sections import SwitchSection
from recpipe.speedups.definition import SpeedupDef

__all__ = ["CompileOptions", "FEATURE"]


class CompileOptions(SwitchSection):
    """``pipeline.compile``: the dense modules compiled by torch.compile (inductor).
    ``true`` / ``false`` stand for ``{enabled: true}`` / ``{enabled: false}``."""

    # Compile the dense modules (CUDA or CPU: inductor generates Triton or C++ kernels).
    enabled: bool = False
    # Module paths in the user's model to compile; empty = what the model's
    # cuda_graph_modules() names (recpipe's DLRM/DCNv2: the dense arch and the head).
    modules: list[str] = Field(default_factory=list)
    # torch.compile's mode: "default", or "max-autotune-no-cudagraphs" (Triton GEMM templates
    # with fused epilogues, benchmarked at compile time: minutes to compile). CUDA graphs are
    # recpipe's (pipeline.cuda_graphs), so no mode that makes its own.
    mode: Literal["default", "max-autotune-no-cudagraphs"] = "default"
    # Inductor's on-disk cache (compiled kernels and graphs); null = TORCHINDUCTOR_CACHE_DIR,
    # else inductor's default (/tmp/torchinductor_<user>).
    cache_dir: str | None = None
    # Kernel choices that change rounding made by inductor's heuristics, not by timing on the
    # GPU (inductor's deterministic mode): every compile of the model makes the same kernels, so
    # a restarted run resumes bit for bit. false: timed choices (may differ between processes).
    deterministic: bool = True

    @model_validator(mode="after")
    def _autotune_needs_timing(self) -> "CompileOptions":
        if self.enabled and self.deterministic and self.mode != "default":
            raise ValueError(f"pipeline.compile.mode={self.mode!r} picks kernels by timing them, which "
                             "pipeline.compile.deterministic=true rules out: set pipeline.compile.deterministic=false "
                             "to use it, or mode: default")
        return self

    def inductor_options(self) -> dict[str, Any]:
        """``torch.compile``'s ``options`` for this section: the mode's inductor settings and
        the deterministic mode (inductor is imported here, when a model is compiled)."""
        from recpipe.compat import torch as compat_torch  # imports torch: the config reads this module without it

        return {**compat_torch.inductor_mode_options(self.mode), "deterministic": self.deterministic}


FEATURE = SpeedupDef(
    "compile", CompileOptions,
    "the dense modules compiled by torch.compile (recpipe/speedups/compile.py)",
    apply="recpipe.speedups.compile:apply",
    torchrec_note="TorchRec's pipeline runs the dense part eagerly", torchrec_run="torchrec_pt2",
)
