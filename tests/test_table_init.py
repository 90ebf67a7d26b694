"""The embedding tables are initialized once, by the kernel that holds them: TorchRec's
batched kernels draw each shard from U(-1/sqrt(rows), 1/sqrt(rows)) when they are built, and
the built-in model's table configs carry an ``init_fn`` that leaves them so, where TorchRec's
sharded module would draw every table a second time (``reset_parameters``). Every sharding
type, 1 and 2 ranks; a model built on a real device (export, serving) keeps TorchRec's init."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

from pipeline_harness import SMALL_TABLES, small_config
from recpipe.distributed import init_process_group, launch_local
from recpipe.models import make_model
from recpipe.models.dlrm import build_model
from recpipe.sharding import shard_model

BIG_TABLES = [4000, 6000, 8000, 10000]  # enough values per shard for the distribution checks


def _local_tables(model) -> dict[str, list[torch.Tensor]]:
    out: dict[str, list[torch.Tensor]] = {}
    for name, value in model.state_dict().items():
        if "embedding_bags" in name and isinstance(value, ShardedTensor):
            out[name] = [shard.tensor for shard in value.local_shards()]
        elif "embedding_bags" in name and isinstance(value, torch.Tensor):
            out[name] = [value]
    return out


def _check(cfg) -> None:
    rows = dict(zip(cfg.model.table_names, cfg.model.num_embeddings_per_feature))
    model = make_model(cfg)
    draws: list[int] = []
    uniform = torch.Tensor.uniform_

    def counted(tensor, *args, **kwargs):
        draws.append(tensor.numel())
        return uniform(tensor, *args, **kwargs)

    torch.Tensor.uniform_ = counted
    try:
        sharded = shard_model(model, cfg, torch.device("cpu"))
    finally:
        torch.Tensor.uniform_ = uniform
    tables = _local_tables(sharded.model)
    shards = [t for parts in tables.values() for t in parts if t.numel()]
    assert sorted(draws) == sorted(t.numel() for t in shards), "every local shard drawn exactly once"
    for name, parts in tables.items():
        table = next(t for t in rows if f".{t}." in name)
        bound = 1 / math.sqrt(rows[table])
        for t in parts:
            if t.numel():
                assert t.abs().max() <= bound, (name, t.abs().max(), bound)
                assert t.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.1), name  # uniform, not normal
                assert t.unique().numel() > t.numel() // 2, name


def _rank(cfg) -> None:
    init_process_group(cfg)
    try:
        _check(cfg)
    finally:
        dist.destroy_process_group()


def _config(nproc: int):
    return small_config(nproc, [f"model.num_embeddings_per_feature={BIG_TABLES}"])  # row, column, data_parallel, table


def test_one_rank_draws_every_table_once():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _check(_config(1))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_draw_every_table_once():
    launch_local(_rank, 2, _config(2))


def test_a_model_built_on_a_real_device_keeps_torchrec_init():
    cfg = small_config(1)
    model = build_model(cfg.model, device=torch.device("cpu"))
    ebc = model.model.sparse_arch.embedding_bag_collection
    for rows, (name, bag) in zip(SMALL_TABLES, ebc.embedding_bags.items()):
        bound = 1 / math.sqrt(rows)
        assert bag.weight.abs().max() <= bound and bag.weight.std() > bound / 4, name
