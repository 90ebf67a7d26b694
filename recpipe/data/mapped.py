"""Rows of memory-mapped column files, split over ranks and shuffled: what the
``binary`` and ``criteo_npy`` sources share.

The parts (files, days), in order, form one stream of N rows. With B =
``data.batch_size`` and W ranks, rank r's batch i holds stream positions
``[(i*W + r)*B, +B)``, every rank has ``ceil(N / (W*B))`` batches, and positions
past N are padding samples (weight 0). Without shuffling, position p is row p: the
TSV reader's split (``recpipe.data.criteo``), and TorchRec's
``InMemoryBinaryCriteoIterDataPipe``'s for every full global batch (TorchRec splits
the last, partial one evenly over the ranks; here the ranks take it in order and
pad).

Shuffling (``data.shuffle``, train split only): position p maps to a row through a
permutation that depends only on ``(train.seed, epoch)``: the ``N // K`` full blocks
of K = ``data.shuffle_block_rows`` consecutive rows are permuted (a partial last
block stays last), and the real samples inside each batch are permuted by a
generator seeded by ``(train.seed, epoch, position)``. Every row is read once per
epoch, by one rank, and batch i is made without making batches 0..i-1: resuming at
``start_batch`` gives the same batches as a run that never stopped.

A batch is at most ``B/K + 2`` contiguous row ranges sliced from the maps, then
vectorised copies (no per-sample Python).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

__all__ = ["MappedPart", "MappedRows", "first_bad_row"]


def _seed(*parts: object) -> int:
    """A stable 63-bit seed (Python's ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


@dataclass(frozen=True)
class MappedPart:
    path_of: dict[str, Path]  # column -> file, for messages
    start: int  # first row in the stream
    rows: int
    arrays: dict[str, np.ndarray]  # column -> [rows, width] (a memory map)


# (part, first local row, rows) of one contiguous piece of a batch
Slice = tuple[MappedPart, int, int]


class MappedRows:
    """One rank's batches of rows of ``parts`` (see the module docstring)."""

    def __init__(
        self,
        parts: list[MappedPart],
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        shuffle: bool = False,
        block_rows: int = 1024,
        seed: int = 0,
    ) -> None:
        self.parts = parts
        self.num_rows = sum(p.rows for p in parts)
        self.starts = np.array([p.start for p in parts], dtype=np.int64)
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.shuffle, self.block_rows, self.seed = shuffle, block_rows, seed

    @property
    def num_batches(self) -> int:
        return math.ceil(self.num_rows / (self.world_size * self.batch_size))

    def block_order(self, epoch: int) -> np.ndarray | None:
        """The epoch's permutation of the full blocks (None without shuffling)."""
        if not self.shuffle:
            return None
        rng = np.random.default_rng(_seed("shuffle", self.seed, epoch))
        return rng.permutation(self.num_rows // self.block_rows)

    def _runs(self, start: int, count: int, order: np.ndarray | None) -> list[tuple[int, int]]:
        """(first row, rows) of the contiguous row ranges behind positions [start, start+count)."""
        if order is None:
            return [(start, count)] if count else []
        k, runs, p, end = self.block_rows, [], start, start + count
        while p < end:
            block, offset = divmod(p, k)
            take = min(k - offset, end - p)
            first = (int(order[block]) if block < len(order) else block) * k + offset
            runs.append((first, take))
            p += take
        return runs

    def _slices(self, runs: list[tuple[int, int]]) -> list[Slice]:
        """The runs cut at part boundaries."""
        out = []
        for row, count in runs:
            while count:
                # The last part starting at or before ``row``: never an empty part, which
                # shares its start with the part after it.
                part = self.parts[int(np.searchsorted(self.starts, row, side="right")) - 1]
                assert part.rows > 0, (row, part.start)
                local = row - part.start
                take = min(count, part.rows - local)
                out.append((part, local, take))
                row += take
                count -= take
        return out

    def rows(self, index: int, order: np.ndarray | None, epoch: int) -> tuple[dict[str, np.ndarray], int, list[Slice]]:
        """The real rows of batch ``index`` (``order`` = ``block_order(epoch)``): each
        column's [count, width] array, count, and the slices they came from."""
        B = self.batch_size
        start = (index * self.world_size + self.rank) * B
        count = max(0, min(B, self.num_rows - start))
        slices = self._slices(self._runs(start, count, order))
        columns = {}
        for column, template in self.parts[0].arrays.items():
            pieces = [part.arrays[column][local : local + take] for part, local, take in slices]
            columns[column] = pieces[0] if len(pieces) == 1 else (
                np.concatenate(pieces) if pieces else np.empty((0, *template.shape[1:]), dtype=template.dtype))
        if order is not None and count > 1:
            # Copy the blocks (sequential reads), then permute the copy in memory: the maps
            # are read in order instead of row by row in permuted order.
            perm = np.random.default_rng(_seed("batch", self.seed, epoch, start)).permutation(count)
            columns = {c: np.take(a, perm, axis=0) for c, a in columns.items()}
        return columns, count, slices


def first_bad_row(slices: list[Slice], column: str, bad: Callable[[np.ndarray], np.ndarray]) -> tuple[MappedPart, int] | None:
    """(part, local row) of the first row of ``column`` in ``slices`` for which
    ``bad(rows)`` (a boolean per row) holds; None if there is none."""
    for part, local, take in slices:
        wrong = np.nonzero(bad(part.arrays[column][local : local + take]))[0]
        if len(wrong):
            return part, local + int(wrong[0])
    return None
