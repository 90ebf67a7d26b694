"""TorchRec's own train pipelines, configured like the recpipe pipeline of the same name
(``TORCHREC_CLASSES``; with ``pipeline.compile`` on, also ``TrainPipelinePT2``: TorchRec's
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

__all__ = ["TORCHREC_CLASSES", "build_torchrec_pipeline", "compile_enabled", "dynamo_config_kept",
           "pipelined_module_count"]

TORCHREC_CLASSES = {  # options passed: _options
    "base": "TrainPipelineBase",
    "sparse_dist": "TrainPipelineSparseDist",  # execute_all_batches=True (every TorchRec pipeline below too)
    "fused_sparse_dist": "TrainPipelineFusedSparseDist",  # emb_lookup_stream (recpipe's default: current)
    "semi_sync": "TrainPipelineSemiSync",  # start_batch (recpipe's default 0, TorchRec's 900), stash_gradients
    "prefetch": "PrefetchTrainPipelineSparseDist",
}
PT2_CLASS = "TrainPipelinePT2"


def compile_enabled(cfg: RecpipeConfig) -> bool:
    """Whether ``pipeline.compile.enabled`` is on (False where the config has no such section)."""
    return bool(getattr(getattr(cfg.pipeline, "compile", None), "enabled", False))


def _options(cfg: RecpipeConfig) -> tuple[dict[str, Any], list[str]]:
    """TorchRec keyword arguments for ``cfg.pipeline`` and notes on what does not map."""
    p = cfg.pipeline
    notes: list[str] = []
    if p.max_batches_ahead is not None:
        notes.append(f"pipeline.max_batches_ahead={p.max_batches_ahead} has no TorchRec counterpart")
    if p.cuda_graphs:
        notes.append("pipeline.cuda_graphs is recpipe's: TorchRec's pipeline runs the dense part eagerly")
    if p.inputs:
        notes.append(f"pipeline.inputs {sorted(p.inputs)} has no TorchRec counterpart here")
    if p.name == "base":
        return {}, notes
    kwargs: dict[str, Any] = {"execute_all_batches": True}
    if p.name == "fused_sparse_dist":
        kwargs["emb_lookup_stream"] = p.emb_lookup_stream
        if p.emb_lookup != "before_optimizer":
            notes.append(f"pipeline.emb_lookup={p.emb_lookup!r} has no TorchRec counterpart (it looks up before)")
    elif p.name == "semi_sync":
        kwargs.update(start_batch=p.start_batch, stash_gradients=p.stash_gradients)
    return kwargs, notes


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
    cls = getattr(train_pipelines, TORCHREC_CLASSES[cfg.pipeline.name])
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
