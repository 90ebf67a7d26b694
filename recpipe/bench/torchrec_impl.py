"""TorchRec's own train pipelines, configured like the recpipe pipeline of the same name
(its registry entry, ``PipelineDef.torchrec``; with ``pipeline.compile`` on, also ``TrainPipelinePT2``: TorchRec's
compiled base pipeline, ``TorchCompileConfig()`` defaults). TorchRec 1.6 and 1.8 take the
same constructor arguments used here, all imported from ``...train_pipeline.train_pipelines``
(``TrainPipelineSemiSync`` is not exported from the package in some versions). Both
implementations run on the same sharded model; options without a TorchRec counterpart are
notes on the row, never silently dropped. TorchRec FX-traces the model on the first batch to
find the sharded modules' inputs (``batch.sparse_features`` becomes an attribute step it
replays on the real batch) and only logs a module it cannot pipeline, so
:func:`pipelined_module_count` goes on the row (0: no overlap).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Iterator

import torch
from torch import nn

from recpipe.config import RecpipeConfig
from recpipe.errors import PipelineError
from recpipe.pipelines.registry import PIPELINES

__all__ = ["build_torchrec_pipeline", "compile_enabled", "dynamo_config_kept", "pipelined_module_count"]

PT2_CLASS = "TrainPipelinePT2"


def compile_enabled(cfg: RecpipeConfig) -> bool:
    """Whether ``pipeline.compile.enabled`` is on (False where the config has no such section)."""
    return bool(getattr(getattr(cfg.pipeline, "compile", None), "enabled", False))


def _options(cfg: RecpipeConfig) -> tuple[dict[str, Any], list[str]]:
    """TorchRec keyword arguments for ``cfg.pipeline`` and notes on what does not map
    (the pipeline's registry entry says, ``PipelineDef.torchrec_options``)."""
    p = cfg.pipeline
    notes: list[str] = []
    if p.max_batches_ahead is not None:
        notes.append(f"pipeline.max_batches_ahead={p.max_batches_ahead} has no TorchRec counterpart")
    for feature in ("compile", "cuda_graphs", "step_graph"):
        if getattr(p, feature).enabled:
            notes.append(f"pipeline.{feature} is recpipe's: TorchRec's pipeline runs the dense part eagerly")
    if p.inputs:
        notes.append(f"pipeline.inputs {sorted(p.inputs)} has no TorchRec counterpart here")
    kwargs, own_notes = PIPELINES[p.name].torchrec_options(p)
    return kwargs, notes + own_notes


def build_torchrec_pipeline(
    cfg: RecpipeConfig, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
    compiled: bool = False,
) -> tuple[Any, dict[str, Any], list[str]]:
    """(pipeline, the options it was given, notes) for ``cfg.pipeline.name``; ``compiled``:
    ``TrainPipelinePT2`` (the config's pipeline must be ``base``: it has no overlap)."""
    from torchrec.distributed.train_pipeline import train_pipelines

    kwargs, notes = _options(cfg)
    if compiled:
        assert cfg.pipeline.name == "base", cfg.pipeline.name
        config = train_pipelines.TorchCompileConfig()
        pipe = getattr(train_pipelines, PT2_CLASS)(model, optimizer, device, compile_configs=config)
        return pipe, {"compile_configs": dataclasses.asdict(config)}, notes
    name = PIPELINES[cfg.pipeline.name].torchrec
    if name is None:
        raise PipelineError(f"pipeline {cfg.pipeline.name!r} has no TorchRec counterpart")
    cls = getattr(train_pipelines, name)
    return cls(model, optimizer, device, **kwargs), kwargs, notes


@contextlib.contextmanager
def dynamo_config_kept() -> Iterator[None]:
    """``torch._dynamo.config`` as it was before, and dynamo's caches dropped, after the block."""
    import torch._dynamo

    saved = torch._dynamo.config.save_config()
    try:
        yield
    finally:
        with warnings.catch_warnings():  # the saved config names deprecated keys too
            warnings.simplefilter("ignore", FutureWarning)
            torch._dynamo.config.load_config(saved)
        torch._dynamo.reset()


def pipelined_module_count(pipe: Any) -> int | None:
    """Sharded modules TorchRec rewrote for pipelining (None for pipelines that do not
    rewrite). Reads a private attribute present in 1.6.1 and 1.8.0."""
    modules = getattr(pipe, "_pipelined_modules", None)
    return None if modules is None else len(modules)
