"""Finding sharded modules and intercepting their forward, visibly and removably.

No FX tracing: a pipeline looks up every torchrec ``ShardedModule`` in the model and
replaces its ``forward`` (an instance attribute, so ``del`` restores the class's)
with a named :class:`PipelinedForward`. The batch attribute that feeds the modules is
``Batch.sparse_features``; the interceptor checks at every call that it received
exactly that object, so a model that rewrites its KeyedJaggedTensor before the
embedding module gets an error saying what to change instead of silently losing
the overlap (TorchRec's "will NOT be pipelined" mode).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.dist_data import KJTAllToAll
from torchrec.distributed.embedding_sharding import FusedKJTListSplitsAwaitable, KJTSplitsAllToAllMeta
from torchrec.distributed.types import ShardedModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

if TYPE_CHECKING:
    from recpipe.pipelines.engine import Pipeline

BATCH_INPUT_ATTR = "sparse_features"


class PipelineError(RuntimeError):
    """A model or call pattern the pipeline cannot run; the message says what to change."""


def find_sharded_modules(model: nn.Module) -> dict[str, ShardedModule]:
    """Every torchrec ShardedModule in ``model`` by fully qualified name (outermost only)."""
    found: dict[str, ShardedModule] = {}
    for fqn, module in model.named_modules():
        if isinstance(module, ShardedModule) and not any(fqn.startswith(f"{p}.") for p in found):
            found[fqn] = module
    if not found:
        raise PipelineError(
            "the model has no torchrec sharded module, so there is nothing to pipeline: shard it with "
            "DistributedModelParallel first (recpipe.sharding.shard_model), or use pipeline.name=base"
        )
    return found


def has_feature_processor(module: ShardedModule) -> bool:
    return "FeatureProcessed" in type(module).__name__ or hasattr(module, "_feature_processor")


def dense_optimized_tables(modules: dict[str, ShardedModule], optimizer: Any) -> list[str]:
    """Parameters of sharded modules that the dense optimizer steps (data_parallel
    tables): pipelines that look up batch i+1 before optimizer(i) cannot use them."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [
        f"{fqn}.{name}"
        for fqn, module in modules.items()
        for name, p in module.named_parameters()
        if id(p) in stepped
    ]


class PipelinedForward:
    """Stands in for ``ShardedModule.forward`` while a pipeline is attached.

    During ``progress()`` it hands the module the input all-to-all (or the whole
    lookup) that the pipeline ran ahead for the batch being trained. Outside
    ``progress()`` it refuses: the model must be run through ``pipeline.detached()``.
    """

    def __init__(self, fqn: str, module: ShardedModule, pipeline: "Pipeline") -> None:
        self.fqn = fqn
        self.module = module
        self.pipeline = pipeline

    def __repr__(self) -> str:
        return f"PipelinedForward({self.fqn!r}, installed by {type(self.pipeline).__name__}; removed by .detach())"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        batch = self.pipeline._current
        if batch is None:
            raise PipelineError(
                f"sharded module {self.fqn!r} was called outside pipeline.progress() while the pipeline is "
                "attached; run the model under `with pipeline.detached():` (e.g. for evaluation)"
            )
        features = args[0] if args else next(iter(kwargs.values()), None)
        expected = getattr(batch.device, BATCH_INPUT_ATTR)
        if features is not expected:
            raise PipelineError(
                f"sharded module {self.fqn!r} received a KeyedJaggedTensor that is not batch.{BATCH_INPUT_ATTR}: "
                f"the model builds or changes it inside forward (concat, permute, feature processing, ...). "
                f"{type(self.pipeline).__name__} starts the input all-to-all of the next batch from the batch itself, "
                f"before forward runs, so the module must be called with batch.{BATCH_INPUT_ATTR} unchanged. Move the "
                "transformation into the data loader, or train with pipeline.name=base."
            )
        if self.fqn in batch.consumed:
            raise PipelineError(
                f"sharded module {self.fqn!r} was called twice in one forward; the pipeline prepares one input "
                "all-to-all per module and batch. Call each sharded module once per forward."
            )
        batch.consumed.add(self.fqn)
        return self.pipeline._sharded_forward(batch, self.fqn, self.module)


