"""Finding sharded modules and intercepting their forward, visibly and removably.

No FX tracing: a pipeline looks up every torchrec ``ShardedModule`` in the model and
replaces its ``forward`` (an instance attribute, so ``del`` restores the class's)
with a named :class:`PipelinedForward`. Where each module's input comes from is
learned on the pipeline's first batch (``recpipe.runtime.inputs``): there the
interceptor runs the module's own forward and looks up, by identity, the
KeyedJaggedTensor it was called with in the batch. Afterwards it hands the module
what the pipeline prepared ahead, and checks on every call that the model still
passes the object at that path; a model that rewrites its KeyedJaggedTensor before
the embedding module gets an error saying what to change instead of silently
losing the overlap (TorchRec's "will NOT be pipelined" mode).

Module names are paths in the user's model (DistributedModelParallel and DDP
wrappers unwrapped): ``sparse.ebc``, as ``inputs=`` and error messages use them.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.dist_data import KJTAllToAll, SplitsAllToAllAwaitable
from torchrec.distributed.embedding_sharding import FusedKJTListSplitsAwaitable, KJTSplitsAllToAllMeta
from torchrec.distributed.model_parallel import get_unwrapped_module
from torchrec.distributed.types import Awaitable, ShardedModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.compat import torchrec as compat_torchrec
from recpipe.errors import PipelineError
from recpipe.runtime.inputs import BatchPath, ComputedInput, find_path, kjt_difference, kjts_in

if TYPE_CHECKING:
    from recpipe.runtime.context import StepContext


def find_sharded_modules(model: nn.Module) -> dict[str, ShardedModule]:
    """Every torchrec ShardedModule in ``model`` by its path in the user's model (outermost only)."""
    found: dict[str, ShardedModule] = {}
    for fqn, module in get_unwrapped_module(model).named_modules():
        if isinstance(module, ShardedModule) and not any(fqn.startswith(f"{p}.") for p in found):
            found[fqn] = module
    if not found:
        raise PipelineError(
            "the model has no torchrec sharded module, so there is nothing to pipeline: shard it with "
            "DistributedModelParallel first (recpipe.sharding.shard_model), or use pipeline.name=base"
        )
    return found


def shardings(module: ShardedModule) -> list[tuple[str, Any]]:
    """(sharding type, torchrec's sharding object) of each sharding group of ``module``:
    the list of a ShardedEmbeddingBagCollection, the map of a ShardedEmbeddingCollection."""
    return compat_torchrec.sharding_groups(module)


def all_modules(model: nn.Module) -> list[nn.Module]:
    """Every module inside ``model``, FBGEMM's TBEs included: torchrec hides them from
    ``named_modules`` (its sharded modules keep their lookups in a plain list), so this
    walks registered children and lists of modules."""
    found, seen, todo = [], set(), [model]
    while todo:
        module = todo.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        found.append(module)
        todo.extend(compat_torchrec.module_children(module))
        for value in vars(module).values():
            if isinstance(value, (list, tuple)):
                todo.extend(v for v in value if isinstance(v, nn.Module))
    return found


def cached_tbes(model: torch.nn.Module, locked: bool = True) -> list:
    """FBGEMM TBEs with a UVM cache and cache-line locking (``locked=False``: every
    TBE with a UVM cache; the bench reads their cache statistics)."""
    marker = "lxu_cache_locking_counter" if locked else "lxu_cache_weights"
    return [m for m in all_modules(model)
            if isinstance(getattr(m, marker, None), torch.Tensor) and getattr(m, marker).numel() > 0]


def has_feature_processor(module: ShardedModule) -> bool:
    return compat_torchrec.has_feature_processor(module)


