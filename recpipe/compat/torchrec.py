"""torchrec's private names recpipe reads, and its methods recpipe replaces (see
:mod:`recpipe.compat`).

Checked against torchrec 1.8.0 from its source (``torchrec/distributed/dist_data.py``,
``embeddingbag.py``, ``embedding.py``, ``embedding_sharding.py``, ``sharding/*``,
``sparse/jagged_tensor.py``, ``planner/storage_reservations.py``); torchrec 1.6.1: to be
checked on the GPU machine (tests/test_compat.py runs there too).
"""

from __future__ import annotations

import contextlib
import itertools
import types
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch import nn


class AllToAllLayout(NamedTuple):
    pg: Any  # the process group
    splits: list[int]  # features per rank
    stagger: int


def all_to_all_layout(kjt_dist: Any) -> AllToAllLayout:
    """The process group, features per rank and stagger of a ``KJTAllToAll``.

    The splits-only and fixed-splits forwards (runtime/sharded.py, speedups/fixed_splits.py)
    stand in for its forward and need what its constructor was given; torchrec keeps them
    as ``_pg``, ``_splits``, ``_stagger`` with no public accessor."""
    return AllToAllLayout(kjt_dist._pg, kjt_dist._splits, kjt_dist._stagger)


def input_dist_all_to_alls(module: nn.Module) -> list[Any] | None:
    """The ``KJTAllToAll`` of each input dist of a sharded module (whatever each input dist
    holds as ``_dist``: the caller keeps the all-to-alls); None while its input dists are not
    made yet (torchrec makes them on the first ``input_dist`` call:
    ``_has_uninitialized_input_dist``). No public API lists them."""
    if getattr(module, "_has_uninitialized_input_dist", False):
        return None
    return [getattr(input_dist, "_dist", None) for input_dist in getattr(module, "_input_dists", [])]


def sharding_groups(module: nn.Module) -> list[tuple[str, Any]]:
    """(sharding type, torchrec's sharding object) of each sharding group of a sharded module:
    ShardedEmbeddingBagCollection lists them (``_sharding_types``, ``_embedding_shardings``),
    ShardedEmbeddingCollection maps them (``_sharding_type_to_sharding``)."""
    if hasattr(module, "_embedding_shardings"):
        return list(zip(module._sharding_types, module._embedding_shardings))
    return list(getattr(module, "_sharding_type_to_sharding", {}).items())


def has_feature_processor(module: nn.Module) -> bool:
    """Whether a sharded module runs a feature processor (position weights): the sharded
    feature-processed collections keep it as ``_feature_processor``."""
    return "FeatureProcessed" in type(module).__name__ or hasattr(module, "_feature_processor")


def feature_hash_sizes(sharding: Any) -> list[int]:
    """Rows of each feature's table in a row-wise sharding (``_get_feature_hash_sizes``), for
    the fixed splits' row buckets; no public accessor."""
    return sharding._get_feature_hash_sizes()


def lookups(module: nn.Module) -> list[nn.Module] | None:
    """The lookup modules (FBGEMM's TBE wrappers) of a sharded module, ``_lookups``; None
    when it has none that are modules. semi_sync hooks their outputs."""
    found = getattr(module, "_lookups", None)
    if isinstance(found, (list, nn.ModuleList)) and found and all(isinstance(lk, nn.Module) for lk in found):
        return list(found)
    return None


def set_length_per_key(kjt: Any, lengths: list[int]) -> None:
    """Give a KeyedJaggedTensor its ids per key on the host (``_length_per_key`` and
    ``_offset_per_key``), which torchrec otherwise computes with a device-to-host copy on
    first use; a captured step graph cannot make that copy. The constructor takes them, but
    the KJTs here are made inside torchrec's all-to-all and bucketize."""
    kjt._length_per_key = lengths
    kjt._offset_per_key = [0, *itertools.accumulate(lengths)]


def keyed_tensor_key_index(kt: Any) -> dict[str, int]:
    """A KeyedTensor's key -> position map (``_key_indices()``, cached by torchrec)."""
    return kt._key_indices()


def init_fused_splits(awaitable: Any, contexts: list[Any], awaitables: list[Any], output_lengths: list[int],
                      lengths: list[int], splits_awaitable: Any) -> None:
    """Fill a ``FusedKJTListSplitsAwaitable`` subclass the way torchrec's constructor does, so
    that its ``_wait_impl`` runs on them, without that constructor's launch (runtime/sharded.py
    :class:`FusedSplits`): the fields its wait reads."""
    awaitable._contexts = contexts
    awaitable._awaitables = awaitables
    awaitable._output_lengths = output_lengths
    awaitable._lengths = lengths
    awaitable._splits_awaitable = splits_awaitable


class EbcAwaitableParts(NamedTuple):
    awaitables: list[Any]  # one per sharding group: its pooled embeddings
    resize_awaitables: list[Any]  # torchrec frees memory and resizes while waiting on these
    names: list[str]
    dims: list[int]


