"""DLRM (dot interaction) and DCNv2 on torchrec's EmbeddingBagCollection.

``build_model`` returns a :class:`RecModel`: ``model(batch) -> (loss, (loss, logits,
labels, weights))``, the contract of TorchRec's train pipelines (``(loss, output)``;
``torch.sum(loss).backward()`` is valid) with the output layout of TorchRec's
DLRMTrain plus the per-sample loss weights, so the same module runs under recpipe's
pipelines and TorchRec's, and the trainer's metrics read it (docs/models.md), with the same
numerics for both (``train.precision``, :mod:`recpipe.models.precision`).
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM, DLRM_DCN, InteractionArch, InteractionDCNArch
from torchrec.modules.crossnet import LowRankCrossNet

from recpipe.config import ModelConfig
from recpipe.data.batch import Batch
from recpipe.models.precision import Numerics, precision_context


def embedding_configs(cfg: ModelConfig) -> list[EmbeddingBagConfig]:
    """The tables of ``cfg``, with TorchRec's default ``init_fn`` (U(-1/sqrt(rows), 1/sqrt(rows))).

    Sharding draws every table twice: TorchRec's batched kernels draw each shard when they are
    built (``init_parameters``), then the sharded module calls each table's ``init_fn``
    (``reset_parameters``), table by table in config order. The second draw is what makes the
    initial weights independent of how TorchRec groups the tables into TBEs (one rank: a
    row_wise table placed table_wise trains bit for bit as row_wise, tests/test_pipelines.py),
    so it stays; it costs one pass over the weights where they live (on CPU a sizeable share
    of ``shard_model``; on a GPU, one pass at its memory bandwidth)."""
    return [
        EmbeddingBagConfig(
            name=table,
            embedding_dim=cfg.embedding_dim,
            num_embeddings=rows,
            feature_names=[feature],
        )
        for table, feature, rows in zip(cfg.table_names, cfg.feature_names, cfg.num_embeddings_per_feature)
    ]


class DenseHead(nn.Module):
    """Interaction, over arch and loss: everything after the embedding lookup.

    ``(dense_out, sparse_out, labels, weights) -> (loss, logits)``, tensors in and out,
    so it can run as one CUDA graph (``pipeline.cuda_graphs``) or be compiled
    (``pipeline.compile``). The interaction runs in the dense output's dtype: under bf16
    the pooled embeddings are cast to bf16 where they meet the dense output (DLRM's
    products, DCNv2's cross network: :meth:`cross`), so the ``[B, F+1, D]`` activations
    are bf16 from there on; in fp32 nothing changes. For DLRM's dot
    interaction the upper-triangle gather is an ``index_select`` on the flattened
    products: the same values as torchrec's ``interactions[:, i, j]``, but its backward
    is an ``index_add`` (every index appears once, so it is exact) instead of the
    sort-based ``index_put``, a visible share of an 8192-sample step's GPU time.
    """

    def __init__(self, inter_arch: nn.Module, over_arch: nn.Module, owner: nn.Module) -> None:
        super().__init__()
        self.inter_arch, self.over_arch = inter_arch, over_arch
        object.__setattr__(self, "owner", owner)  # the RecModel whose precision applies (not a child)

    def interact(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        arch = self.inter_arch
        if type(arch) is InteractionDCNArch and type(arch.crossnet) is LowRankCrossNet and arch.F > 0:
            return self.cross(dense, sparse)
        if type(arch) is not InteractionArch or arch.F <= 0:
            return arch(dense_features=dense, sparse_features=sparse)
        combined = torch.cat((dense.unsqueeze(1), sparse.to(dense.dtype)), dim=1)  # [B, F+1, D]
        products = torch.bmm(combined, combined.transpose(1, 2)).flatten(1)  # [B, (F+1)^2]
        rows, cols = arch.triu_indices
        flat = products.index_select(1, rows * (arch.F + 1) + cols)  # [B, (F+1) choose 2]
        return torch.cat((dense, flat), dim=1)

    def cross(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """torchrec's ``InteractionDCNArch`` with its ``LowRankCrossNet``, the same operations
        on the same parameters, in the dense output's dtype: under bf16 the pooled embeddings
        enter the cross network in bf16, and each layer's bias is added in bf16, so its
        ``[B, (F+1) D]`` activations stay bf16 from x0 to the over arch (torchrec's adds a
        float32 bias, which promotes every layer's output, and the cat with the float32 pooled
        embeddings promotes x0: every elementwise pass over them then moves float32). In fp32
        it is torchrec's forward, operation for operation."""
        net = self.inter_arch.crossnet
        x0 = torch.cat((dense.unsqueeze(1), sparse.to(dense.dtype)), dim=1).flatten(1)
        x = x0
        for v, w, bias in zip(net.V_kernels, net.W_kernels, net.bias):
            x = x0 * (nn.functional.linear(nn.functional.linear(x, v), w) + bias.to(x0.dtype)) + x
        return x

    def forward(
        self, dense: torch.Tensor, sparse: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with precision_context(self.owner):
            logits = self.over_arch(self.interact(dense, sparse)).squeeze(-1)
        logits = logits.float()
        per_sample = nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="none")
        loss = (per_sample * weights).sum() / labels.numel()
        return loss, logits


def _own_copy(grad: torch.Tensor) -> torch.Tensor:
    return grad.clone(memory_format=torch.contiguous_format)


def sparse_arch_forward(arch: nn.Module, features) -> torch.Tensor:
    """torchrec's ``SparseArch`` forward, ``[B, F, D]``, without its forward copy.

    torchrec splits the pooled ``KeyedTensor`` into one tensor per feature
    (``to_dict``) and concatenates them again in the arch's feature order. The
    KeyedTensor's values already are ``[B, F * D]`` in that order (its keys are the
    arch's features; DLRM's tables share one dimension), so a view gives the same
    values: one ``[B, F, D]`` copy (0.9 GB of memory traffic at 65536 samples) and
    the host's split into F views less per step. Keys in another order, or
    dimensions that differ, take torchrec's path.

    The backward keeps torchrec's memory and data flow: the gradient that reaches the
    view is a slice of the interaction's input gradient (or, with
    ``pipeline.cuda_graphs``, the captured head's static gradient buffer, which its
    next replay overwrites). Passed on as it is, it would keep that whole gradient
    alive through the TBE backward, or hand a buffer the graph reuses to the
    embeddings' backward, which may run on another stream. A hook copies it, the copy
    torchrec's ``cat`` backward made, so the same tensors are alive at the TBE
    backward (tests/test_planner_liveness.py).
    Under FX tracing (TorchRec's pipelines find the sharded modules' inputs that way)
    the pooled result is a proxy, with no keys to check and no hooks: the view is traced.
    """
    kt = arch.embedding_bag_collection(features)
    if isinstance(kt, torch.fx.Proxy):
        return kt.values().reshape(-1, arch.F, arch.D)
    if kt.key_dim() == 1 and kt.keys() == arch.sparse_feature_names and all(d == arch.D for d in kt.length_per_key()):
        sparse = kt.values().reshape(-1, arch.F, arch.D)
        if sparse.requires_grad:
            sparse.register_hook(_own_copy)
        return sparse
    by_key = kt.to_dict()
    return torch.cat([by_key[name] for name in arch.sparse_feature_names], dim=1).reshape(-1, arch.F, arch.D)


class RecModel(nn.Module):
    """Wraps a DLRM-family module with the weighted BCE loss.

    The loss is ``sum(w_i * bce_i) / B``: with all weights 1 it is the mean BCE; a
    padding batch (all weights 0) contributes exactly zero gradient. The forward is
    torchrec's DLRM forward split at the embedding lookup: ``dense_arch`` and the
    ``DenseHead`` (interaction, over arch, loss) are the modules
    ``cuda_graph_modules()`` offers for capture. The head shares the DLRM's
    ``inter_arch``/``over_arch``; it is kept out of the module tree, so parameters and
    checkpoint keys are the DLRM's own.

    ``precision`` (``train.precision``): the dense arch and the head's interaction and
    over arch run under :func:`~recpipe.models.precision.precision_context` (autocast
    for bf16); the logits are cast to float32 before the loss, which is computed
    outside autocast. In fp32 that cast returns the same tensor.
    """

    def __init__(self, dlrm: nn.Module, precision: str = "fp32") -> None:
        super().__init__()
        self.model = dlrm
        self._numerics = Numerics(precision)
        object.__setattr__(self, "head", DenseHead(dlrm.inter_arch, dlrm.over_arch, self))  # not a registered child

    @property
    def precision(self) -> str:
        return self._numerics.precision

    def extra_repr(self) -> str:
        return f"precision={self.precision!r}"

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        with precision_context(self):
            dense = self.model.dense_arch(batch.dense_features)
        sparse = sparse_arch_forward(self.model.sparse_arch, batch.sparse_features)  # [B, F, D], fp32
        # .forward, not a module call: the head is not in the module tree, and TorchRec's
        # FX tracer only follows calls of registered modules (CUDA graphs replace .forward).
        loss, logits = self.head.forward(dense, sparse, batch.labels, batch.weights)
        return loss, (loss.detach(), logits.detach(), batch.labels, batch.weights)

    def cuda_graph_modules(self) -> dict[str, nn.Module]:
        return {"dense_arch": self.model.dense_arch, "head": self.head}


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
