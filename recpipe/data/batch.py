"""The batch that flows through every pipeline.

``Batch`` implements torchrec's ``Pipelineable`` (``to``, ``record_stream``) plus
``pin_memory``, so TorchRec's own pipelines accept it too (the benchmarks run both
on the same batches). Legend: B = samples in the batch, F = sparse features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable


@dataclass
class Batch(Pipelineable):
    dense_features: torch.Tensor  # float32 [B, num_dense]
    sparse_features: KeyedJaggedTensor  # F keys, B samples each
    labels: torch.Tensor  # float32 [B]
    # Per-sample loss weight: 1 for real samples, 0 for padding batches that a rank
    # feeds after its own data ran out while other ranks still train (uneven data).
    weights: torch.Tensor  # float32 [B]

    @property
    def batch_size(self) -> int:
        return int(self.labels.shape[0])

    @property
    def is_padding(self) -> bool:
        """Host-side check; only call on CPU batches (it syncs on a GPU tensor)."""
        return not bool(self.weights.any())

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return Batch(
            dense_features=self.dense_features.to(device=device, non_blocking=non_blocking),
            sparse_features=self.sparse_features.to(device=device, non_blocking=non_blocking),
            labels=self.labels.to(device=device, non_blocking=non_blocking),
            weights=self.weights.to(device=device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.dense_features.record_stream(stream)
        self.sparse_features.record_stream(stream)
        self.labels.record_stream(stream)
        self.weights.record_stream(stream)

    def pin_memory(self) -> "Batch":
        return Batch(
            dense_features=self.dense_features.pin_memory(),
            sparse_features=self.sparse_features.pin_memory(),
            labels=self.labels.pin_memory(),
            weights=self.weights.pin_memory(),
        )

    def as_padding(self) -> "Batch":
        """The same shapes with every loss weight zero: trains nothing, keeps collectives aligned."""
        return Batch(self.dense_features, self.sparse_features, self.labels, torch.zeros_like(self.weights))
