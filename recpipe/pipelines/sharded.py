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

from typing import TYPE_CHECKING, Any

from torch import nn
from torchrec.distributed.types import ShardedModule

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
