"""``data.source: binary``: batches of a converted dataset, read through numpy memmaps.

The dataset's parts, in manifest order, form one stream of rows (the TSV reader's
line stream of the same files), split over ranks and shuffled as
``recpipe.data.mapped`` says: without shuffling the batches equal the TSV reader's
bit for bit. The manifest and every file's header and size are checked when the
dataset is opened, and each batch's labels, counts and ids are range-checked (an id
beyond its table would be an out-of-bounds embedding lookup), so corruption is an
error naming the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch

from recpipe.data.batch import Batch
from recpipe.data.binary_format import BinaryDataError, Layout, check_part_files, open_column, read_manifest
from recpipe.data.columns import ColumnLayout
from recpipe.data.mapped import MappedPart, MappedRows, Slice, first_bad_row

__all__ = ["BinaryDataset", "open_dataset"]


def open_dataset(directory: str | Path, layout: Layout) -> tuple[list[MappedPart], int]:
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
        paths = {c: manifest.column_path(name, c) for c in layout.columns()}
        arrays = {c: open_column(manifest, name, c) for c in layout.columns()}
        parts.append(MappedPart(paths, start, rows, arrays))
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
        parts, _ = open_dataset(directory, layout)
        self.rows = MappedRows(parts, batch_size=batch_size, rank=rank, world_size=world_size, shuffle=shuffle,
                               block_rows=block_rows, seed=seed)
        self.batch_size = batch_size
        self.columns = ColumnLayout(keys, layout.hotness, layout.num_dense)
        self.id_limits = {f"cat_{f}": rows for f, rows in enumerate(layout.table_sizes)}

    @property
    def num_rows(self) -> int:
        return self.rows.num_rows

    @property
    def num_batches(self) -> int:
        return self.rows.num_batches

    def block_order(self, epoch: int) -> np.ndarray | None:
        return self.rows.block_order(epoch)

    def batch(self, index: int, order: np.ndarray | None, epoch: int = 0, pin: bool = False,
              empty: Callable[..., torch.Tensor] | None = None) -> Batch:
        """Batch ``index`` of this rank; ``order`` = ``block_order(epoch)``; ``empty``: the
        allocator of its tensors (``ColumnLayout.build``)."""
        columns, count, slices = self.rows.rows(index, order, epoch)
        if count:
            self._check(columns, slices)
        ids = [columns[f"cat_{f}"] for f in range(len(self.layout.hotness))]
        return self.columns.build(columns["labels"][:, 0], columns["dense"], ids, count, self.batch_size, pin=pin,
                                  empty=empty)

    def _check(self, columns: dict[str, np.ndarray], slices: list[Slice]) -> None:
        """Range checks of a batch; on failure, find the file and row that is wrong."""
        bad = [c for c, limit in self.id_limits.items() if columns[c].view(_unsigned(columns[c])).max() >= limit]
        if columns["labels"].max() > 1:
            bad.append("labels")
        if columns["dense"].min() < 0:
            bad.append("dense")
        if not bad:
            return
        column = bad[0]
        if column == "labels":
            found = first_bad_row(slices, column, lambda v: (v > 1).any(axis=1))
        elif column == "dense":
            found = first_bad_row(slices, column, lambda v: (v < 0).any(axis=1))
        else:
            limit = self.id_limits[column]
            found = first_bad_row(slices, column, lambda v: ((v < 0) | (v >= limit)).any(axis=1))
        assert found is not None, f"range check of {column} failed but no row is out of range"
        part, row = found
        raise BinaryDataError(
            f"{part.path_of[column]}: row {row} holds {part.arrays[column][row].tolist()}, "
            f"outside the valid range of {column} ({_valid(column, self.id_limits)}): the file is corrupt "
            f"(recpipe data verify {self.directory})"
        )


def _unsigned(a: np.ndarray) -> np.dtype:
    """The unsigned dtype of the same width: negatives become huge, one max() checks both ends."""
    return np.dtype(a.dtype.str.replace("i", "u"))


def _valid(column: str, limits: dict[str, int]) -> str:
    if column == "labels":
        return "0 or 1"
    if column == "dense":
        return "counts >= 0"
    return f"ids 0..{limits[column] - 1}"