def ebc_awaitable_parts(awaitable: Any) -> EbcAwaitableParts:
    """What ``EmbeddingBagCollectionAwaitable._wait_impl`` reads, for a wait of recpipe's own
    (runtime/pooled.py keeps the groups apart instead of concatenating them)."""
    return EbcAwaitableParts(list(awaitable._awaitables), list(awaitable._resize_awaitables or ()),
                             list(awaitable._embedding_names), list(awaitable._embedding_dims))


def replace_wait(awaitable: Any, wait: Callable[[Any], Any]) -> None:
    """Make ``wait(awaitable)`` the result of ``awaitable.wait()``: torchrec's ``Awaitable.wait``
    calls ``_wait_impl`` and then the callbacks, so this replaces ``_wait_impl`` on the
    instance only."""
    awaitable._wait_impl = types.MethodType(wait, awaitable)


def recat_function() -> Callable[..., Any]:
    """torchrec's ``dist_data._get_recat(local_split, num_splits, stagger, device,
    batch_size_per_rank)``: the recat indices of a KJT all-to-all."""
    from torchrec.distributed import dist_data

    return dist_data._get_recat


@contextlib.contextmanager
def recat_replaced(fn: Callable[..., Any]) -> Iterator[None]:
    """``dist_data._get_recat`` is ``fn`` inside the block (speedups/recat_cache.py: the recat
    indices made once per layout); ``KJTAllToAllTensorsAwaitable`` looks it up by module name
    at each call."""
    from torchrec.distributed import dist_data

    original = dist_data._get_recat
    dist_data._get_recat = fn
    try:
        yield
    finally:
        dist_data._get_recat = original


def reserved_hbm(reservation: Any) -> tuple[int, int]:
    """(dense, KJT) HBM per rank that a ``HeuristicalStorageReservation`` set aside in its
    ``reserve`` (``_dense_storage``, ``_kjt_storage``); 0 for one it did not."""
    dense = reservation._dense_storage.hbm if reservation._dense_storage else 0
    kjt = reservation._kjt_storage.hbm if reservation._kjt_storage else 0
    return dense, kjt


def name_reservation_share(reservation: Any, share: float) -> None:
    """Give a storage reservation of recpipe's the ``_percentage`` that torchrec's planner
    reads from whatever reservation it was given when no placement fits: the message of its
    ``PlannerError`` names it (``EmbeddingShardingPlanner.plan``, torchrec 1.6.1 and 1.8), and
    without it that error is an ``AttributeError``. recpipe's reservations are bytes, not a
    share of the HBM: ``share`` 0.0."""
    reservation._percentage = share


def module_children(module: nn.Module) -> list[nn.Module]:
    """A module's registered children, with the ``None`` slots left out (``_modules``; the
    walk of runtime/sharded.py ``all_modules`` also reads plain lists torchrec keeps)."""
    return [m for m in module._modules.values() if m is not None]


def wrapped_optimizer(optimizer: Any) -> Any:
    """The optimizer inside torchrec's ``OptimizerWrapper`` or ``KeyedOptimizerWrapper``
    (``_optimizer``): speedups/optimizer_graph.py captures the ``torch.optim`` step itself.
    The wrappers keep it with no public accessor."""
    return optimizer._optimizer


def sharded_parameter_names(module: nn.Module) -> list[str]:
    """The names of ``module``'s parameters that sharded modules own (its embedding tables):
    what torchrec's DDP wrapper leaves out of data parallelism. A static method of
    ``DistributedModelParallel`` (``_sharded_parameter_names``)."""
    from torchrec.distributed import DistributedModelParallel

    return list(DistributedModelParallel._sharded_parameter_names(module))


def pipelined_modules(pipe: Any) -> list[Any] | None:
    """The sharded modules a torchrec ``TrainPipelineSparseDist`` rewrote to start their
    input dists a batch ahead (``_pipelined_modules``, set by its FX trace of the first
    batch); None for a pipeline that rewrites none."""
    return getattr(pipe, "_pipelined_modules", None)


def kjt_fields(kjt: Any, names: tuple[str, ...]) -> list[Any]:
    """The KeyedJaggedTensor's fields named after its constructor's arguments, as it keeps
    them (``_values``, ``_lengths``, ``_offsets``, ``_stride_per_key_per_rank``, ...: None
    for those not computed yet), to rebuild it without computing any (data/flat.py). The
    public accessors compute the missing ones."""
    return [getattr(kjt, "_" + name) for name in names]


def metric_computations(metric: Any) -> list[Any]:
    """The per-task computations (``RecMetricComputation`` modules) of a torchrec ``RecMetric``
    (``_metrics_computations``), whose update train/metrics.py adapts; no public accessor."""
    return list(metric._metrics_computations)
