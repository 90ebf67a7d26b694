"""User models for ``recpipe export --format program`` (``model.factory``): a two-tower
ranker whose serving forward differs from the built-in model's, one torch.export cannot
trace (Python control flow on the values of a tensor), one without a serving forward, and a
sequence ranker with an EmbeddingCollection."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

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


# ------------------------------------------- a model with an EmbeddingCollection
ITEMS = 100_000  # rows of the item table: the tables (6.5 MB in fp32) outweigh the program's graph
SEQUENCE = ["history", "item_id", "item_category"]  # the user's recent items, the candidate item, its category
SEQ_DIM = 16


class SequenceRanker(nn.Module):
    """A ranker over the user's recent items, a sequence: an EmbeddingCollection (unpooled
    embeddings) whose item table serves both the history and the candidate item, and an
    EmbeddingBagCollection of the user's features. Serving:
    ``serve(user_values, user_lengths, seq_values, seq_lengths) -> probability``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.user_ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t_{f}", embedding_dim=SEQ_DIM, num_embeddings=ROWS[f], feature_names=[f])
                    for f in USER], device=device)
        self.seq_ec = EmbeddingCollection(tables=[
            EmbeddingConfig(name="t_item", embedding_dim=SEQ_DIM, num_embeddings=ITEMS, feature_names=["history", "item_id"]),
            EmbeddingConfig(name="t_category", embedding_dim=SEQ_DIM, num_embeddings=ROWS["item_category"],
                            feature_names=["item_category"]),
        ], device=device)
        self.user_tower = nn.Sequential(nn.Linear(3 * SEQ_DIM, 16), nn.ReLU(), nn.Linear(16, 8))
        self.item_tower = nn.Sequential(nn.Linear(2 * SEQ_DIM, 16), nn.ReLU(), nn.Linear(16, 8))

    def serve(self, user_values: torch.Tensor, user_lengths: torch.Tensor, seq_values: torch.Tensor,
              seq_lengths: torch.Tensor) -> torch.Tensor:
        user = self.user_ebc(KeyedJaggedTensor(keys=USER, values=user_values, lengths=user_lengths)).values()
        seq = self.seq_ec(KeyedJaggedTensor(keys=SEQUENCE, values=seq_values, lengths=seq_lengths))
        history, item, category = (_mean_per_sample(seq[f]) for f in SEQUENCE)
        u = self.user_tower(torch.cat([user, history], dim=1))
        v = self.item_tower(torch.cat([item, category], dim=1))
        return torch.sigmoid((u * v).sum(dim=1))

    def serving_inputs(self, batch_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
        """1 or 2 ids per user feature; 1 to 5 items of history, one candidate item and its category."""
        g = torch.Generator().manual_seed(seed)
        user_lengths = torch.randint(1, 3, (len(USER) * batch_size,), generator=g, dtype=torch.int32)
        per_user = user_lengths.view(len(USER), batch_size).sum(1).tolist()
        history = torch.randint(1, 6, (batch_size,), generator=g, dtype=torch.int32)
        ones = torch.ones(batch_size, dtype=torch.int32)
        seq_rows = {"history": ITEMS, "item_id": ITEMS, "item_category": ROWS["item_category"]}
        seq_lengths = torch.cat([history, ones, ones])
        per_seq = seq_lengths.view(len(SEQUENCE), batch_size).sum(1).tolist()
        return {
            "user_values": torch.cat([torch.randint(0, ROWS[f], (n,), generator=g) for f, n in zip(USER, per_user)]),
            "user_lengths": user_lengths,
            "seq_values": torch.cat([torch.randint(0, seq_rows[f], (n,), generator=g) for f, n in zip(SEQUENCE, per_seq)]),
            "seq_lengths": seq_lengths,
        }


def _mean_per_sample(seq: JaggedTensor) -> torch.Tensor:
    """Each sample's mean embedding: [ids, D] -> [B, D] (0 for a sample without ids)."""
    values, lengths = seq.values(), seq.lengths()
    sample = torch.repeat_interleave(torch.arange(lengths.numel()), lengths.long(), output_size=values.shape[0])
    sums = torch.zeros(lengths.numel(), values.shape[1], dtype=values.dtype).index_add(0, sample, values)
    return sums / lengths.clamp(min=1).unsqueeze(1).to(values.dtype)


def build_sequence_ranker(cfg: Any) -> SequenceRanker:
    return SequenceRanker(torch.device("meta"))
