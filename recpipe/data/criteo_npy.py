"""``data.source: criteo_npy``: Criteo as TorchRec's and MLPerf DLRM-DCNv2's
preprocessing writes it, one set of ``.npy`` files per day, memory-mapped.

Each entry of ``data.npy.train`` / ``data.npy.eval`` is a day prefix P (e.g.
``/data/criteo/day_0``); the days' rows, in list order, form one stream, split over
ranks and shuffled exactly as the ``binary`` source's (``recpipe.data.mapped``):

=====================================  ==================  ============================
file                                   dtype, shape        used as
=====================================  ==================  ============================
``P_dense.npy``                        float [N, D]        the dense features as they
                                                           are (TorchRec's
                                                           ``tsv_to_npys`` stores them
                                                           log-transformed)
``P_labels.npy``                       int [N, 1] or [N]   labels, 0 or 1
``P_sparse.npy``                       int [N, F]          one id per feature: TorchRec's
                                                           raw ids (``int(v or "0",
                                                           16)``) or contiguous ids
``P_sparse_multi_hot.npz``             int [N, h_f] per    MLPerf's multi-hot ids
(with ``data.multi_hot_sizes``)        member ``"f.npy"``  (``np.savez``, uncompressed)
=====================================  ==================  ============================

(``data.npy.sparse_suffix`` names another sparse file, e.g. ``_sparse_contig_freq.npy``
as TorchRec's ``sparse_to_contiguous`` writes it.) Ids (``data.npy.ids``):
``modulo`` takes ``id % model.num_embeddings_per_feature[f]`` (numpy's, never
negative) when a batch is made, as TorchRec's ``InMemoryBinaryCriteoIterDataPipe`` and
MLPerf's ``MultiHotCriteoIterDataPipe`` do with ``hashes``; ``contiguous`` uses the
ids as they are and refuses a negative one or one beyond its table. A label other
than 0 or 1, or a dense value that is not finite, is an error naming the file and row.

Every file's ``.npy`` header (dtype, shape, C order) and row count is checked when
the data is opened (``recpipe train`` does it before any process starts), and an
``.npz`` member must be stored uncompressed (``np.savez``, not ``np.savez_compressed``:
a compressed member cannot be memory-mapped). The files have no checksums of their
own (TorchRec's tooling writes none).
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from recpipe.data.batch import Batch
from recpipe.data.binary_format import BinaryDataError, read_npy_header
from recpipe.data.columns import ColumnLayout
from recpipe.data.mapped import MappedPart, MappedRows, Slice, first_bad_row

__all__ = ["CriteoNpyDataset", "open_days", "sparse_suffix"]

_ZIP_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # the fixed 30 bytes of a zip local file header
_ZIP_LOCAL_SIGNATURE = b"PK\x03\x04"


def sparse_suffix(configured: str | None, multi_hot: bool) -> str:
    """The sparse file's name after the day prefix."""
    if configured is not None:
        return configured
    return "_sparse_multi_hot.npz" if multi_hot else "_sparse.npy"


def _check_array(path: str, shape: tuple[int, ...], fortran: bool, dtype: np.dtype, kind: str, width: int | None,
                 what: str) -> None:
    if fortran:
        raise BinaryDataError(f"{path}: a Fortran-order array; recpipe reads C-order rows (save it with np.save of "
                              "np.ascontiguousarray(a))")
    if dtype.kind not in kind:
        raise BinaryDataError(f"{path}: dtype {dtype}, expected {what}")
    if width is not None and (len(shape) != 2 or shape[1] != width):
        raise BinaryDataError(f"{path}: shape {list(shape)}, expected [rows, {width}] ({what})")


def _map_npy(path: Path, kind: str, width: int | None, what: str) -> np.ndarray:
    """A read-only [rows, width] map of a ``.npy`` file, header checked."""
    if not path.is_file():
        raise BinaryDataError(f"{path}: no such file ({what})")
    try:
        with open(path, "rb") as fh:
            shape, fortran, dtype = read_npy_header(fh)
            offset = fh.tell()
    except (ValueError, OSError) as err:
        raise BinaryDataError(f"{path}: not a readable .npy file ({err})") from None
    if width is None and len(shape) == 1:  # labels may be [N]
        shape = (shape[0], 1)
    _check_array(str(path), shape, fortran, dtype, kind, width if width is not None else 1, what)
    return _map(path, dtype, shape, offset)


