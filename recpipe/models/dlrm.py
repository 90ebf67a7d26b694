"""DLRM (dot interaction) and DCNv2 on torchrec's EmbeddingBagCollection.

``build_model`` returns a :class:`RecModel`: ``model(batch) -> (loss, (loss, logits,
labels, weights))``, the contract of TorchRec's train pipelines (``(loss, output)``;
``torch.sum(loss).backward()`` is valid) with the output layout of TorchRec's
DLRMTrain plus the per-sample loss weights, so the same module runs under recpipe's
pipelines and TorchRec's, and the trainer's metrics read it (docs/models.md).
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM, DLRM_DCN

from recpipe.config import ModelConfig
from recpipe.data.batch import Batch


def embedding_configs(cfg: ModelConfig) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=table,
            embedding_dim=cfg.embedding_dim,
            num_embeddings=rows,
            feature_names=[feature],
        )
        for table, feature, rows in zip(cfg.table_names, cfg.feature_names, cfg.num_embeddings_per_feature)
    ]


class RecModel(nn.Module):
    """Wraps a DLRM-family module with the weighted BCE loss.

    The loss is ``sum(w_i * bce_i) / B``: with all weights 1 it is the mean BCE; a
    padding batch (all weights 0) contributes exactly zero gradient.
    """

    def __init__(self, dlrm: nn.Module) -> None:
        super().__init__()
        self.model = dlrm

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        per_sample = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels, reduction="none")
        loss = (per_sample * batch.weights).sum() / batch.labels.numel()
        return loss, (loss.detach(), logits.detach(), batch.labels, batch.weights)


def build_model(cfg: ModelConfig, device: torch.device = torch.device("meta")) -> RecModel:
    """The unsharded model. Embedding tables go on ``device`` (meta by default:
    DistributedModelParallel materializes only the shards each rank owns)."""
    ebc = EmbeddingBagCollection(tables=embedding_configs(cfg), device=device)
    common = dict(
        embedding_bag_collection=ebc,
        dense_in_features=cfg.num_dense_features,
        dense_arch_layer_sizes=list(cfg.dense_arch_layer_sizes),
        over_arch_layer_sizes=list(cfg.over_arch_layer_sizes),
    )
    if cfg.arch == "dlrm":
        dlrm: nn.Module = DLRM(**common)
    else:
        dlrm = DLRM_DCN(**common, dcn_num_layers=cfg.dcn_num_layers, dcn_low_rank_dim=cfg.dcn_low_rank_dim)
    return RecModel(dlrm)
