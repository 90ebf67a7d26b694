"""A sharded EmbeddingBagCollection's pooled output without torchrec's concatenation.

A sharded EBC runs one lookup per sharding group (table-wise tables, row-wise tables,
HBM and UVM-cached kernels, ...). torchrec's ``EmbeddingBagCollectionAwaitable``
concatenates the groups' outputs into one ``[B, sum D]`` KeyedTensor
(``construct_output_kt``), in the groups' key order, not the module's. A model then
takes what it needs by key: ``to_dict()`` (torchrec's ``SparseArch`` and recpipe's DLRM
with such keys) or ``kt[key]``, and concatenates it again in its own order. That is two
copies of the pooled output in the forward and two in the backward (the gradient of
``to_dict`` is concatenated, then cut back into the groups' strided slices, which the
TBE backward copies to make contiguous).

:class:`GroupedKeyedTensor` is the same KeyedTensor (same keys in the same order, same
values) kept as the groups' tensors: ``to_dict()`` and ``kt[key]`` are views of them, so
the model's own concatenation is the only copy, and in the backward each group's
gradient is made contiguous once, by autograd's ``split`` backward. ``values()`` (and
anything else that needs the one tensor) concatenates on first use, exactly as torchrec
did, and from then on it is a plain KeyedTensor. Same numbers either way: only copies
move (GPU and CPU tests: every pipeline trains bit-identically to the plain loop).

With two groups whose keys are not in the DLRM's order the grouped form steps faster
than the concatenated one and than TorchRec's pipeline
(benchmarks/results/h100x1/pooled_output.md), so recpipe's pipelines always hand the
model this grouped form.
Where the groups' keys already are in the model's order, recpipe's DLRM reads ``values()``
and nothing changes. A module with one sharding type is torchrec's KeyedTensor as it was;
on one GPU row_wise tables are placed table_wise, so HBM and UVM-cached tables there are one
group, concatenated inside torchrec's lookup (its ``GroupedPooledEmbeddingsLookup``), which
this module does not reach.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionAwaitable
from torchrec.sparse.jagged_tensor import KeyedTensor

from recpipe.compat.torchrec import ebc_awaitable_parts, keyed_tensor_key_index, replace_wait


class GroupedKeyedTensor(KeyedTensor):
    """A 2-D KeyedTensor (key_dim 1) stored as consecutive column groups, concatenated on demand."""

    def __init__(self, keys: list[str], length_per_key: list[int], groups: list[torch.Tensor],
                 keys_per_group: list[int]) -> None:
        self._groups: Optional[list[torch.Tensor]] = groups
        self._keys_per_group = keys_per_group
        self._cat: Optional[torch.Tensor] = None
        super().__init__(keys=keys, length_per_key=length_per_key, values=None, key_dim=1)

    # torchrec's methods read ``self._values``: the one tensor, made on first use
    @property
    def _values(self) -> torch.Tensor:
        if self._cat is None and self._groups is not None:
            self._cat = torch.cat(self._groups, dim=1)
            self._groups = None
        return self._cat

    @_values.setter
    def _values(self, values: Optional[torch.Tensor]) -> None:
        self._cat = values

    def grouped(self) -> bool:
        """Still the groups' tensors (no concatenation yet)."""
        return self._groups is not None

    def groups(self) -> list[torch.Tensor]:
        assert self._groups is not None, "concatenated already"
        return list(self._groups)

    def keys_per_group(self) -> list[int]:
        return list(self._keys_per_group)

    def to_dict(self) -> dict[str, torch.Tensor]:
        if self._groups is None:
            return super().to_dict()
        out: dict[str, torch.Tensor] = {}
        first = 0
        for group, n in zip(self._groups, self._keys_per_group):
            keys, lengths = self.keys()[first:first + n], self.length_per_key()[first:first + n]
            out.update(zip(keys, group.split(lengths, dim=1)))
            first += n
        return out

    def __getitem__(self, key: str) -> torch.Tensor:
        if self._groups is None:
            return super().__getitem__(key)
        index = keyed_tensor_key_index(self)[key]
        first = 0
        for group, n in zip(self._groups, self._keys_per_group):
            if index < first + n:
                start = sum(self.length_per_key()[first:index])
                return group.narrow(1, start, self.length_per_key()[index])
            first += n
        raise KeyError(key)  # pragma: no cover - _key_indices() already raised

    def device(self) -> torch.device:
        return self._groups[0].device if self._groups is not None else super().device()

    def size_in_bytes(self) -> int:
        if self._groups is None:
            return super().size_in_bytes()
        return sum(g.element_size() * g.numel() for g in self._groups)

    def record_stream(self, stream: torch.cuda.streams.Stream) -> None:
        for t in self._groups if self._groups is not None else [self._cat]:
            t.record_stream(stream)


def _keys_per_group(embeddings: list[torch.Tensor], dims: list[int]) -> Optional[list[int]]:
    """How many of the keys (in order, ``dims`` wide each) each 2-D tensor holds; None when
    the tensors are not consecutive column groups of exactly those keys."""
    per_group, first = [], 0
    for t in embeddings:
        width, n = t.size(1) if t.dim() == 2 else -1, 0
        while width > 0 and first + n < len(dims):
            width -= dims[first + n]
            n += 1
        if width != 0:
            return None
        per_group.append(n)
        first += n
    return per_group if first == len(dims) else None


def _wait_grouped(self: EmbeddingBagCollectionAwaitable) -> KeyedTensor:
    """torchrec's ``EmbeddingBagCollectionAwaitable._wait_impl`` (1.6.1 to 1.8.0), with
    :class:`GroupedKeyedTensor` for its ``construct_output_kt`` (without torchrec's
    profiler annotations of each group's wait)."""
    parts = ebc_awaitable_parts(self)
    embeddings = [w.wait() for w in parts.awaitables]
    for awaitable in parts.resize_awaitables:  # torchrec frees memory and resizes here
        awaitable.wait()
    names, dims = parts.names, parts.dims
    per_group = _keys_per_group(embeddings, dims)
    if per_group is None:  # torchrec's own concatenation
        return KeyedTensor(keys=names, length_per_key=dims, values=torch.cat(embeddings, dim=1), key_dim=1)
    return GroupedKeyedTensor(names, dims, embeddings, per_group)


def grouped(result: Any) -> Any:
    """``compute_and_output_dist``'s result, with its wait giving a :class:`GroupedKeyedTensor`
    when torchrec would concatenate several groups; anything else unchanged."""
    if type(result) is EmbeddingBagCollectionAwaitable and len(ebc_awaitable_parts(result).awaitables) > 1:
        replace_wait(result, _wait_grouped)
    return result
