"""``data.source: binary``: batches of a converted dataset, read through numpy memmaps.

The dataset's parts, in manifest order, form one stream of N rows (the TSV
reader's line stream of the same files). Splitting is the TSV reader's
(``recpipe.data.criteo``): with B = ``data.batch_size`` and W ranks, rank r's batch
i holds stream positions ``[(i*W + r)*B, +B)``, every rank has ``ceil(N / (W*B))``
batches, and positions past N are padding samples (weight 0). Without shuffling,
position p is row p, so the batches equal the TSV reader's bit for bit.

Shuffling (``data.shuffle``, train split only): position p maps to a row through a
permutation that depends only on ``(train.seed, epoch)``: the ``N // K`` full blocks
of K = ``data.shuffle_block_rows`` consecutive rows are permuted (a partial last
block stays last), and the real samples inside each batch are permuted by a
generator seeded by ``(train.seed, epoch, position)``. Every row is read once per
epoch, by one rank, and batch i is made without making batches 0..i-1: resuming
at ``start_batch`` gives the same batches as a run that never stopped.

A batch is at most ``B/K + 2`` contiguous row ranges sliced from the memmaps, then
vectorised copies into the batch's tensors (no per-sample Python). The manifest
and every file's size are checked when the dataset is opened, and each batch's
labels, counts and ids are range-checked (an id beyond its table would be an
out-of-bounds embedding lookup), so corruption is an error naming the file.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recpipe.data.batch import Batch
from recpipe.data.binary_format import BinaryDataError, Layout, check_part_files, column_path, read_manifest
from recpipe.data.columns import ColumnLayout

__all__ = ["BinaryDataset", "open_dataset"]


def _seed(*parts: object) -> int:
    """A stable 63-bit seed (Python's ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


@dataclass(frozen=True)
class _Part:
    path_of: dict[str, Path]  # column -> file
    start: int  # first row in the stream
    rows: int
    arrays: dict[str, np.ndarray]  # column -> memmap [rows, width]


def open_dataset(directory: str | Path, layout: Layout) -> tuple[list[_Part], int]:
    """Memmaps of every part of a complete dataset of ``layout``, and its row count.
    Raises ``BinaryDataError`` naming the directory or file that is wrong."""
    manifest = read_manifest(directory)
    where = Path(directory) / "manifest.json"
    diff = manifest.layout.differences(layout)
    if diff:
        raise BinaryDataError(f"{where}: the data has " + "; ".join(diff) + ": convert again with this config")
    if manifest.missing:
        raise BinaryDataError(f"{directory}: conversion incomplete, {len(manifest.missing)} of "
                              f"{len(manifest.sources)} files not converted (first: {manifest.missing[0]}); "
                              "run the same `recpipe data convert` again")
    parts, start = [], 0
    for name, rows in manifest.part_rows():
        problems = check_part_files(manifest, name)
        if problems:
            raise BinaryDataError("; ".join(problems) + f" (recpipe data verify {directory})")
        paths = {c: column_path(directory, name, c) for c in layout.columns()}
        arrays = {}
        for column, (dtype, width) in layout.columns().items():
            # np.memmap cannot map an empty file: an empty part gets an empty array.
            # A plain ndarray view of the map: numpy's memmap subclass adds Python
            # work to every slice.
            arrays[column] = (np.memmap(paths[column], dtype=dtype, mode="r", shape=(rows, width)).view(np.ndarray)
                              if rows else np.empty((0, width), dtype=dtype))
        parts.append(_Part(paths, start, rows, arrays))
        start += rows
    return parts, start


class BinaryDataset:
    """One rank's batches of one split (see the module docstring)."""

    def __init__(
        self,
        directory: str | Path,
        layout: Layout,
        keys: list[str],
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        shuffle: bool = False,
        block_rows: int = 1024,
        seed: int = 0,
    ) -> None:
        self.directory, self.layout = Path(directory), layout
        self.parts, self.num_rows = open_dataset(directory, layout)
        self.starts = np.array([p.start for p in self.parts], dtype=np.int64)
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.shuffle, self.block_rows, self.seed = shuffle, block_rows, seed
        self.columns = ColumnLayout(keys, layout.hotness, layout.num_dense)
        self.column_types = layout.columns()  # name -> (dtype, width)
        self.id_limits = {f"cat_{f}": rows for f, rows in enumerate(layout.table_sizes)}

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

    def _slices(self, runs: list[tuple[int, int]]) -> list[tuple[_Part, int, int]]:
        """The runs cut at part boundaries: (part, first local row, rows)."""
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

    def batch(self, index: int, order: np.ndarray | None, epoch: int = 0, pin: bool = False) -> Batch:
        """Batch ``index`` of this rank; ``order`` = ``block_order(epoch)``."""
        B = self.batch_size
        start = (index * self.world_size + self.rank) * B
        count = max(0, min(B, self.num_rows - start))
        slices = self._slices(self._runs(start, count, order))
        columns = {}
        for column, (dtype, width) in self.column_types.items():
            pieces = [part.arrays[column][local : local + take] for part, local, take in slices]
            columns[column] = pieces[0] if len(pieces) == 1 else (
                np.concatenate(pieces) if pieces else np.empty((0, width), dtype=dtype))
        if order is not None and count > 1:
            # Copy the blocks (sequential reads), then permute the copy in memory:
            # 3x faster than gathering rows in permuted order from the maps.
            perm = np.random.default_rng(_seed("batch", self.seed, epoch, start)).permutation(count)
            columns = {c: np.take(a, perm, axis=0) for c, a in columns.items()}
        if count:
            self._check(columns, slices)
        ids = [columns[f"cat_{f}"] for f in range(len(self.layout.hotness))]
        return self.columns.build(columns["labels"][:, 0], columns["dense"], ids, count, B, pin=pin)

    def _check(self, columns: dict[str, np.ndarray], slices: list[tuple[_Part, int, int]]) -> None:
        """Range checks of a batch; on failure, find the file and row that is wrong."""
        bad = [c for c, limit in self.id_limits.items() if columns[c].view(_unsigned(columns[c])).max() >= limit]
        if columns["labels"].max() > 1:
            bad.append("labels")
        if columns["dense"].min() < 0:
            bad.append("dense")
        if not bad:
            return
        column = bad[0]
        for part, local, take in slices:
            values = part.arrays[column][local : local + take]
            if column == "labels":
                wrong = np.nonzero(values > 1)[0]
            elif column == "dense":
                wrong = np.nonzero((values < 0).any(axis=1))[0]
            else:
                wrong = np.nonzero(((values < 0) | (values >= self.id_limits[column])).any(axis=1))[0]
            if len(wrong):
                row = local + int(wrong[0])
                raise BinaryDataError(
                    f"{part.path_of[column]}: row {row} holds {part.arrays[column][row].tolist()}, "
                    f"outside the valid range of {column} ({_valid(column, self.id_limits)}): the file is corrupt "
                    f"(recpipe data verify {self.directory})"
                )
        raise AssertionError(f"range check of {column} failed but no row is out of range")


def _unsigned(a: np.ndarray) -> np.dtype:
    """The unsigned dtype of the same width: negatives become huge, one max() checks both ends."""
    return np.dtype(a.dtype.str.replace("i", "u"))


def _valid(column: str, limits: dict[str, int]) -> str:
    if column == "labels":
        return "0 or 1"
    if column == "dense":
        return "counts >= 0"
    return f"ids 0..{limits[column] - 1}"
