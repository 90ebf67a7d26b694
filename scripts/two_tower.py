"""Example: a two-tower retrieval model with its own batch type, trained by recpipe.

Everything recpipe has never seen is here: the batch (user and item KeyedJaggedTensors
in a dict, the user's recent items as a sequence in another field), the model (two
EmbeddingBagCollections and an EmbeddingCollection, a dot product of the towers) and
the data. recpipe shards it from YAML, pipelines it with the pipeline the YAML names,
checkpoints and logs it. Two ways to run it, from the repository root:

    recpipe train --config configs/two_tower.yaml          # model.factory / data.factory
    .venv/bin/python scripts/two_tower.py --config configs/two_tower.yaml   # with TwoTowerPipeline

The second trains with ``TwoTowerPipeline``, the configured ``sparse_dist`` extended
through its hooks: it counts the positives it trains on and clips the dense gradients;
recpipe's trainer runs it (evaluation, checkpoints, TensorBoard, ...), as
``recpipe train --set pipeline.class=scripts.two_tower:TwoTowerPipeline`` does. Copy this
file to start your own model: ``build_model(cfg)`` and ``make_batches(cfg, *, rank, ...)``
are what ``model.factory`` and ``data.factory`` name, and ``model.options`` /
``data.options`` are where they read their settings.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import sys
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from recpipe.pipelines import SparseDistPipeline
from recpipe.runtime.steps import dense_params

USER_FEATURES = ("user_id", "user_country")
ITEM_FEATURES = ("item_id", "item_category")
HISTORY = "history"  # the user's recently clicked items, in order (a sequence)


@dataclass
class TwoTowerBatch(Pipelineable):
    features: dict[str, KeyedJaggedTensor]  # "user": USER_FEATURES, "item": ITEM_FEATURES (one id each)
    history: KeyedJaggedTensor  # HISTORY: 1..max_history item ids per sample
    labels: torch.Tensor  # float32 [B]: 1 = the user clicked the item

    def to(self, device: torch.device, non_blocking: bool = False) -> "TwoTowerBatch":
        return TwoTowerBatch(
            features={k: v.to(device=device, non_blocking=non_blocking) for k, v in self.features.items()},
            history=self.history.to(device=device, non_blocking=non_blocking),
            labels=self.labels.to(device=device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        for kjt in self.features.values():
            kjt.record_stream(stream)
        self.history.record_stream(stream)
        self.labels.record_stream(stream)

    def pin_memory(self) -> "TwoTowerBatch":
        return TwoTowerBatch({k: v.pin_memory() for k, v in self.features.items()}, self.history.pin_memory(),
                             self.labels.pin_memory())


def _mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])  # no activation after the last layer


class TwoTower(nn.Module):
    """``model(batch) -> (loss, (loss, logits, labels))``: the contract recpipe's (and
    TorchRec's) pipelines train, with the output layout recpipe's metrics read."""

    def __init__(self, rows: dict[str, int], dim: int, tower: list[int], max_history: int, device: torch.device) -> None:
        super().__init__()
        self.max_history = max_history
        bag = lambda f: EmbeddingBagConfig(name=f, embedding_dim=dim, num_embeddings=rows[f], feature_names=[f])  # noqa: E731
        self.user_ebc = EmbeddingBagCollection(tables=[bag(f) for f in USER_FEATURES], device=device)
        self.item_ebc = EmbeddingBagCollection(tables=[bag(f) for f in ITEM_FEATURES], device=device)
        self.history_ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name="item_history", embedding_dim=dim, num_embeddings=rows["item_id"],
                                    feature_names=[HISTORY])],
            device=device,
        )
        self.user_tower = _mlp([dim * (len(USER_FEATURES) + 1), *tower])
        self.item_tower = _mlp([dim * len(ITEM_FEATURES), *tower])

    def forward(self, batch: TwoTowerBatch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        user = self.user_ebc(batch.features["user"]).values()
        item = self.item_ebc(batch.features["item"]).values()
        seq: JaggedTensor = self.history_ec(batch.history)[HISTORY]
        history = _mean_over_sequence(seq, self.max_history)
        u = self.user_tower(torch.cat([user, history], dim=1))
        v = self.item_tower(item)
        logits = (u * v).sum(dim=1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


def _mean_over_sequence(seq: JaggedTensor, max_length: int) -> torch.Tensor:
    """Mean of each sample's sequence embeddings: [sum ids, D] -> [B, D]. Padded to
    ``max_length`` rather than summed with index_add, whose atomic adds make CUDA
    results differ from run to run."""
    padded = seq.to_padded_dense(desired_length=max_length)  # [B, max_length, D], zeros past each length
    return padded.sum(dim=1) / seq.lengths().clamp(min=1).unsqueeze(1).to(padded.dtype)


def build_model(cfg: Any) -> TwoTower:
    """``model.factory``: embedding tables on meta (recpipe shards them), dense on CPU."""
    o = cfg.model.options
    rows = {"user_id": o.get("num_users", 1000), "user_country": 50,
            "item_id": o.get("num_items", 2000), "item_category": o.get("num_categories", 20)}
    return TwoTower(rows, dim=o.get("embedding_dim", 16), tower=list(o.get("tower", [32, 16])),
                    max_history=cfg.data.options.get("max_history", 5), device=torch.device("meta"))


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") & (2**63 - 1)


def make_batch(cfg: Any, *, rank: int, split: str, epoch: int, index: int) -> TwoTowerBatch:
    """One batch, a pure function of its coordinates (so resume is exact). Planted
    rule: a user likes the category ``user_id % num_categories``; the label is a
    noisy "item in the liked category", and the history holds liked items."""
    o = cfg.model.options
    users, items, cats = o.get("num_users", 1000), o.get("num_items", 2000), o.get("num_categories", 20)
    B, max_hist = cfg.data.batch_size, cfg.data.options.get("max_history", 5)
    g = torch.Generator().manual_seed(_seed(cfg.train.seed, rank, split, 0 if split == "eval" else epoch, index))
    user = torch.randint(0, users, (B,), generator=g)
    item = torch.randint(0, items, (B,), generator=g)
    liked = item % cats == user % cats
    labels = torch.where(torch.rand(B, generator=g) < 0.9, liked.float(), 1.0 - liked.float())
    hist_len = torch.randint(1, max_hist + 1, (B,), generator=g)
    hist = torch.randint(0, items // cats, (int(hist_len.sum()),), generator=g) * cats
    hist += torch.repeat_interleave(user % cats, hist_len)  # items of the liked category
    one = torch.ones(2 * B, dtype=torch.int32)
    return TwoTowerBatch(
        features={
            "user": KeyedJaggedTensor(keys=list(USER_FEATURES), values=torch.cat([user, user % 50]), lengths=one),
            "item": KeyedJaggedTensor(keys=list(ITEM_FEATURES), values=torch.cat([item, item % cats]), lengths=one),
        },
        history=KeyedJaggedTensor(keys=[HISTORY], values=hist, lengths=hist_len.int()),
        labels=labels,
    )


def make_batches(cfg: Any, *, rank: int, world_size: int, split: str, epoch: int, start_batch: int) -> Iterator[TwoTowerBatch]:
    """``data.factory``: batches ``start_batch ..`` of this rank's split."""
    count = cfg.data.options.get("num_batches" if split == "train" else "num_eval_batches", 200 if split == "train" else 8)
    for index in range(start_batch, count):
        yield make_batch(cfg, rank=rank, split=split, epoch=epoch, index=index)


