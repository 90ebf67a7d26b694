"""The binary click-log format written by ``recpipe data convert`` and read by
``data.source: binary``.

A dataset is a directory. Every converted TSV file (a *part*, named
``NNNNN-<file name>``, NNNNN its position on the command line) has one ``.npy`` file
per column: a 2-D C-order array of little-endian values, one row per TSV line,
self-describing (``numpy.load(path, mmap_mode="r")`` opens it):

=================  ==========================  ===================================
file               dtype, shape                content
=================  ==========================  ===================================
``P.labels.npy``   uint8 [rows, 1]             0 or 1
``P.dense.npy``    int32 [rows, D]             counts, negative ones clamped to 0
``P.cat_F.npy``    int32 [rows, h_F]           ids hashed into table F's rows
                                               (``hashing`` below; int64 when a
                                               table has more than 2**31 rows)
=================  ==========================  ===================================

The log1p of the counts is taken when batches are made (``recpipe.data.columns``),
so the files hold the data, not one model's transform of it.

``manifest.json`` names the layout (D, table sizes, hotness ``h_F`` per feature),
the id hashing (``recpipe``: hex ``v`` -> ``1 + v mod (rows - 1)``, an empty field
-> 0, the TSV reader's; ``torchrec``: ``v mod rows``, empty -> 0, the ids TorchRec's
Criteo tooling gives), the sources in row order, and for every finished part its row
count, the source's size, mtime and SHA-256, each column file's size and the SHA-256
of its array data (the bytes after the ``.npy`` header), and the malformed lines
that were skipped. A part is finished only once its entry is in the manifest, and
the entry is written last (after the column files are fsynced and renamed to their
final names), so an interrupted conversion never leaves a part that looks finished.
Opening a dataset checks every file's ``.npy`` header (dtype, shape) and size
against the manifest; the SHA-256s are checked by ``recpipe data verify``, which records
in ``verified.json`` the size and mtime of every file it found intact, so that
``recpipe train`` can say at its start when a dataset was never verified or a file was
written since (a stat per file; hashing every start would read the whole dataset).

Format version 1 (headerless ``P.<column>.bin`` files, the same arrays without the
``.npy`` header, ids always hashed by ``recpipe``) is still read as it is; a
conversion resumes only into a directory of the current version.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recpipe.data.spec import DataSpec
from recpipe.errors import DataError

__all__ = [
    "BinaryDataError",
    "FORMAT",
    "Layout",
    "MANIFEST",
    "Manifest",
    "VERIFIED",
    "HASHINGS",
    "check_part_files",
    "column_path",
    "npy_header",
    "open_column",
    "part_name",
    "read_manifest",
    "read_npy_header",
    "record_verified",
    "unverified",
    "verify_dataset",
    "write_npy_header",
    "write_json_atomic",
]

FORMAT, VERSION = "recpipe-binary", 2
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
# Beside the manifest: the size and mtime of every file `recpipe data verify` last found intact.
VERIFIED = "verified.json"
# Id hashing of a TSV hex field v into a table of ``rows`` rows (criteo.parse_line).
HASHINGS = {
    "recpipe": "hex v -> 1 + v mod (rows - 1), empty -> 0, one-row table -> 0",
    "torchrec": "hex v -> v mod rows, empty -> 0 (torchrec.datasets.criteo: int(v or '0', 16) % num_embeddings)",
}
_SUFFIX = {1: ".bin", 2: ".npy"}


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
    def from_spec(cls, spec: DataSpec) -> "Layout":
        """The layout a config's data has (``DataSpec.from_config(cfg)``)."""
        return cls(spec.num_dense, tuple(spec.table_sizes), tuple(spec.hotness))

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


def column_path(directory: str | Path, part: str, column: str, version: int = VERSION) -> Path:
    return Path(directory) / f"{part}.{column}{_SUFFIX[version]}"


def npy_header(path: Path) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """(dtype, shape, fortran_order, data offset) from a ``.npy`` file's header;
    ``ValueError`` if it has none."""
    with open(path, "rb") as fh:
        shape, fortran, dtype = read_npy_header(fh)
        return dtype, shape, fortran, fh.tell()


