"""Models recpipe has never seen, with their own batch types, for the pipeline tests.

Each ``Case`` builds a fresh sharded model (same seed, so every build is identical),
makes deterministic host batches for a rank, and says where each sharded module's
input is in a batch (for the semi_sync reference). Sharding uses torchrec's public
APIs directly, one generator per table, so the cases exercise every module type
recpipe's pipelines must take: EmbeddingBagCollection (weighted and not),
EmbeddingCollection and FeatureProcessedEmbeddingBagCollection.
"""

from __future__ import annotations

import itertools
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.test_utils.test_model import ModelInput, TestSparseNN
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from pipeline_harness import RunResult, local_state
from recpipe.config import load_config
from recpipe.pipelines import PIPELINES
from recpipe.sharding.build import dense_optimizer
from recpipe.table_sharding.sharders import embedding_fused_params

_CFG = load_config(None, ["optimizer.embedding.lr=0.1", "optimizer.dense.lr=0.1"])
_FUSED = embedding_fused_params(_CFG.optimizer.embedding, _CFG.sharding.uvm_host_mapped)


def _tw(rank: int):
    return lambda world: table_wise(rank=rank % world, compute_kernel="fused")


def _rw():
    return lambda world: row_wise(compute_kernel="fused")


def _cw():
    return lambda world: column_wise(ranks=list(range(world)), compute_kernel="fused")


def shard_any(model: nn.Module, generators: dict[str, Callable[[int], Any]], device: torch.device):
    """(DMP, combined optimizer) for every embedding module of ``model``, each table
    sharded by ``generators[table name](world size)`` (torchrec's sharding_plan helpers)."""
    ebc_sharder = EmbeddingBagCollectionSharder(fused_params=_FUSED)
    sharders = {
        EmbeddingBagCollection: ebc_sharder,
        EmbeddingCollection: EmbeddingCollectionSharder(fused_params=_FUSED),
        FeatureProcessedEmbeddingBagCollection: FeatureProcessedEmbeddingBagCollectionSharder(ebc_sharder=ebc_sharder),
    }
    world = dist.get_world_size()
    plan = {}
    for fqn, module in model.named_modules():
        sharder = sharders.get(type(module))
        if sharder is None or any(fqn.startswith(f"{p}.") for p in plan):
            continue
        names = [n for n in generators if n in {c.name for c in _tables(module)}]
        plan[fqn] = construct_module_sharding_plan(
            module, per_param_sharding={n: generators[n](world) for n in names}, sharder=sharder,
            local_size=world, world_size=world, device_type=device.type,
        )
    dmp = DistributedModelParallel(module=model, device=device, plan=ShardingPlan(plan), sharders=list(sharders.values()))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense_optimizer(dmp, _CFG.optimizer.dense)])


def _tables(module: nn.Module) -> list:
    if isinstance(module, FeatureProcessedEmbeddingBagCollection):
        module = module._embedding_bag_collection
    return module.embedding_bag_configs() if isinstance(module, EmbeddingBagCollection) else module.embedding_configs()


@dataclass
class Case:
    name: str
    build: Callable[[torch.device], tuple[nn.Module, Any]]  # fresh (DMP, optimizer), same seed
    batches: Callable[[int, int], list]  # (rank, n) -> host batches
    inputs: dict[str, Callable[[Any], KeyedJaggedTensor]]  # module path -> its input in a batch
    pipeline_inputs: dict[str, Callable] = field(default_factory=dict)  # what the pipeline is given as inputs=
    fused_ok: bool = True  # fused_sparse_dist refuses feature processors


def _kjt(g: torch.Generator, keys: list[str], rows: dict[str, int], B: int, weighted: bool = False) -> KeyedJaggedTensor:
    """Few distinct ids (consecutive batches share rows, so staleness is visible)."""
    lengths = torch.randint(0, 4, (len(keys) * B,), generator=g, dtype=torch.int32)
    values = torch.cat([torch.randint(0, min(rows[k], 9), (int(lengths[i * B:(i + 1) * B].sum()),), generator=g)
                        for i, k in enumerate(keys)])
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)