def install(pipeline: "Pipeline", modules: dict[str, ShardedModule]) -> None:
    for fqn, module in modules.items():
        if "forward" in vars(module):
            raise PipelineError(
                f"sharded module {fqn!r} already has an instance-level forward ({vars(module)['forward']!r}); "
                "is another pipeline attached to this model? Detach it first."
            )
        module.forward = PipelinedForward(fqn, module, pipeline)  # type: ignore[method-assign]


def remove(modules: dict[str, ShardedModule]) -> None:
    for module in modules.values():
        if isinstance(vars(module).get("forward"), PipelinedForward):
            del module.forward


class SplitsOnlyForward:
    """Stands in for ``KJTAllToAll.forward`` while a pipeline is attached.

    It computes what the all-to-all of one KeyedJaggedTensor needs (splits, the
    tensors to send) without launching anything, so the pipeline can exchange the
    splits of every input dist of every sharded module in ONE collective per process
    group (``FusedKJTListSplitsAwaitable``) instead of one per sharding type, each
    with its own host sync. Same contract as TorchRec's pipeline uses; built from
    the KeyedJaggedTensor's public ``dist_*`` methods.
    """

    def __init__(self, kjt_dist: KJTAllToAll) -> None:
        self.pg = kjt_dist._pg
        self.splits = kjt_dist._splits
        self.stagger = kjt_dist._stagger
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
            # torch.tensor(list, device=cuda): small synchronous H2D copies, as in TorchRec.
            splits_tensors = [torch.tensor(split, device=device) for split in input_splits]
            if not kjt.variable_stride_per_key():
                splits_tensors.append(torch.tensor([kjt.stride()] * self._world, device=device))
            return KJTSplitsAllToAllMeta(
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


def kjt_all_to_alls(modules: dict[str, ShardedModule]) -> list[KJTAllToAll]:
    """The KJT all-to-alls inside the sharded modules' input dists (initialized ones only:
    torchrec creates them on the first input_dist call)."""
    found = []
    for module in modules.values():
        if getattr(module, "_has_uninitialized_input_dist", False):
            return []
        for input_dist in getattr(module, "_input_dists", []):
            kjt_dist = getattr(input_dist, "_dist", None)
            if isinstance(kjt_dist, KJTAllToAll):
                found.append(kjt_dist)
    return found


def install_splits_only(modules: dict[str, ShardedModule]) -> bool:
    """Install ``SplitsOnlyForward`` on every KJT all-to-all; False if not initialized yet."""
    targets = kjt_all_to_alls(modules)
    for kjt_dist in targets:
        kjt_dist.forward = SplitsOnlyForward(kjt_dist)  # type: ignore[method-assign]
    return bool(targets)


def remove_splits_only(modules: dict[str, ShardedModule]) -> None:
    for kjt_dist in kjt_all_to_alls(modules):
        if isinstance(vars(kjt_dist).get("forward"), SplitsOnlyForward):
            del kjt_dist.forward


def fuse_splits(requests: dict[str, Any], contexts: dict[str, Any]) -> list[tuple[list[str], Any]]:
    """One ``FusedKJTListSplitsAwaitable`` per process group over the modules' splits
    requests; constructing it launches the single splits all-to-all."""
    by_pg: dict[Any, list[str]] = {}
    for fqn, request in requests.items():
        pg = next((a.pg for a in getattr(request, "awaitables", []) if isinstance(a, KJTSplitsAllToAllMeta)), None)
        by_pg.setdefault(pg, []).append(fqn)
    return [
        (fqns, FusedKJTListSplitsAwaitable(requests=[requests[f] for f in fqns], contexts=[contexts[f] for f in fqns], pg=pg))
        for pg, fqns in by_pg.items()
    ]