def read_npy_header(fh: Any) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran_order, dtype) of the ``.npy`` header at ``fh``'s position, which
    is left at the array data. Versions 1.0 and 2.0 (numpy writes 3.0 only for
    structured dtypes with non-Latin-1 field names)."""
    version = np.lib.format.read_magic(fh)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(fh)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(fh)
    raise ValueError(f".npy format version {version[0]}.{version[1]} is not read here (1.0 and 2.0 are)")


def write_npy_header(fh: Any, dtype: np.dtype, shape: tuple[int, ...]) -> int:
    """A ``.npy`` (1.0) header for a C-order array at the file position; its length.
    numpy pads it to 64 bytes, so any 2-D shape of up to 19-digit sizes gives the same
    length (128): the converter writes a placeholder first and the real row count last."""
    start = fh.tell()
    np.lib.format.write_array_header_1_0(fh, {"descr": np.lib.format.dtype_to_descr(dtype),
                                              "fortran_order": False, "shape": shape})
    return fh.tell() - start


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
    hashing: str = "recpipe"  # a key of HASHINGS
    version: int = VERSION

    @property
    def missing(self) -> list[str]:
        return [s["path"] for s in self.sources if s["part"] not in self.parts]

    def part_rows(self) -> list[tuple[str, int]]:
        return [(s["part"], int(self.parts[s["part"]]["rows"])) for s in self.sources]

    @property
    def num_rows(self) -> int:
        return sum(rows for _, rows in self.part_rows())

    def column_path(self, part: str, column: str) -> Path:
        return column_path(self.directory, part, column, self.version)

    def to_json(self) -> dict[str, Any]:
        assert self.version == VERSION, "only the current version is written"
        return {
            "format": FORMAT,
            "version": VERSION,
            "hashing": self.hashing,
            "hashing_rule": HASHINGS[self.hashing],
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
        version = raw.get("version")
        if raw.get("format") != FORMAT or version not in READABLE_VERSIONS:
            raise BinaryDataError(f"{path}: format {raw.get('format')!r} version {version!r}; this recpipe reads "
                                  f"{FORMAT!r} versions {', '.join(map(str, READABLE_VERSIONS))}")
        # Version 1 wrote a description of recpipe's hashing under "hashing".
        hashing = raw["hashing"] if version >= 2 else "recpipe"
        if hashing not in HASHINGS:
            raise BinaryDataError(f"{path}: unknown id hashing {hashing!r} (known: {', '.join(HASHINGS)})")
        sources, parts = raw["sources"], raw["parts"]
        if not (isinstance(sources, list) and all(isinstance(s, dict) and isinstance(s.get("path"), str)
                                                  and isinstance(s.get("part"), str) for s in sources)):
            raise BinaryDataError(f"{path}: not a valid manifest: 'sources' must be a list of "
                                  '{"path": ..., "part": ...} objects, one per input file')
        if not (isinstance(parts, dict) and all(isinstance(e, dict) and isinstance(e.get("rows"), int)
                                                and isinstance(e.get("files", {}), dict) for e in parts.values())):
            raise BinaryDataError(f"{path}: not a valid manifest: 'parts' must map each converted part to its "
                                  "entry ('rows', 'files')")
        return Manifest(d, Layout.from_json(raw["layout"]), list(sources), dict(parts), hashing, version)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        if isinstance(err, BinaryDataError):
            raise
        raise BinaryDataError(f"{path}: not a valid manifest ({type(err).__name__}: {err})") from None


def data_offset(manifest: Manifest, path: Path) -> int:
    """Where the array data starts in a column file (after the ``.npy`` header)."""
    return 0 if manifest.version == 1 else npy_header(path)[3]


def check_part_files(manifest: Manifest, part: str) -> list[str]:
    """Problems with one finished part's column files: missing, a ``.npy`` header
    unlike the manifest's dtype and shape, or a size unlike header + rows."""
    entry, problems = manifest.parts[part], []
    rows = int(entry["rows"])
    for column, (dtype, width) in manifest.layout.columns().items():
        path = manifest.column_path(part, column)
        data = rows * manifest.layout.row_bytes(column)
        if not path.is_file():
            problems.append(f"{path}: missing (the manifest lists {rows} rows, {data} bytes of data)")
            continue
        offset = 0
        if manifest.version >= 2:
            try:
                got_dtype, shape, fortran, offset = npy_header(path)
            except (ValueError, OSError) as err:  # numpy's own words: no magic string, a bad header, ...
                problems.append(f"{path}: not a readable .npy file ({err})")
                continue
            if (got_dtype, shape, fortran) != (dtype, (rows, width), False):
                problems.append(f"{path}: its .npy header says {got_dtype} {list(shape)}"
                                f"{' Fortran order' if fortran else ''}, the manifest {dtype} [{rows}, {width}]")
                continue
        size, want = path.stat().st_size, offset + data
        if size != want:
            what = f"{offset} header bytes + {rows} rows" if offset else f"{rows} rows"
            problems.append(f"{path}: {size} bytes, but the manifest lists {what} = {want} bytes "
                            f"({'truncated' if size < want else 'too long'})")
    return problems


