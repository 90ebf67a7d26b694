"""User models for ``recpipe export --format program`` (``model.factory``): a two-tower
ranker whose serving forward differs from the built-in model's, one torch.export cannot
trace (Python control flow on the values of a tensor), and one without a serving forward."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

USER = ["user_id", "user_country"]
ITEM = ["item_id", "item_category"]
ROWS = {"user_id": 1000, "user_country": 50, "item_id": 3000, "item_category": 20}
DIM = 8


def _ebc(features: list[str], device: torch.device) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=ROWS[f],
                                                             feature_names=[f]) for f in features], device=device)


class TwoTowerRanker(nn.Module):
    """Training: ``model(batch) -> (loss, (loss, logits, labels))``; serving:
    ``serve(user_values, user_lengths, item_values, item_lengths, item_dense) -> probability``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.user_ebc = _ebc(USER, device)
        self.item_ebc = _ebc(ITEM, device)
        self.user_tower = nn.Sequential(nn.Linear(2 * DIM, 16), nn.ReLU(), nn.Linear(16, 8))
        self.item_tower = nn.Sequential(nn.Linear(2 * DIM + 3, 16), nn.ReLU(), nn.Linear(16, 8))

    def logits(self, user: KeyedJaggedTensor, item: KeyedJaggedTensor, item_dense: torch.Tensor) -> torch.Tensor:
        u = self.user_tower(self.user_ebc(user).values())
        v = self.item_tower(torch.cat([self.item_ebc(item).values(), item_dense], dim=1))
        return (u * v).sum(dim=1)

    def forward(self, batch: dict[str, Any]):
        logits = self.logits(batch["user"], batch["item"], batch["item_dense"])
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch["labels"])
        return loss, (loss.detach(), logits.detach(), batch["labels"])

    def serve(self, user_values: torch.Tensor, user_lengths: torch.Tensor, item_values: torch.Tensor,
              item_lengths: torch.Tensor, item_dense: torch.Tensor) -> torch.Tensor:
        user = KeyedJaggedTensor(keys=USER, values=user_values, lengths=user_lengths)
        item = KeyedJaggedTensor(keys=ITEM, values=item_values, lengths=item_lengths)
        return torch.sigmoid(self.logits(user, item, item_dense))

    def serving_inputs(self, batch_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        out = {}
        for side, features in (("user", USER), ("item", ITEM)):
            lengths = torch.randint(1, 3, (len(features) * batch_size,), generator=g, dtype=torch.int32)
            per_feature = lengths.view(len(features), batch_size).sum(1).tolist()
            out[f"{side}_values"] = torch.cat([torch.randint(0, ROWS[f], (n,), generator=g)
                                               for f, n in zip(features, per_feature)])
            out[f"{side}_lengths"] = lengths
        out["item_dense"] = torch.randn(batch_size, 3, generator=g)
        return out


class Gate(nn.Module):
    """ReLU, or nothing when no value is positive: a Python branch on a tensor's value."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.max() > 0:
            return torch.relu(x)
        return x


class BranchyRanker(TwoTowerRanker):
    """Its item tower branches in Python on its input's values: torch.export cannot trace it."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.item_tower = nn.Sequential(nn.Linear(2 * DIM + 3, 16), Gate(), nn.Linear(16, 8))


def build_two_tower(cfg: Any) -> TwoTowerRanker:
    return TwoTowerRanker(torch.device("meta"))


def build_branchy(cfg: Any) -> BranchyRanker:
    return BranchyRanker(torch.device("meta"))


class TrainOnly(nn.Module):
    """Trains (``forward(batch)``) but says nothing of how to serve it."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.ebc = _ebc(USER, device)


def build_without_serve(cfg: Any) -> TrainOnly:
    return TrainOnly(torch.device("meta"))
