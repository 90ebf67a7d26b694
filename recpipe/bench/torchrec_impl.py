"""TorchRec's own train pipelines, configured like the recpipe pipeline of the same name.

Mapping (TorchRec 1.6.1 and 1.8.0 have the same constructor arguments used here):

=================  ===================================  ==========================================
recpipe            TorchRec class                       options passed
=================  ===================================  ==========================================
base               TrainPipelineBase                    -
sparse_dist        TrainPipelineSparseDist              execute_all_batches=True
fused_sparse_dist  TrainPipelineFusedSparseDist         emb_lookup_stream="current" (recpipe's stream)
semi_sync          TrainPipelineSemiSync                start_batch, stash_gradients (config; recpipe's
                                                        default start_batch is 0, TorchRec's 900)
prefetch           PrefetchTrainPipelineSparseDist      -
=================  ===================================  ==========================================

``TrainPipelineSemiSync`` is not exported from ``torchrec.distributed.train_pipeline``
in some versions, so everything is imported from ``...train_pipeline.train_pipelines``.

Both implementations run on the same sharded model (``recpipe.sharding.shard_model``):
its one-rank shortcuts and, on several ranks, its gradient all-reduce
(``sharding.dense_gradients: all_reduce``; TorchRec's default DDP wrapper with a
``name:sharding.dense_gradients=ddp`` variant, which runs on both).

Options without a TorchRec counterpart (``pipeline.max_batches_ahead``,
``pipeline.uneven_data``, fused ``emb_lookup=after_optimizer``) are reported as notes
on the row, never silently dropped.

Tracing. TorchRec FX-traces the model on the first batch to find the sharded
modules' inputs. ``_rewrite_model`` passes ``batch.to_proxy()`` as concrete args
only when the batch has that method; recpipe's ``Batch`` has none, so the tracer
makes a plain placeholder for ``RecModel.forward``'s ``batch`` argument and
``batch.sparse_features`` becomes a ``GetAttrArgInfoStep`` that TorchRec replays on
the real batch. No subclass of ``Batch`` is needed. TorchRec only *logs* a module it
cannot pipeline, so :func:`pipelined_module_count` reads how many it did pipeline
and the runner puts it on the row (0 for a SparseDist-family pipeline = no overlap).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from recpipe.config import RecpipeConfig
from recpipe.pipelines.registry import PIPELINES

__all__ = ["build_torchrec_pipeline", "pipelined_module_count"]

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
    cfg: RecpipeConfig, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> tuple[Any, dict[str, Any], list[str]]:
    """(pipeline, the options it was given, notes) for ``cfg.pipeline.name``."""
    from torchrec.distributed.train_pipeline import train_pipelines

    cls = getattr(train_pipelines, PIPELINES[cfg.pipeline.name].torchrec)
    kwargs, notes = _options(cfg)
    return cls(model, optimizer, device, **kwargs), kwargs, notes


def pipelined_module_count(pipe: Any) -> int | None:
    """Sharded modules TorchRec rewrote for pipelining (None for TrainPipelineBase,
    which does not rewrite). Reads a private attribute present in 1.6.1 and 1.8.0."""
    modules = getattr(pipe, "_pipelined_modules", None)
    return None if modules is None else len(modules)