# ------------------------------------------------------------- TorchRec's TestSparseNN
def sparse_nn(feature_processor: bool = False) -> Case:
    """torchrec's own test model with its ModelInput batch: an unweighted EBC fed from
    ``idlist_features``, a weighted EBC from ``idscore_features`` and, with
    ``feature_processor``, a FeatureProcessedEmbeddingBagCollection (position
    weights) fed from the same ``idlist_features`` KJT as the plain EBC."""
    rows = {"f0": 40, "f1": 60, "f2": 30, "fp0": 50, "w0": 30, "w1": 20}
    tables = [EmbeddingBagConfig(name=f"t_{f}", feature_names=[f], embedding_dim=8, num_embeddings=rows[f])
              for f in ("f0", "f1", "f2", *(["fp0"] if feature_processor else []))]
    weighted = [EmbeddingBagConfig(name=f"t_{f}", feature_names=[f], embedding_dim=8, num_embeddings=rows[f])
                for f in ("w0", "w1")]
    idlist = [c.feature_names[0] for c in tables]
    gens = {"t_f0": _tw(0), "t_f1": _rw(), "t_f2": _tw(1), "t_w0": _tw(1),
            "t_w1": _rw(), "t_fp0": _tw(0)}

    def build(device: torch.device):
        torch.manual_seed(0)
        model = TestSparseNN(tables=tables, weighted_tables=weighted, num_float_features=6, dense_device=torch.device("cpu"),
                             sparse_device=torch.device("meta"),
                             max_feature_lengths={"t_fp0": 4} if feature_processor else None)
        return shard_any(model, gens, device)

    def batches(rank: int, n: int) -> list:
        g = torch.Generator().manual_seed(100 + rank)
        return [ModelInput(float_features=torch.rand(12, 6, generator=g), idlist_features=_kjt(g, idlist, rows, 12),
                           idscore_features=_kjt(g, ["w0", "w1"], rows, 12, weighted=True),
                           label=torch.randint(0, 2, (12,), generator=g).float()) for _ in range(n)]

    inputs = {"sparse.ebc": lambda b: b.idlist_features, "sparse.weighted_ebc": lambda b: b.idscore_features}
    if feature_processor:
        inputs["sparse.fp_ebc"] = lambda b: b.idlist_features
    return Case("TestSparseNN+fp" if feature_processor else "TestSparseNN", build, batches, inputs, fused_ok=not feature_processor)


# ----------------------------------------------------------------- the two-tower example
def two_tower() -> Case:
    """scripts/two_tower.py: KJTs in a dict field plus an EmbeddingCollection history."""
    from scripts.two_tower import build_model, make_batch

    cfg = load_config(None, ["model.factory=scripts.two_tower:build_model", "data.factory=scripts.two_tower:make_batches",
                             "model.options={num_users: 60, num_items: 80, num_categories: 4, embedding_dim: 8, tower: [16, 8]}",
                             "data.batch_size=10", "data.options={max_history: 4}"])
    gens = {"user_id": _rw(), "user_country": _tw(0), "item_id": _cw(),
            "item_category": _tw(1), "item_history": _rw()}

    def build(device: torch.device):
        torch.manual_seed(0)
        return shard_any(build_model(cfg), gens, device)

    def batches(rank: int, n: int) -> list:
        return [make_batch(cfg, rank=rank, split="train", epoch=0, index=i) for i in range(n)]

    inputs = {"user_ebc": lambda b: b.features["user"], "item_ebc": lambda b: b.features["item"],
              "history_ec": lambda b: b.history}
    return Case("two-tower", build, batches, inputs)


# ----------------------------------------------- a plain dataclass batch, KJT in `ids`
@dataclass
class IdsBatch(Pipelineable):
    dense: torch.Tensor
    ids: KeyedJaggedTensor
    target: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "IdsBatch":
        return IdsBatch(self.dense.to(device, non_blocking=non_blocking), self.ids.to(device, non_blocking=non_blocking),
                        self.target.to(device, non_blocking=non_blocking))

    def record_stream(self, stream) -> None:
        self.dense.record_stream(stream)
        self.ids.record_stream(stream)
        self.target.record_stream(stream)


class IdsModel(nn.Module):
    """Regression on one EBC. With ``concat``, forward builds the module's KJT itself
    from two halves of the batch (``ids`` and ``more_ids`` in a dict batch)."""

    def __init__(self, rows: dict[str, int], concat: bool = False) -> None:
        super().__init__()
        self.concat = concat
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t_{k}", feature_names=[k], embedding_dim=4, num_embeddings=n) for k, n in rows.items()],
            device=torch.device("meta"))
        self.head = nn.Linear(4 * len(rows) + 3, 1)

    def forward(self, batch: Any):
        ids = concat_ids(batch) if self.concat else batch.ids
        dense = batch["dense"] if self.concat else batch.dense
        target = batch["target"] if self.concat else batch.target
        pred = self.head(torch.cat([self.ebc(ids).values(), dense], dim=1)).squeeze(1)
        loss = ((pred - target) ** 2).mean()
        return loss, {"prediction": pred.detach()}


class DictBatch(dict):
    """A dict batch with the Pipelineable methods (a pipeline copies batches with .to)."""

    def to(self, device: torch.device, non_blocking: bool = False) -> "DictBatch":
        return DictBatch({k: v.to(device, non_blocking=non_blocking) for k, v in self.items()})

    def record_stream(self, stream) -> None:
        for v in self.values():
            v.record_stream(stream)