def _map(path: Path, dtype: np.dtype, shape: tuple[int, ...], offset: int) -> np.ndarray:
    size = path.stat().st_size
    want = offset + int(np.prod(shape)) * dtype.itemsize
    if size < want:
        raise BinaryDataError(f"{path}: {size} bytes, but its header says {list(shape)} {dtype} from byte {offset} "
                              f"= {want} bytes (truncated)")
    if shape[0] == 0:  # older numpy cannot map an empty array
        return np.empty(shape, dtype=dtype)
    # A plain ndarray view: numpy's memmap subclass adds Python work to every slice.
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape).view(np.ndarray)


def _map_npz_members(path: Path, hotness: list[int]) -> dict[str, np.ndarray]:
    """``cat_f`` -> a map of member ``"f.npy"`` of an uncompressed ``.npz`` (MLPerf's
    multi-hot layout: one int array [rows, h_f] per feature)."""
    if not path.is_file():
        raise BinaryDataError(f"{path}: no such file (the multi-hot sparse ids, data.multi_hot_sizes is set)")
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as err:
        raise BinaryDataError(f"{path}: not a readable .npz file ({err})") from None
    arrays = {}
    with archive, open(path, "rb") as fh:
        for f, h in enumerate(hotness):
            member = f"{f}.npy"
            where = f"{path} member {member}"
            try:
                info = archive.getinfo(member)
            except KeyError:
                raise BinaryDataError(f"{path}: no member {member!r} (the ids of feature {f}); it has "
                                      f"{sorted(archive.namelist())[:8]}...") from None
            if info.compress_type != zipfile.ZIP_STORED:
                raise BinaryDataError(f"{where}: compressed, so it cannot be memory-mapped; save the file with "
                                      "np.savez, not np.savez_compressed")
            # The member's bytes start after its local header, whose name and extra
            # field lengths may differ from the central directory's.
            fh.seek(info.header_offset)
            fields = _ZIP_LOCAL_HEADER.unpack(fh.read(_ZIP_LOCAL_HEADER.size))
            if fields[0] != _ZIP_LOCAL_SIGNATURE:
                raise BinaryDataError(f"{where}: no zip local header at byte {info.header_offset}: the file is corrupt")
            fh.seek(info.header_offset + _ZIP_LOCAL_HEADER.size + fields[-2] + fields[-1])
            try:
                shape, fortran, dtype = read_npy_header(fh)
            except ValueError as err:
                raise BinaryDataError(f"{where}: not a readable .npy array ({err})") from None
            _check_array(where, shape, fortran, dtype, "i", h, f"signed int ids, data.multi_hot_sizes[{f}]={h} per row")
            arrays[f"cat_{f}"] = _map(path, dtype, shape, fh.tell())
    return arrays


def open_days(prefixes: list[str], *, num_dense: int, hotness: list[int], suffix: str, key: str) -> list[MappedPart]:
    """Maps of every day's files, headers and row counts checked; ``key`` names the
    config key the prefixes come from, for messages."""
    parts, start = [], 0
    if suffix.endswith(".npy") and any(h != 1 for h in hotness):
        raise BinaryDataError(f"{key}: the sparse files *{suffix} hold one id per feature, but data.multi_hot_sizes="
                              f"{hotness}; multi-hot ids come from MLPerf's *_sparse_multi_hot.npz "
                              "(data.npy.sparse_suffix)")
    for prefix in prefixes:
        dense_path, labels_path, sparse_path = (Path(prefix + s) for s in ("_dense.npy", "_labels.npy", suffix))
        arrays = {
            "dense": _map_npy(dense_path, "f", num_dense, f"float dense features, model.num_dense_features={num_dense}"),
            "labels": _map_npy(labels_path, "iub", None, "int labels, one per row"),
        }
        if suffix.endswith(".npz"):
            arrays.update(_map_npz_members(sparse_path, hotness))
        else:
            arrays["sparse"] = _map_npy(sparse_path, "i", len(hotness), "signed int ids, one per feature of "
                                        f"model.num_embeddings_per_feature ({len(hotness)})")
        rows = {name: a.shape[0] for name, a in arrays.items()}
        if len(set(rows.values())) != 1:
            raise BinaryDataError(f"{key}: the files of day {prefix!r} have different row counts: {rows}")
        paths = {name: sparse_path if name.startswith(("cat_", "sparse")) else Path(prefix + f"_{name}.npy")
                 for name in arrays}
        count = rows["dense"]
        parts.append(MappedPart(paths, start, count, arrays))
        start += count
    return parts