def open_column(manifest: Manifest, part: str, column: str) -> np.ndarray:
    """A read-only memory map of one checked column file, as a plain [rows, width]
    ndarray view (numpy's memmap subclass adds Python work to every slice)."""
    dtype, width = manifest.layout.columns()[column]
    rows = int(manifest.parts[part]["rows"])
    if rows == 0:  # older numpy cannot map an empty array
        return np.empty((0, width), dtype=dtype)
    path = manifest.column_path(part, column)
    offset = data_offset(manifest, path)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(rows, width)).view(np.ndarray)


def file_sha256(path: Path, offset: int = 0, chunk: int = 1 << 22) -> str:
    """SHA-256 of a file's bytes from ``offset`` on."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        fh.seek(offset)
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def _file_states(manifest: Manifest) -> dict[str, list[int]]:
    """[size, mtime in ns] of the manifest and of every finished part's column files, by
    file name (a file that is gone: [-1, -1])."""
    paths = [manifest.directory / MANIFEST] + [manifest.column_path(part, column) for part in manifest.parts
                                               for column in manifest.layout.columns()]
    states = {}
    for path in paths:
        try:
            st = path.stat()
            states[path.name] = [st.st_size, st.st_mtime_ns]
        except OSError:
            states[path.name] = [-1, -1]
    return states


def record_verified(manifest: Manifest) -> bool:
    """Write ``VERIFIED``: the state of every file that ``recpipe data verify`` just found
    intact; False when the directory cannot be written (a read-only dataset)."""
    try:
        write_json_atomic(manifest.directory / VERIFIED, {"format": f"{FORMAT}-verified",
                                                          "files": _file_states(manifest)})
    except OSError:
        return False
    return True


def unverified(manifest: Manifest) -> str | None:
    """Why the dataset's checksums have not been checked since its files were last
    written (``VERIFIED`` is missing, or a file's size or mtime differs from it), or None.
    A stat per file: what every start can afford, where hashing cannot (docs/data.md)."""
    try:
        recorded = json.loads((manifest.directory / VERIFIED).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "its SHA-256 checksums were never checked"
    for name, state in _file_states(manifest).items():
        if recorded.get(name) != state:
            return f"{name} was written after `recpipe data verify` last checked it"
    return None


def verify_dataset(directory: str | Path, checksums: bool = True) -> list[str]:
    """Every problem of a dataset: unfinished parts, headers and file sizes, and
    (``checksums``) column files whose data's SHA-256 differs from the manifest's."""
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
                path = manifest.column_path(part, column)
                if file_sha256(path, data_offset(manifest, path)) != record["sha256"]:
                    problems.append(f"{path}: SHA-256 differs from the manifest's (corrupt)")
    return problems