def dense_optimized_tables(modules: dict[str, ShardedModule], optimizer: Any) -> list[str]:
    """Embedding tables of sharded modules that the dense optimizer steps (data_parallel
    tables): pipelines that look up batch i+1 before optimizer(i) cannot use them.
    Feature processors' parameters (position weights) are not tables: semi_sync reads
    them one step stale like the embeddings; fused_sparse_dist refuses them itself."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [
        f"{fqn}.{name}"
        for fqn, module in modules.items()
        for name, p in module.named_parameters()
        if id(p) in stepped and "_feature_processors." not in name
    ]


def _fixes(fqn: str) -> str:
    return (
        f"Either move that transformation into the data loader, so the batch holds the KeyedJaggedTensor the module "
        f"is called with, or give the pipeline a function that computes it from the batch: "
        f"inputs={{{fqn!r}: fn}} (pipeline.inputs in YAML), which the pipeline runs ahead of forward. "
        "Or train with pipeline.name=base."
    )


class PipelinedForward:
    """Stands in for ``ShardedModule.forward`` while a pipeline is attached.

    On the pipeline's first batch (``ctx.discovering``) it runs the module's own
    forward and records where its input came from. After that, during ``progress()``
    it hands the module the input all-to-all (or the whole lookup) that the pipeline
    ran ahead for the batch being trained. Outside ``progress()`` it refuses: the
    model must be run through ``pipeline.detached()``. ``ctx``: the pipeline's
    :class:`~recpipe.runtime.context.StepContext`.
    """

    def __init__(self, fqn: str, module: ShardedModule, ctx: "StepContext") -> None:
        self.fqn = fqn
        self.module = module
        self.ctx = ctx

    def __repr__(self) -> str:
        return f"PipelinedForward({self.fqn!r}, installed by {type(self.ctx.pipeline).__name__}; removed by .detach())"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ctx = self.ctx
        batch = ctx.current
        if batch is None:
            raise PipelineError(
                f"sharded module {self.fqn!r} was called outside pipeline.progress() while the pipeline is "
                "attached; run the model under `with pipeline.detached():` (e.g. for evaluation)"
            )
        if len(args) + len(kwargs) != 1 or not isinstance(features := next(iter([*args, *kwargs.values()])), KeyedJaggedTensor):
            raise PipelineError(
                f"sharded module {self.fqn!r} was called with {len(args)} positional and {sorted(kwargs)} keyword "
                "arguments; the pipeline supports sharded modules called with one KeyedJaggedTensor"
            )
        if self.fqn in batch.consumed:
            raise PipelineError(
                f"sharded module {self.fqn!r} was called twice in one forward; the pipeline prepares one input "
                "all-to-all per module and batch. Call each sharded module once per forward."
            )
        batch.consumed.add(self.fqn)
        if ctx.discovering:
            ctx.found_sources[self.fqn] = self._discover(batch.device, features)
            return ctx.pipeline.own_forward(batch, self.fqn, self.module, features)
        source = ctx.sources[self.fqn]
        if isinstance(source, BatchPath) and features is not source.get(batch.device):
            raise PipelineError(
                f"sharded module {self.fqn!r} was called with a KeyedJaggedTensor that is not {source}, where its "
                f"input was on the first batch: the model changes where it reads it, or builds it inside forward "
                f"on some batches. {type(ctx.pipeline).__name__} starts the input all-to-all of the next batch from the "
                f"batch itself, before forward runs. " + _fixes(self.fqn)
            )
        return ctx.pipeline.sharded_forward(batch, self.fqn, self.module)

    def _discover(self, device_batch: Any, features: KeyedJaggedTensor) -> BatchPath | ComputedInput:
        """Where this call's input came from (first batch only; host sync if computed)."""
        given = self.ctx.inputs.get(self.fqn)
        if given is not None:
            problem = kjt_difference(given(device_batch), features)
            if problem is not None:
                raise PipelineError(
                    f"inputs[{self.fqn!r}] ({ComputedInput(given)}) does not compute what the model passes sharded "
                    f"module {self.fqn!r} on the first batch: {problem}"
                )
            return ComputedInput(given)
        path = find_path(device_batch, features)
        if path is None:
            found = kjts_in(device_batch)
            raise PipelineError(
                f"sharded module {self.fqn!r} was called with a KeyedJaggedTensor (keys {features.keys()}) that is "
                f"not in the batch ({type(device_batch).__name__}; KeyedJaggedTensors found: "
                f"{', '.join(found) or 'none'}): the model builds or changes it inside forward (concat, permute, "
                "feature processing, ...). The pipeline starts the input all-to-all of the next batch before forward "
                "runs, so it must get the module's input without running the model. " + _fixes(self.fqn)
            )
        return path


def install(ctx: "StepContext", modules: dict[str, ShardedModule]) -> None:
    for fqn, module in modules.items():
        if "forward" in vars(module):
            raise PipelineError(
                f"sharded module {fqn!r} already has an instance-level forward ({vars(module)['forward']!r}); "
                "is another pipeline attached to this model? Detach it first."
            )
        module.forward = PipelinedForward(fqn, module, ctx)  # type: ignore[method-assign]


def remove(modules: dict[str, ShardedModule]) -> None:
    for module in modules.values():
        if isinstance(vars(module).get("forward"), PipelinedForward):
            del module.forward