def _modulo(ids: np.ndarray, rows: np.ndarray | np.int64) -> np.ndarray:
    """``ids % rows`` (numpy's: never negative); ``rows`` one per column or one for all.

    Ids all inside the smallest of the tables (MLPerf's multi-hot files hold ids inside
    their table) are returned as they are: a min and a max cost a tenth of the division."""
    if ids.size == 0 or ids.min() >= 0 and ids.max() < np.min(rows):
        return ids
    if np.max(rows) <= np.iinfo(ids.dtype).max:  # int32 ids: int32 division, a fifth faster than int64
        rows = np.asarray(rows, dtype=ids.dtype)
    return np.remainder(ids, rows)


class CriteoNpyDataset:
    """One rank's batches of one split of ``.npy`` days (see the module docstring)."""

    def __init__(
        self,
        prefixes: list[str],
        *,
        key: str,
        keys: list[str],
        table_sizes: list[int],
        num_dense: int,
        hotness: list[int],
        sparse_suffix: str,
        ids: str,
        batch_size: int,
        rank: int,
        world_size: int,
        shuffle: bool = False,
        block_rows: int = 1024,
        seed: int = 0,
    ) -> None:
        parts = open_days(prefixes, num_dense=num_dense, hotness=hotness, suffix=sparse_suffix, key=key)
        self.rows = MappedRows(parts, batch_size=batch_size, rank=rank, world_size=world_size, shuffle=shuffle,
                               block_rows=block_rows, seed=seed)
        self.batch_size, self.ids, self.key = batch_size, ids, key
        self.table_sizes = np.asarray(table_sizes, dtype=np.int64)
        self.hotness = list(hotness)
        self.one_file = sparse_suffix.endswith(".npy")  # one [N, F] array, else one per feature
        self.columns = ColumnLayout(keys, hotness, num_dense)

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
        if self.one_file:
            raw = {"sparse": columns["sparse"]}
            limits = {"sparse": self.table_sizes[None, :]}
        else:
            raw = {f"cat_{f}": columns[f"cat_{f}"] for f in range(len(self.hotness))}
            limits = {name: self.table_sizes[f] for f, name in enumerate(raw)}
        if count:
            self._check(columns, raw, limits, slices)
        ids = {name: _modulo(a, limits[name]) if self.ids == "modulo" else a for name, a in raw.items()}
        per_feature = ids["sparse"] if self.one_file else [ids[f"cat_{f}"] for f in range(len(self.hotness))]
        return self.columns.build(columns["labels"][:, 0], columns["dense"], per_feature, count, self.batch_size,
                                  pin=pin, log1p=False, empty=empty)

    def _check(self, columns: dict[str, np.ndarray], raw: dict[str, np.ndarray], limits: dict, slices: list[Slice]) -> None:
        """Range checks of a batch; on failure, the file and row that is wrong."""
        checks = {
            "labels": (lambda v: (v != 0) & (v != 1), "labels 0 or 1"),
            "dense": (lambda v: ~np.isfinite(v).all(axis=1), "finite dense values"),
        }
        # modulo: every id hashes into its table, a negative one too (numpy's % as in
        # TorchRec; older torchrec stored raw ids as int32, wrapping those >= 2**31).
        for name, limit in limits.items() if self.ids == "contiguous" else ():
            checks[name] = (lambda v, limit=limit: ((v < 0) | (v >= limit)).any(axis=1),
                            "ids 0 .. table rows - 1 (data.npy.ids=contiguous)")
        for name, (bad, valid) in checks.items():
            values = columns[name] if name in ("labels", "dense") else raw[name]
            if values.size == 0 or not bad(values).any():
                continue
            found = first_bad_row(slices, name, bad)
            assert found is not None, f"range check of {name} failed but no row is out of range"
            part, row = found
            sizes = "" if name in ("labels", "dense") else f"; table rows {self.table_sizes.tolist()}"
            raise BinaryDataError(f"{part.path_of[name]}: row {row} holds {part.arrays[name][row].tolist()}, "
                                  f"outside the valid range ({valid}{sizes}) ({self.key})")