# ------------------------------------------------------------------ the script's pipeline
class TwoTowerPipeline(SparseDistPipeline):
    """``sparse_dist`` with the two-tower model's hooks: counts the positive labels it trains
    on and clips the dense gradients; rank 0 reports every ``report_every`` steps."""

    max_grad_norm = 1.0
    report_every = 20

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.positives: list[torch.Tensor] = []
        self.steps = 0

    def before_forward(self, batch: TwoTowerBatch) -> None:
        self.positives.append(batch.labels.sum())  # a device tensor: no host sync per step

    def after_backward(self, batch: TwoTowerBatch, loss: torch.Tensor) -> None:
        torch.nn.utils.clip_grad_norm_(dense_params(self.context.optimizer), self.max_grad_norm)

    def after_optimizer_step(self, batch: TwoTowerBatch) -> None:
        self.steps += 1
        if self.steps % self.report_every == 0 and dist.get_rank() == 0:
            if self.steps == self.report_every:
                print(self.describe(), flush=True)
            positives = int(torch.stack(self.positives).sum())  # host sync, once a report
            print(f"TwoTowerPipeline: {self.steps} steps, {positives} positive labels on rank 0", flush=True)


def main() -> int:
    from recpipe.config import load_config
    from recpipe.train import train

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    return train(load_config(args.config, args.overrides), pipeline_class=TwoTowerPipeline)


if __name__ == "__main__":  # the ranks import this module by name: only the script runs main()
    sys.exit(main())
