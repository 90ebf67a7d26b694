"""Models recpipe has never seen, for the sharding and planner tests: torchrec's own
``TestSparseNN`` (an ``ebc``, a ``weighted_ebc`` and, with ``feature_processor``, a
``FeatureProcessedEmbeddingBagCollection``) and a small two-tower model with two
EmbeddingBagCollections plus an EmbeddingCollection of sequence ids. Both are
``model.factory`` functions (``function(cfg) -> nn.Module``, options from
``model.options``), with batches made by ``*_batches``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.distributed.test_utils.test_model import ModelInput, TestSparseNN
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

DIM = 8
NUM_FLOAT = 10


# ------------------------------------------------------------------ unsharded references
def reference_model(build, cfg, device, seed: int = 1) -> nn.Module:
    """``build(cfg)`` materialized on ``device`` as the tests' unsharded reference: every
    parameter drawn from U(-0.1, 0.1) after ``torch.manual_seed(seed)`` (the same values
    on every rank), every buffer as the model made it. ``to_empty`` leaves parameters
    and buffers uninitialized; TestSparseNN's buffers (``dummy_ones``,
    ``dense.dummy_buffer``) enter its output, so left so they made its loss whatever the
    allocator's memory held (seen: up to 1e23, and now and then not finite). A buffer
    the model leaves on the meta device has no value to keep: an error names it."""
    model = build(cfg)
    meta = [name for name, b in model.named_buffers() if b.is_meta]
    if meta:
        raise ValueError(f"reference_model: buffers {meta} are on the meta device; build them on a real one")
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    reference = model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in reference.parameters():
            nn.init.uniform_(p, -0.1, 0.1)
        for name, b in reference.named_buffers():
            b.copy_(buffers[name])
    return reference


# ------------------------------------------------------------------ TestSparseNN
def sparse_nn_tables(options: dict) -> tuple[list[EmbeddingBagConfig], list[EmbeddingBagConfig]]:
    n, nw = options.get("num_tables", 4), options.get("num_weighted_tables", 4)
    num_fp = options.get("num_fp_tables", 0)
    tables = [EmbeddingBagConfig(num_embeddings=40 + 10 * i, embedding_dim=DIM, name=f"table_{i}",
                                 feature_names=[f"feature_{i}"]) for i in range(n + num_fp)]
    weighted = [EmbeddingBagConfig(num_embeddings=30 + 10 * i, embedding_dim=DIM, name=f"weighted_table_{i}",
                                   feature_names=[f"weighted_feature_{i}"]) for i in range(nw)]
    return tables, weighted


def sparse_nn(cfg) -> nn.Module:
    """TestSparseNN; ``model.options.num_fp_tables`` > 0 puts that many extra tables
    behind position-weighted feature processors (a FeatureProcessedEmbeddingBagCollection)."""
    options = dict(cfg.model.options)
    tables, weighted = sparse_nn_tables(options)
    num_fp = options.get("num_fp_tables", 0)
    fp_lengths = {t.name: 4 for t in tables[len(tables) - num_fp:]} if num_fp else None
    return TestSparseNN(tables=tables, weighted_tables=weighted, num_float_features=NUM_FLOAT,
                        max_feature_lengths=fp_lengths, sparse_device=torch.device("meta"))


def sparse_nn_batches(cfg, rank: int, world_size: int, n: int, batch_size: int = 8) -> list[ModelInput]:
    tables, weighted = sparse_nn_tables(dict(cfg.model.options))
    return [ModelInput.generate(batch_size, world_size, NUM_FLOAT, tables, weighted, pooling_avg=3,
                                random_seed=100 + i)[1][rank] for i in range(n)]


# ------------------------------------------------------------------ two towers
@dataclass
class TwoTowerBatch(Pipelineable):
    """User and item KJTs in a dict, the user's history (sequence ids) beside them."""

    features: dict[str, KeyedJaggedTensor]
    history: KeyedJaggedTensor
    labels: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "TwoTowerBatch":
        return TwoTowerBatch({k: v.to(device, non_blocking=non_blocking) for k, v in self.features.items()},
                             self.history.to(device, non_blocking=non_blocking),
                             self.labels.to(device, non_blocking=non_blocking))

    def record_stream(self, stream: torch.Stream) -> None:
        for kjt in (*self.features.values(), self.history):
            kjt.record_stream(stream)
        self.labels.record_stream(stream)


TOWER_TABLES = {"user": [("user_id", 50), ("user_geo", 20)], "item": [("item_id", 60), ("item_cat", 12)]}
HISTORY_TABLES = [("history_item", 60), ("history_cat", 12), ("history_shop", 30), ("history_brand", 24)]


class TwoTower(nn.Module):
    """Dot product of a user tower (user EBC + mean of the history EC) and an item
    tower (item EBC); weighted BCE like the built-in model: ``(loss, (loss, logits, labels))``."""

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        self.user = nn.ModuleDict({"ebc": EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f])
            for f, rows in TOWER_TABLES["user"]], device=device)})
        self.item_ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f])
            for f, rows in TOWER_TABLES["item"]], device=device)
        self.history = EmbeddingCollection(tables=[
            EmbeddingConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f])
            for f, rows in HISTORY_TABLES], device=device)
        width = DIM * (len(TOWER_TABLES["user"]) + len(HISTORY_TABLES))
        self.user_mlp = nn.Linear(width, DIM)
        self.item_mlp = nn.Linear(DIM * len(TOWER_TABLES["item"]), DIM)

    def forward(self, batch: TwoTowerBatch):
        user = self.user["ebc"](batch.features["user"]).values()
        pooled = []
        history = self.history(batch.history)  # feature -> JaggedTensor; the sharded module's key order differs
        for seq in (history[f] for f, _ in HISTORY_TABLES):  # mean over each sample's ids
            lengths = seq.lengths()
            index = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
            total = torch.zeros(lengths.numel(), DIM, device=lengths.device).index_add(0, index, seq.values())
            pooled.append(total / lengths.clamp(min=1).unsqueeze(1))
        u = self.user_mlp(torch.cat([user, *pooled], dim=1))
        i = self.item_mlp(self.item_ebc(batch.features["item"]).values())
        logits = (u * i).sum(dim=1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


def two_tower(cfg) -> nn.Module:
    return TwoTower(device=torch.device("meta"))


def _kjt(g: torch.Generator, spec: list[tuple[str, int]], batch_size: int, max_len: int) -> KeyedJaggedTensor:
    lengths = torch.randint(0, max_len + 1, (len(spec) * batch_size,), generator=g)
    values = torch.cat([torch.randint(0, rows, (int(lengths[i * batch_size:(i + 1) * batch_size].sum()),), generator=g)
                        for i, (_, rows) in enumerate(spec)])
    return KeyedJaggedTensor(keys=[f for f, _ in spec], values=values, lengths=lengths)


def two_tower_batches(cfg, rank: int, world_size: int, n: int, batch_size: int = 8) -> list[TwoTowerBatch]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [TwoTowerBatch({k: _kjt(g, spec, batch_size, 3) for k, spec in TOWER_TABLES.items()},
                          _kjt(g, HISTORY_TABLES, batch_size, 4),
                          torch.randint(0, 2, (batch_size,), generator=g).float()) for _ in range(n)]
