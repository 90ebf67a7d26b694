"""The input all-to-all of several ranks with splits known on the host: what lets a
CUDA graph hold a sharded model's whole step (``pipeline.step_graph``).

torchrec's ``KJTAllToAll`` first exchanges each rank's ids per feature (the splits
all-to-all), then reads them on the host (``.tolist()``, a host sync) to size the id
all-to-all. A captured step can do neither. When every rank sends the same number of
ids per feature and destination (fixed or padded shapes: :mod:`recpipe.speedups.step_graph`),
what rank s sends here is what this rank sends itself, so the splits follow from the
batch's shapes (:class:`FixedSplitsForward`).

Row-wise tables (``row_wise``; ``table_row_wise`` within a host) split each feature's
ids among the ranks that hold its rows (torchrec's ``bucketize_kjt_before_all2all``:
id // block, FBGEMM's ``block_bucketize_sparse_features``), a data-dependent number per
rank. :class:`Buckets` computes the same split on the host, so the step graph pads every
rank's bucket of each feature to a capacity agreed by all ranks; while the step is
captured, :class:`FixedBuckets` gives torchrec's bucketized KeyedJaggedTensor those
counts, which its ``permute`` and the all-to-all would otherwise read from the device.

torchrec's recat index tensors, which it builds from host lists at every input dist,
are made once per splits layout (:class:`recpipe.speedups.recat_cache.RecatCache`).
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torchrec.distributed.dist_data import KJTAllToAll, KJTAllToAllTensorsAwaitable
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.compat import torchrec as compat_torchrec
from recpipe.errors import PipelineError
from recpipe.runtime import sharded

__all__ = ["Buckets", "FixedBuckets", "FixedSplitsForward", "fixed_splits_installed", "row_buckets"]


@dataclass(frozen=True)
class Buckets:
    """How torchrec's row-wise input dist splits one feature's ids among ``count`` ranks:
    ids below ``count * block`` go to bucket id // block, larger ones to id % count
    (FBGEMM's ``block_bucketize_sparse_features``); ``rows``: the table's rows."""

    count: int
    block: int
    rows: int

    @classmethod
    def of_table(cls, rows: int, count: int) -> "Buckets":
        return cls(count, math.ceil(rows / count), rows)

    def of(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.where(ids < self.block * self.count, ids // self.block, ids % self.count)

    def counts(self, ids: torch.Tensor) -> list[int]:
        """Ids per bucket."""
        return torch.bincount(self.of(ids), minlength=self.count).tolist()

    def first_row(self, bucket: int) -> int | None:
        """A row of ``bucket`` (its first), or None if the table has no row there."""
        row = bucket * self.block
        return row if row < self.rows else None


# torchrec's sharding types whose input dist bucketizes ids by row, and the group over whose
# ranks it does (row_wise: every rank of the sharding's group; table_row_wise: the host's ranks)
_ROW_SHARDINGS = {"row_wise": "_pg", "table_row_wise": "_intra_pg"}


def row_buckets(modules: dict[str, Any]) -> dict[str, Buckets]:
    """Feature name -> its :class:`Buckets`, for every feature of a row-wise table split over
    more than one rank (torchrec's sharding objects: their feature names and hash sizes)."""
    found: dict[str, Buckets] = {}
    for fqn, module in modules.items():
        for sharding_type, sharding in sharded.shardings(module):
            group = _ROW_SHARDINGS.get(sharding_type)
            if group is None:
                continue
            count = getattr(sharding, group).size()
            if count == 1:
                continue
            for name, rows in zip(sharding.feature_names(), compat_torchrec.feature_hash_sizes(sharding)):
                b = Buckets.of_table(int(rows), count)
                if found.setdefault(name, b) != b:
                    raise PipelineError(f"pipeline.step_graph: feature {name!r} feeds two row-wise tables of "
                                        f"different layouts ({found[name]} and {b}, in {fqn!r}); give them "
                                        "distinct feature names")
    return found


class FixedBuckets:
    """Stands in for torchrec's ``bucketize_kjt_before_all2all`` (in its row_wise and
    table_row_wise input dists) while a step graph captures: the bucketized
    KeyedJaggedTensor gets its ids per (bucket, feature) from ``capacity`` (feature ->
    ids per bucket, which the padding made exact), so that its ``permute`` and the
    all-to-all's splits need no host sync."""

    MODULES = ("torchrec.distributed.sharding.rw_sharding", "torchrec.distributed.sharding.twrw_sharding")

    def __init__(self, capacity: dict[str, list[int]]) -> None:
        self.capacity = capacity
        self._modules = [importlib.import_module(m) for m in self.MODULES]
        self._original = self._modules[0].bucketize_kjt_before_all2all

    def __repr__(self) -> str:
        return "FixedBuckets(ids per bucket from the padded capacity; recpipe.speedups.fixed_splits)"

    def __call__(self, kjt: KeyedJaggedTensor, num_buckets: int, *args: Any, **kwargs: Any) -> Any:
        out, unbucketize = self._original(kjt, num_buckets, *args, **kwargs)
        per_key = []
        for key in kjt.keys():
            cap = self.capacity.get(key)
            if cap is None or len(cap) != num_buckets:
                raise PipelineError(f"pipeline.step_graph: torchrec splits feature {key!r} into {num_buckets} "
                                    f"row buckets, but its padded capacity has {None if cap is None else len(cap)}")
            per_key.append(cap)
        lengths = [per_key[k][r] for r in range(num_buckets) for k in range(len(per_key))]
        compat_torchrec.set_length_per_key(out, lengths)
        return out, unbucketize

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        for module in self._modules:
            module.bucketize_kjt_before_all2all = self
        try:
            yield
        finally:
            for module in self._modules:
                module.bucketize_kjt_before_all2all = self._original


class _FixedSplits(Awaitable):
    """torchrec's splits awaitable without the splits all-to-all: every rank sends the
    same shapes, so what rank s sends here is what this rank sends itself."""

    def __init__(self, kjt_dist: KJTAllToAll, kjt: KeyedJaggedTensor) -> None:
        super().__init__()
        pg, splits, stagger = compat_torchrec.all_to_all_layout(kjt_dist)
        rank, world = dist.get_rank(pg), pg.size()
        cumsum = [0, *itertools.accumulate(splits)]
        self._args = dict(
            pg=pg, input=kjt, splits=splits, input_splits=kjt.dist_splits(splits),
            labels=kjt.dist_labels(), keys=kjt.keys()[cumsum[rank]:cumsum[rank + 1]], device=kjt.device(),
            stagger=stagger, stride_per_rank=[kjt.stride()] * world, input_tensors=kjt.dist_tensors())
        self._args["output_splits"] = [[row[rank]] * world for row in self._args["input_splits"]]

    def _wait_impl(self) -> "_FixedTensors":
        kjt, rank, world = self._args["input"], dist.get_rank(self._args["pg"]), self._args["pg"].size()
        cumsum = [0, *itertools.accumulate(self._args["splits"])]
        # what arrives of each key: what every rank sends of it, which is what this rank sends itself
        received = [world * n for n in kjt.length_per_key()[cumsum[rank]:cumsum[rank + 1]]]
        return _FixedTensors(KJTAllToAllTensorsAwaitable(**self._args), received)


class _FixedTensors(Awaitable):
    """The id all-to-all's result with its ids per key known on the host: torchrec 1.6.1's
    ``KeyedJaggedTensor.dist_init`` asks the device for them (``sync()``), later torchrec
    leaves them to be computed by the first caller (the lookup's ``split``); either is a
    device-to-host copy that a captured step cannot make."""

    def __init__(self, tensors: KJTAllToAllTensorsAwaitable, length_per_key: list[int]) -> None:
        super().__init__()
        self._tensors, self._length_per_key = tensors, length_per_key

    def _wait_impl(self) -> KeyedJaggedTensor:
        sync = KeyedJaggedTensor.sync
        KeyedJaggedTensor.sync = _no_sync
        try:
            kjt = self._tensors.wait()
        finally:
            KeyedJaggedTensor.sync = sync
        compat_torchrec.set_length_per_key(kjt, self._length_per_key)
        return kjt


def _no_sync(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    return kjt


class FixedSplitsForward:
    """Stands in for ``KJTAllToAll.forward`` while a step graph captures (several ranks):
    the id all-to-all with splits known from the shapes, no host sync."""

    def __init__(self, kjt_dist: KJTAllToAll) -> None:
        self.kjt_dist = kjt_dist

    def __repr__(self) -> str:
        return "FixedSplitsForward(splits from the batch shapes; recpipe.speedups.fixed_splits)"

    def __call__(self, kjt: KeyedJaggedTensor) -> _FixedSplits:
        if kjt.variable_stride_per_key():
            raise PipelineError("pipeline.step_graph: a KJT with variable stride per key has no fixed splits")
        return _FixedSplits(self.kjt_dist, kjt)


@contextlib.contextmanager
def fixed_splits_installed(modules: dict[str, Any], buckets: FixedBuckets | None) -> Iterator[bool]:
    """Every KJT all-to-all of several ranks in ``modules`` with fixed splits (and the
    row buckets' counts from ``buckets``) inside the block; yields whether there was one."""
    targets = [d for d in sharded.kjt_all_to_alls(modules) if compat_torchrec.all_to_all_layout(d).pg.size() > 1]
    for d in targets:
        d.forward = FixedSplitsForward(d)
    try:
        with buckets.installed() if buckets is not None else contextlib.nullcontext():
            yield bool(targets)
    finally:
        for d in targets:
            if isinstance(vars(d).get("forward"), FixedSplitsForward):
                del d.forward
