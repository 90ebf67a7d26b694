"""Columns -> :class:`Batch`: the one place where the TSV reader and the binary
loader turn labels, dense counts and hashed ids into tensors, so both give the same
batches bit for bit.

Legend: B = samples, D = dense features, F = sparse features, h_f = ids per sample
of feature f (its hotness; 1 for Criteo).

* dense: ``float32(log1p(float64(count)))`` by numpy on a C-contiguous [B, D]
  float64 array (``log1p=False``: the values as they are, for data whose dense
  features are already the model's float32 input, as TorchRec's ``.npy`` files). numpy's SIMD loops treat every element alike (no vector body /
  scalar tail split as in torch's), so a value's result does not depend on where it
  sits in the batch or on the number of threads.
* ids: the KJT is feature-major: feature f's ``B * h_f`` ids (sample by sample),
  then feature f+1's; every length is ``h_f``.
* Padding samples (past the end of the data) have label 0, count 0, id 0, weight 0.

With ``pin=True`` the tensors are allocated in pinned memory and numpy writes into
them directly (no second copy for the host-to-device transfer).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.data.batch import Batch

__all__ = ["ColumnLayout", "dense_from_counts"]


def dense_from_counts(counts: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 ``log1p`` of non-negative integer counts [B, D] (see the module docstring)."""
    x = np.ascontiguousarray(counts, dtype=np.float64)  # a fresh C-contiguous array
    np.log1p(x, out=x)
    if out is None:
        return x.astype(np.float32)
    np.copyto(out, x, casting="same_kind")
    return out


class ColumnLayout:
    """Builds batches of one layout: feature names, hotness per feature, dense width."""

    def __init__(self, keys: Sequence[str], hotness: Sequence[int], num_dense: int) -> None:
        assert len(keys) == len(hotness), (keys, hotness)
        self.keys = list(keys)
        self.hotness = [int(h) for h in hotness]
        self.num_dense = num_dense
        self.ids_per_sample = sum(self.hotness)

    @staticmethod
    def _empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool,
               empty: Callable[..., torch.Tensor] | None) -> tuple[torch.Tensor, np.ndarray]:
        t = torch.empty(shape, dtype=dtype, pin_memory=pin) if empty is None else empty(shape, dtype)
        return t, t.numpy()

    def build(
        self,
        labels: np.ndarray,
        counts: np.ndarray,
        ids: Sequence[np.ndarray] | np.ndarray,
        num_real: int,
        batch_size: int,
        pin: bool = False,
        log1p: bool = True,
        empty: Callable[..., torch.Tensor] | None = None,
    ) -> Batch:
        """``labels`` [n], ``counts`` [n, D], ``ids[f]`` [n, h_f] for the first ``n = num_real``
        samples (or, where every feature has one id, ``ids`` one [n, F] array); samples
        ``n .. batch_size-1`` are padding. ``log1p=False``: ``counts`` are the dense
        features themselves (copied to float32). ``empty(shape, dtype)``: where the tensors
        are allocated (default ``torch.empty``, pinned with ``pin``)."""
        n, B = num_real, batch_size
        assert 0 <= n <= B
        assert (ids.shape[1] == len(self.hotness) and self.ids_per_sample == len(self.hotness)
                if isinstance(ids, np.ndarray) else len(ids) == len(self.hotness))
        labels_t, labels_np = self._empty((B,), torch.float32, pin, empty)
        labels_np[:n] = labels[:n]
        labels_np[n:] = 0
        weights_t, weights_np = self._empty((B,), torch.float32, pin, empty)
        weights_np[:n] = 1
        weights_np[n:] = 0
        dense_t, dense_np = self._empty((B, self.num_dense), torch.float32, pin, empty)
        if n and log1p:
            dense_from_counts(counts[:n], out=dense_np[:n])
        elif n:
            np.copyto(dense_np[:n], counts[:n], casting="same_kind")
        dense_np[n:] = 0
        values_t, values_np = self._empty((B * self.ids_per_sample,), torch.int64, pin, empty)
        if isinstance(ids, np.ndarray):  # [n, F], one id per feature: the transpose, in one copy
            by_feature = values_np.reshape(len(self.hotness), B)
            np.copyto(by_feature[:, :n], ids[:n].T, casting="same_kind")
            by_feature[:, n:] = 0
        else:
            start = 0
            for column, h in zip(ids, self.hotness):
                block = values_np[start : start + B * h].reshape(B, h)
                np.copyto(block[:n], column[:n].reshape(n, h), casting="same_kind")
                block[n:] = 0
                start += B * h
        lengths_t, lengths_np = self._empty((len(self.hotness) * B,), torch.int32, pin, empty)
        lengths_np.reshape(len(self.hotness), B)[:] = np.asarray(self.hotness, dtype=np.int32)[:, None]
        # ids per key known from the layout: without them torchrec reads them from the
        # device in every input dist (``length_per_key()`` in ``KeyedJaggedTensor.permute``)
        kjt = KeyedJaggedTensor(keys=self.keys, values=values_t, lengths=lengths_t, stride=B,
                                length_per_key=[h * B for h in self.hotness])
        return Batch(dense_features=dense_t, sparse_features=kjt, labels=labels_t, weights=weights_t)