class SplitsOnlyForward:
    """Stands in for ``KJTAllToAll.forward`` while a pipeline is attached.

    It computes what the all-to-all of one KeyedJaggedTensor needs (splits, the
    tensors to send) without launching anything, so the pipeline can exchange the
    splits of every input dist of every sharded module in ONE collective per process
    group (:class:`FusedSplits`, after torchrec's ``FusedKJTListSplitsAwaitable``)
    instead of one per sharding type, each with its own host sync. Same contract as
    TorchRec's pipeline uses; built from the KeyedJaggedTensor's public ``dist_*``
    methods.
    """

    def __init__(self, kjt_dist: KJTAllToAll, host_pg: dist.ProcessGroup | None = None) -> None:
        self.pg, self.splits, self.stagger = compat_torchrec.all_to_all_layout(kjt_dist)
        self.host_pg = host_pg  # splits_exchange="host": the splits stay on the host, exchanged over it
        cumsum = [0, *itertools.accumulate(self.splits)]
        rank = dist.get_rank(self.pg)  # fixed for the group's life: looked up once, not per batch
        self._world = self.pg.size()
        self._keys = slice(cumsum[rank], cumsum[rank + 1])  # this rank's features

    def __repr__(self) -> str:
        return f"SplitsOnlyForward(splits={self.splits}; the pipeline launches one fused splits all-to-all)"

    def __call__(self, kjt: KeyedJaggedTensor) -> KJTSplitsAllToAllMeta:
        with torch.no_grad():
            device = kjt.values().device
            input_splits = kjt.dist_splits(self.splits)
            rows = list(input_splits)
            if not kjt.variable_stride_per_key():
                rows.append([kjt.stride()] * self._world)
            if self.host_pg is not None:  # nothing goes to the device: FusedSplits sends the rows
                splits_tensors: list[torch.Tensor] = []
            else:
                # One pinned host tensor and one asynchronous copy for all the splits (TorchRec
                # makes one torch.tensor(list, device=cuda) each: a pageable, synchronous copy).
                flat = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.int64,
                                    pin_memory=device.type == "cuda")
                splits_tensors = list(flat.to(device, non_blocking=True).split([len(r) for r in rows]))
            meta = KJTSplitsAllToAllMeta(
                pg=self.pg,
                _input=kjt,
                splits=self.splits,
                splits_tensors=splits_tensors,
                input_splits=input_splits,
                input_tensors=kjt.dist_tensors(),
                labels=kjt.dist_labels(),
                keys=kjt.keys()[self._keys],
                device=device,
                stagger=self.stagger,
            )
            if self.host_pg is not None:
                meta.host_rows, meta.host_pg = rows, self.host_pg  # type: ignore[attr-defined]
            return meta


def kjt_all_to_alls(modules: dict[str, ShardedModule]) -> list[KJTAllToAll]:
    """The KJT all-to-alls inside the sharded modules' input dists (initialized ones only:
    torchrec creates them on the first input_dist call)."""
    found = []
    for module in modules.values():
        dists = compat_torchrec.input_dist_all_to_alls(module)
        if dists is None:
            return []
        for kjt_dist in dists:
            if isinstance(kjt_dist, KJTAllToAll):
                found.append(kjt_dist)
    return found


_HOST_GROUPS: dict[tuple[Any, tuple[int, ...]], dist.ProcessGroup] = {}


def _backend(pg: dist.ProcessGroup) -> str:
    return dist.get_backend(pg)


def host_group(pg: dist.ProcessGroup) -> dist.ProcessGroup:
    """A Gloo group over ``pg``'s ranks (``pg`` itself if it is Gloo), made once per set
    of ranks and job (a process group made again after ``destroy_process_group`` gets
    new ones). ``dist.new_group`` is collective: every rank of the job calls this in the
    same order (the first fused input dist, the same step on every rank)."""
    if _backend(pg) == "gloo":
        return pg
    key = (dist.group.WORLD, tuple(dist.get_process_group_ranks(pg)))
    if key not in _HOST_GROUPS:
        for ended in [k for k in _HOST_GROUPS if k[0] is not key[0]]:  # groups of an ended job
            del _HOST_GROUPS[ended]
        _HOST_GROUPS[key] = dist.new_group(ranks=list(key[1]), backend="gloo")
    return _HOST_GROUPS[key]


