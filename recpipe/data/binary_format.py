"""The binary click-log format written by ``recpipe data convert`` and read by
``data.source: binary``.

A dataset is a directory. Every converted TSV file (a *part*, named
``NNNNN-<file name>``, NNNNN its position on the command line) has one file per
column, each a headerless C-order array of fixed-width little-endian values, one row
per TSV line, readable with ``numpy.memmap``:

=================  ==========================  ===================================
file               dtype, shape                content
=================  ==========================  ===================================
``P.labels.bin``   uint8 [rows]                0 or 1
``P.dense.bin``    int32 [rows, D]             counts, negative ones clamped to 0
``P.cat_F.bin``    int32 [rows, h_F]           ids hashed into table F's rows as
                                               the TSV reader does (int64 when a
                                               table has more than 2**31 rows)
=================  ==========================  ===================================

The log1p of the counts is taken when batches are made (``recpipe.data.columns``),
so the files hold the data, not one model's transform of it.

``manifest.json`` names the layout (D, table sizes, hotness ``h_F`` per feature),
the sources in row order, and for every finished part its row count, the source's
size, mtime and SHA-256, the bytes and SHA-256 of each column file, and the
malformed lines that were skipped. A part is finished only once its entry is in
the manifest, and the entry is written last (after the column files are fsynced
and renamed to their final names), so an interrupted conversion never leaves a
part that looks finished.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recpipe.errors import DataError

__all__ = [
    "BinaryDataError",
    "FORMAT",
    "Layout",
    "MANIFEST",
    "Manifest",
    "column_path",
    "part_name",
    "read_manifest",
    "verify_dataset",
    "write_json_atomic",
]

FORMAT, VERSION = "recpipe-binary", 1
MANIFEST = "manifest.json"
HASHING = "criteo_tsv: hex v -> 1 + v mod (rows - 1), empty -> 0, one-row table -> 0"


class BinaryDataError(DataError, ValueError):
    """A binary dataset that cannot be read as configured; the message names the file
    (exit code ``EXIT_BAD_DATA``)."""


@dataclass(frozen=True)
class Layout:
    num_dense: int
    table_sizes: tuple[int, ...]
    hotness: tuple[int, ...]

    @property
    def id_dtype(self) -> np.dtype:
        return np.dtype("<i4") if max(self.table_sizes) <= 2**31 else np.dtype("<i8")

    def columns(self) -> dict[str, tuple[np.dtype, int]]:
        """Column name -> (dtype, values per row), in file order."""
        cols = {"labels": (np.dtype("u1"), 1), "dense": (np.dtype("<i4"), self.num_dense)}
        for f, h in enumerate(self.hotness):
            cols[f"cat_{f}"] = (self.id_dtype, h)
        return cols

    def row_bytes(self, column: str) -> int:
        dtype, width = self.columns()[column]
        return dtype.itemsize * width

    def to_json(self) -> dict[str, Any]:
        return {
            "num_dense": self.num_dense,
            "table_sizes": list(self.table_sizes),
            "hotness": list(self.hotness),
            "columns": {name: [dt.str, w] for name, (dt, w) in self.columns().items()},
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "Layout":
        return cls(int(raw["num_dense"]), tuple(int(x) for x in raw["table_sizes"]), tuple(int(x) for x in raw["hotness"]))

    @classmethod
    def from_config(cls, cfg: Any) -> "Layout":
        from recpipe.data.criteo import hotness_of

        m = cfg.model
        return cls(m.num_dense_features, tuple(m.num_embeddings_per_feature), tuple(hotness_of(cfg)))

    def differences(self, other: "Layout") -> list[str]:
        """What differs between a dataset's layout (self) and the config's (other)."""
        out = []
        if self.num_dense != other.num_dense:
            out.append(f"{self.num_dense} dense features, model.num_dense_features={other.num_dense}")
        if self.table_sizes != other.table_sizes:
            out.append(f"ids hashed into table sizes {list(self.table_sizes)}, model.num_embeddings_per_feature="
                       f"{list(other.table_sizes)}")
        if self.hotness != other.hotness:
            out.append(f"hotness {list(self.hotness)}, data.multi_hot_sizes gives {list(other.hotness)}")
        return out


def part_name(index: int, source: str) -> str:
    base = Path(source).name
    base = base.removesuffix(".gz")
    return f"{index:05d}-" + re.sub(r"[^A-Za-z0-9._-]", "_", base)


def column_path(directory: str | Path, part: str, column: str) -> Path:
    return Path(directory) / f"{part}.{column}.bin"


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write, fsync, rename over ``path``, fsync the directory: readers see the old
    file or the new one, never a torn one, also after a crash."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Manifest:
    directory: Path
    layout: Layout
    sources: list[dict[str, Any]]  # {"path", "part"} in row order
    parts: dict[str, dict[str, Any]]  # finished parts by name

    @property
    def missing(self) -> list[str]:
        return [s["path"] for s in self.sources if s["part"] not in self.parts]

    def part_rows(self) -> list[tuple[str, int]]:
        return [(s["part"], int(self.parts[s["part"]]["rows"])) for s in self.sources]

    @property
    def num_rows(self) -> int:
        return sum(rows for _, rows in self.part_rows())

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "hashing": HASHING,
            "layout": self.layout.to_json(),
            "sources": self.sources,
            "parts": self.parts,
        }

    def save(self) -> None:
        write_json_atomic(self.directory / MANIFEST, self.to_json())


def read_manifest(directory: str | Path) -> Manifest:
    d = Path(directory)
    path = d / MANIFEST
    if not path.is_file():
        raise BinaryDataError(f"{path}: no manifest; is {str(d)!r} a directory made by `recpipe data convert`?")
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT or raw.get("version") != VERSION:
            raise BinaryDataError(f"{path}: format {raw.get('format')!r} version {raw.get('version')!r}; "
                                  f"this recpipe reads {FORMAT!r} version {VERSION}")
        return Manifest(d, Layout.from_json(raw["layout"]), list(raw["sources"]), dict(raw["parts"]))
    except (ValueError, KeyError, TypeError) as err:
        if isinstance(err, BinaryDataError):
            raise
        raise BinaryDataError(f"{path}: not a valid manifest ({type(err).__name__}: {err})") from None


def check_part_files(manifest: Manifest, part: str) -> list[str]:
    """Problems with one finished part's column files (missing, or sized unlike the manifest)."""
    entry, problems = manifest.parts[part], []
    rows = int(entry["rows"])
    for column in manifest.layout.columns():
        path = column_path(manifest.directory, part, column)
        want = rows * manifest.layout.row_bytes(column)
        if not path.is_file():
            problems.append(f"{path}: missing (the manifest lists {rows} rows, {want} bytes)")
            continue
        size = path.stat().st_size
        if size != want:
            problems.append(f"{path}: {size} bytes, but the manifest lists {rows} rows = {want} bytes "
                            f"({'truncated' if size < want else 'too long'})")
    return problems


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify_dataset(directory: str | Path, checksums: bool = True) -> list[str]:
    """Every problem of a dataset: unfinished parts, file sizes, and (``checksums``)
    column files whose SHA-256 differs from the manifest's."""
    manifest = read_manifest(directory)
    problems = [f"{p}: not converted yet (re-run `recpipe data convert`)" for p in manifest.missing]
    for source in manifest.sources:
        part = source["part"]
        if part not in manifest.parts:
            continue
        sized = check_part_files(manifest, part)
        problems += sized
        if checksums and not sized:
            for column, record in manifest.parts[part]["files"].items():
                path = column_path(directory, part, column)
                if file_sha256(path) != record["sha256"]:
                    problems.append(f"{path}: SHA-256 differs from the manifest's (corrupt)")
    return problems