def concat_ids(batch: dict) -> KeyedJaggedTensor:
    """The KJT IdsModel(concat=True) builds inside forward: a new object each call."""
    return KeyedJaggedTensor.concat([batch["ids"], batch["more_ids"]])


def ids_model(concat: bool = False) -> Case:
    rows = {"a": 30, "b": 40} if not concat else {"a": 30, "b": 40, "c": 20}
    gens = {"t_a": _rw(), "t_b": _tw(1), "t_c": _tw(0)}

    def build(device: torch.device):
        torch.manual_seed(0)
        return shard_any(IdsModel(rows, concat=concat), gens, device)

    def batches(rank: int, n: int) -> list:
        g = torch.Generator().manual_seed(7 + rank)
        out = []
        for _ in range(n):
            dense, target = torch.randn(8, 3, generator=g), torch.randn(8, generator=g)
            if concat:
                out.append(DictBatch(dense=dense, target=target, ids=_kjt(g, ["a", "b"], rows, 8),
                                     more_ids=_kjt(g, ["c"], rows, 8)))
            else:
                out.append(IdsBatch(dense, _kjt(g, ["a", "b"], rows, 8), target))
        return out

    if concat:
        return Case("concat-in-forward", build, batches, {"ebc": concat_ids}, pipeline_inputs={"ebc": concat_ids})
    return Case("dataclass-ids", build, batches, {"ebc": lambda b: b.ids})


# ------------------------------------------------------------------ running a case
def plain_loop(case: Case, batches: list, device: torch.device = torch.device("cpu")) -> RunResult:
    """The reference: zero_grad, (loss, output) = model(batch), backward, step."""
    model, opt = case.build(device)
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss, _ = model(batch.to(device))
        torch.sum(loss).backward()
        opt.step()
        losses.append(loss.detach())
    return _result(model, losses, device)


def run_pipeline(case: Case, name: str, batches: list, segments: list[int] | None = None,
                 device: torch.device = torch.device("cpu"), **options) -> RunResult:
    model, opt = case.build(device)
    if device.type == "cuda" and hasattr(batches[0], "pin_memory"):
        batches = [b.pin_memory() for b in batches]
    from pipeline_harness import make

    pipe = make(name, types.SimpleNamespace(model=model, optimizer=opt), device,
                **({"inputs": case.pipeline_inputs} if PIPELINES[name].intercepts else {}), **options)
    losses, it = [], iter(batches)
    for size in segments or [len(batches)]:
        seg = itertools.islice(it, size)
        while True:
            try:
                pipe.progress(seg)
            except StopIteration:
                break
            losses.append(pipe.last_loss)
    assert pipe.in_flight() == 0
    return _result(model, losses, device)


def _result(model: nn.Module, losses: list, device: torch.device) -> RunResult:
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    return RunResult([x.cpu() for x in losses], [], {k: v.cpu() for k, v in local_state(model).items()})


def semi_sync_reference(case: Case, batches: list, start_batch: int, stash_gradients: bool,
                        device: torch.device = torch.device("cpu")) -> RunResult:
    """semi_sync's documented semantics as a plain loop (see recpipe/pipelines/semi_sync.py):
    every sharded module's output for batch t+1 is computed before batch t's backward
    once t >= start_batch, after batch t's optimizer step otherwise; with
    ``stash_gradients`` the dense optimizer applies batch t-1's gradient at step t,
    nothing at the first semi-sync step, and the last gradient at the end."""
    from recpipe.runtime.sharded import find_sharded_modules
    from recpipe.runtime.steps import dense_params

    model, opt = case.build(device)
    modules = find_sharded_modules(model)
    batches = [b.to(device) for b in batches]
    dense = dense_params(opt)

    def lookup(b):  # each module's own forward on its input
        return {fqn: m(case.inputs[fqn](b)).wait() for fqn, m in modules.items()}

    losses, stash = [], None
    outputs = lookup(batches[0])
    for t, batch in enumerate(batches):
        opt.zero_grad()
        current = outputs
        for fqn, m in modules.items():
            m.forward = lambda *_, _f=fqn: current[_f]  # the model reads the precomputed outputs
        loss, _ = model(batch)
        for m in modules.values():
            del m.forward
        stale = t >= start_batch
        if stale and t + 1 < len(batches):
            outputs = lookup(batches[t + 1])
        torch.sum(loss).backward()
        if stash_gradients and stale:
            fresh = [None if p.grad is None else p.grad.clone() for p in dense]
            if stash is not None:
                for p, g in zip(dense, stash):
                    p.grad = g
                opt.step()
            stash = fresh
        else:
            opt.step()
        if not stale and t + 1 < len(batches):
            outputs = lookup(batches[t + 1])
        losses.append(loss.detach())
    if stash is not None:
        for p, g in zip(dense, stash):
            p.grad = g
        opt.step()
    return _result(model, losses, device)