def install_splits_only(modules: dict[str, ShardedModule], host: bool = False) -> bool:
    """Install ``SplitsOnlyForward`` on every KJT all-to-all over more than one rank;
    False if the input dists are not initialized yet. ``host`` (``pipeline.splits_exchange:
    host``): the splits are exchanged over a Gloo group on the host.

    One rank keeps torchrec's own forward: it knows its output splits (its input's)
    without a collective, so it launches nothing and reads nothing back, where a fused
    splits all-to-all would copy the splits to the device, run the collective and
    read its result back (a host sync per step)."""
    targets = kjt_all_to_alls(modules)
    for kjt_dist in targets:
        pg = compat_torchrec.all_to_all_layout(kjt_dist).pg
        if pg.size() > 1:
            kjt_dist.forward = SplitsOnlyForward(  # type: ignore[method-assign]
                kjt_dist, host_group(pg) if host else None)
    return bool(targets)


def remove_splits_only(modules: dict[str, ShardedModule]) -> None:
    for kjt_dist in kjt_all_to_alls(modules):
        if isinstance(vars(kjt_dist).get("forward"), SplitsOnlyForward):
            del kjt_dist.forward


class FusedSplits(FusedKJTListSplitsAwaitable):
    """torchrec's ``FusedKJTListSplitsAwaitable`` (its wait: the host sync on the
    received splits, then the tensors all-to-alls) with torchrec 1.6's constructor,
    which launches the one splits all-to-all and nothing else. torchrec 1.8's also
    copies every splits tensor to the host first (``_safe_tolist``: a synchronize of
    the current stream each) for an overflow check that only runs under
    ``TORCHREC_OVERFLOW_DEBUG=1``: one more host sync per splits tensor and step,
    before the launch, on every multi-rank step. With ``splits_exchange="host"`` the
    splits go over :class:`HostSplitsExchange` instead."""

    def __init__(self, requests: list[Any], contexts: list[Any], pg: dist.ProcessGroup | None) -> None:
        Awaitable.__init__(self)
        awaitables = [awaitable for request in requests for awaitable in request.awaitables]
        output_lengths = [len(request.awaitables) for request in requests]
        metas = [a for a in awaitables if isinstance(a, KJTSplitsAllToAllMeta)]
        on_host = [m for m in metas if hasattr(m, "host_rows")]
        if on_host:  # splits_exchange="host": every KJT all-to-all of the pipeline has its rows here
            assert len(on_host) == len(metas), "all KJT all-to-alls of a pipeline exchange their splits alike"
            lengths = [len(getattr(a, "host_rows", ())) for a in awaitables]
            rows = [row for m in on_host for row in m.host_rows]
            splits = HostSplitsExchange(rows, on_host[0].host_pg)
        else:
            lengths = [len(a.splits_tensors) if isinstance(a, KJTSplitsAllToAllMeta) else 0 for a in awaitables]
            splits_tensors = [t for m in metas for t in m.splits_tensors]
            splits = (SplitsAllToAllAwaitable(input_tensors=splits_tensors, pg=pg)
                      if splits_tensors and pg is not None else None)
        compat_torchrec.init_fused_splits(self, contexts, awaitables, output_lengths, lengths, splits)


class HostSplitsExchange(Awaitable):
    """The splits all-to-all over a Gloo group on the host (``pipeline.splits_exchange:
    host``): ``rows[i][r]`` is what this rank sends rank r in row i; the wait returns,
    per row, what each rank sent here, as torchrec's ``SplitsAllToAllAwaitable`` does.
    Nothing is copied to the device, and the wait is on the other ranks' hosts, not on
    this GPU's streams: the host sync of ``input_dist_wait`` no longer waits for the
    dist stream to reach the collective."""

    def __init__(self, rows: list[list[int]], group: dist.ProcessGroup) -> None:
        super().__init__()
        self._world = group.size()
        send = torch.tensor(rows, dtype=torch.int64).T.contiguous().view(-1)  # by destination rank
        self._received = torch.empty_like(send)
        self._work = dist.all_to_all_single(self._received, send, group=group, async_op=True)

    def _wait_impl(self) -> list[list[int]]:
        self._work.wait()
        return self._received.view(self._world, -1).T.tolist()


def fuse_splits(requests: dict[str, Any], contexts: dict[str, Any]) -> list[tuple[list[str], Any]]:
    """One :class:`FusedSplits` per process group over the modules' splits requests;
    constructing it launches the single splits all-to-all."""
    by_pg: dict[Any, list[str]] = {}
    for fqn, request in requests.items():
        pg = next((a.pg for a in getattr(request, "awaitables", []) if isinstance(a, KJTSplitsAllToAllMeta)), None)
        by_pg.setdefault(pg, []).append(fqn)
    return [
        (fqns, FusedSplits(requests=[requests[f] for f in fqns], contexts=[contexts[f] for f in fqns], pg=pg))
        for pg, fqns in by_pg.items()
    ]
