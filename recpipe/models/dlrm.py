"""DLRM (dot interaction) and DCNv2 on torchrec's EmbeddingBagCollection.

``build_model`` returns a :class:`RecModel`: ``model(batch) -> (loss, (loss, logits, labels))``,
the contract of TorchRec's train pipelines (``torch.sum(loss).backward()`` is valid),
so the same module runs under recpipe's pipelines and TorchRec's, with the same
numerics (``train.precision``, :mod:`recpipe.models.precision`).
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM, DLRM_DCN

from recpipe.config import ModelConfig
from recpipe.data.batch import Batch
from recpipe.models.precision import _Numerics, precision_context


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

    ``precision`` (``train.precision``): the DLRM runs under
    :func:`~recpipe.models.precision.precision_context` (autocast for bf16); the
    logits are cast to float32 before the loss, which is computed outside autocast.
    In fp32 that cast returns the same tensor: the fp32 model computes exactly what
    it did before precisions existed.
    """

    def __init__(self, dlrm: nn.Module, precision: str = "fp32") -> None:
        super().__init__()
        self.model = dlrm
        self._numerics = _Numerics(precision)

    @property
    def precision(self) -> str:
        return self._numerics.precision

    def extra_repr(self) -> str:
        return f"precision={self.precision!r}"

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        with precision_context(self):
            logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        logits = logits.float()
        per_sample = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels, reduction="none")
        loss = (per_sample * batch.weights).sum() / batch.labels.numel()
        return loss, (loss.detach(), logits.detach(), batch.labels)


def build_model(cfg: ModelConfig, device: torch.device = torch.device("meta"), precision: str = "fp32") -> RecModel:
    """The unsharded model. Embedding tables go on ``device`` (meta by default:
    DistributedModelParallel materializes only the shards each rank owns);
    ``precision`` is ``train.precision``."""
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
    return RecModel(dlrm, precision)
