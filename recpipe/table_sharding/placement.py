"""Where each table goes: the sharding type recpipe asks torchrec for, the rank of each
table_wise table and the host of each table_row_wise one, and torchrec's
``ParameterSharding`` generator for a table."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from recpipe.system import local_world_size

if TYPE_CHECKING:
    from recpipe.config import ShardingConfig, TableSharding
    from recpipe.embedding_tables import TableInfo

# torch, torchrec and FBGEMM are imported by the functions that use them: the planner imports
# this module, and `recpipe plan` loads none of them.

__all__ = ["KERNELS", "parameter_sharding_generator", "placed_type", "table_row_wise_hosts", "table_wise_ranks"]

# recpipe kernel name -> torchrec EmbeddingComputeKernel value (the same strings).
KERNELS = {"fused": "fused", "fused_uvm": "fused_uvm", "fused_uvm_caching": "fused_uvm_caching", "dense": "dense"}


def placed_type(t: "TableSharding", world_size: int) -> str:
    """The sharding type recpipe asks torchrec for: the configured one, except that on
    one rank a row_wise table is placed table_wise. Both hold every row on the one GPU;
    as table_wise, torchrec batches the table into one TBE with the other table_wise
    tables: per step one lookup and one output dist fewer, and no row-wise bucketize
    of the ids. The numbers are the same (tests/test_pipelines.py, tests/test_sharding.py;
    with fp16 weights, stochastic rounding draws from the merged TBE's random stream instead)."""
    return "table_wise" if world_size == 1 and t.type in ("row_wise", "table_row_wise") else t.type


def table_wise_ranks(sharding: "ShardingConfig", world_size: int, tables: "Sequence[TableInfo]") -> dict[str, int]:
    """Rank of each table placed table_wise (``placed_type``) of ``tables`` (the
    model's, in model order): the configured one, else the least-loaded rank (largest
    tables first, load = rows), so placement is deterministic."""
    loads = [0] * world_size
    placed: dict[str, int] = {}
    resolved = {t.name: sharding.for_table(t.name) for t in tables}
    rows = {t.name: t.rows for t in tables}
    tw = {name for name, t in resolved.items() if placed_type(t, world_size) == "table_wise"}
    for name, t in resolved.items():
        if name in tw and t.rank is not None:
            placed[name] = t.rank
            loads[t.rank] += rows[name]
    free = [n for n, t in resolved.items() if n in tw and t.rank is None]
    for name in sorted(free, key=lambda n: (-rows[n], n)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        placed[name] = rank
        loads[rank] += rows[name]
    return placed


def table_row_wise_hosts(sharding: "ShardingConfig", world_size: int, tables: "Sequence[TableInfo]") -> dict[str, int]:
    """Host of each table_row_wise table of ``tables``: the least-loaded host (largest
    tables first, load = rows), so placement is deterministic."""
    hosts = world_size // local_world_size(world_size)
    loads = [0] * hosts
    placed: dict[str, int] = {}
    twrw = [t for t in tables if sharding.for_table(t.name).type == "table_row_wise"]
    for t in sorted(twrw, key=lambda t: (-t.rows, t.name)):
        host = min(range(hosts), key=lambda h: (loads[h], h))
        placed[t.name] = host
        loads[host] += t.rows
    return placed


def _with_kernel(generator: Callable, kernel: str) -> Callable:
    """``generator`` with its ParameterSharding's compute kernel set to ``kernel`` (torchrec's
    ``table_row_wise`` takes none and picks its own)."""

    def with_kernel(*args, **kwargs):
        sharding = generator(*args, **kwargs)
        sharding.compute_kernel = kernel
        return sharding

    return with_kernel


def parameter_sharding_generator(t: "TableSharding", rank: int | None, world_size: int) -> Callable:
    """torchrec's ``sharding_plan`` generator for one table (``rank``: the rank of a table
    placed table_wise, the host of a table_row_wise one; the type is ``placed_type``'s)."""
    from torchrec.distributed.sharding_plan import column_wise, data_parallel, row_wise, table_row_wise, table_wise

    kernel = KERNELS[t.kernel]
    kind = placed_type(t, world_size)
    if kind == "table_wise":
        return table_wise(rank=rank, compute_kernel=kernel)
    if kind == "row_wise":
        return row_wise(compute_kernel=kernel)
    if kind == "table_row_wise":
        return _with_kernel(table_row_wise(host_index=rank or 0), kernel)
    if kind == "column_wise":
        return column_wise(ranks=list(range(world_size)), compute_kernel=kernel)
    return data_parallel()
