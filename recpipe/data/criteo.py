"""Criteo click-log TSV reader, split across ranks by batch.

Files are plain or gzip-compressed (told apart by their first bytes). Line format
(Criteo Kaggle / Terabyte): ``label \\t D integer columns \\t F hex columns`` with
D = ``model.num_dense_features`` and F = ``len(model.num_embeddings_per_feature)``
(13 and 26 for Criteo: 40 columns).

* label: ``0`` or ``1``.
* dense: empty -> 0; value ``log(1 + max(x, 0))`` (Criteo has -1/-2 counts),
  computed by ``recpipe.data.columns`` as for binary data.
* categorical: every sample has exactly one id per feature (length 1). Id 0 of
  each table is reserved for an empty field; a hex value ``v`` maps to
  ``1 + v mod (rows - 1)`` (all to 0 for a one-row table), so "missing" never
  shares a row with a real value. ``recpipe data convert --hashing torchrec`` uses
  TorchRec's rule instead (``parse_line(..., hashing="torchrec")``): ``v mod rows``,
  an empty field -> 0, the ids of ``torchrec.datasets.criteo`` (``int(v or "0", 16)``
  hashed ``% num_embeddings`` at load).
* multi-hot (``data.multi_hot_sizes``, ``h_f`` ids for feature f, as in the MLPerf
  DLRM-DCNv2 data): a categorical field holds exactly ``h_f`` comma-separated hex
  values, each mapped as above, or is empty (``h_f`` times id 0).
* A malformed line raises ``ValueError("<file>:<line>: <what is wrong>")`` with the
  1-based line number in that file.

Splitting: the train (or eval) files are one stream of lines, cut into global
batches of ``data.batch_size`` lines; rank ``r`` of ``world`` gets global batches
``r, r + world, ...``, i.e. its batch ``i`` is lines ``[(i*world + r)*B, +B)``.
Every rank has ``ceil(lines / (world * B))`` batches, all of ``B`` samples: the
samples past the end of the stream in the last global chunk are padding (dense 0,
id 0, label 0, weight 0), so every line is trained exactly once, by one rank, and
the sharded all-to-all always sees equal batch sizes. Batch ``i`` is found by
skipping lines without parsing them (resume, DataLoader workers); ``epoch`` does
not change the data (no shuffling).
"""

from __future__ import annotations

import gzip
import io
import zlib
from itertools import islice
from typing import Iterable, Iterator

import numpy as np

from recpipe.data.batch import Batch
from recpipe.data.columns import ColumnLayout
from recpipe.data.spec import DataSpec

__all__ = ["CriteoTsvReader", "Lines", "open_lines", "parse_line"]

_Line = tuple[str, int, bytes]  # (file, 1-based line number, raw line)
_HEX_DIGITS = b"0123456789abcdefABCDEF"
_INT64_MAX = 2**63 - 1


class Lines:
    """The lines of one plain or gzip file, iterated (or ``readline``), as a context
    manager. A damaged gzip stream (truncated, a failed CRC, corrupt data: ``EOFError``,
    ``gzip.BadGzipFile``, ``zlib.error``) is a ``ValueError`` naming the file and the line
    it stopped at, as a malformed line is, so that every reader reports it as bad data."""

    _DAMAGED = (EOFError, gzip.BadGzipFile, zlib.error)

    def __init__(self, path: str, stream: io.BufferedReader) -> None:
        self.path, self._stream, self._lineno = path, stream, 0

    def _damaged(self, err: Exception) -> ValueError:
        return ValueError(f"{self.path}:{self._lineno + 1}: the gzip data is damaged ({err})")

    def __iter__(self) -> Iterator[bytes]:
        try:
            for line in self._stream:
                self._lineno += 1
                yield line
        except self._DAMAGED as err:
            raise self._damaged(err) from None

    def readline(self) -> bytes:
        try:
            line = self._stream.readline()
        except self._DAMAGED as err:
            raise self._damaged(err) from None
        self._lineno += bool(line)
        return line

    def __enter__(self) -> "Lines":
        return self

    def __exit__(self, *exc: object) -> None:
        self._stream.close()


def open_lines(path: str, raw: io.RawIOBase | None = None) -> Lines:
    """The lines of a plain or gzip file (told apart by gzip's magic bytes, not the
    name). ``raw``: read the file's bytes through this stream instead of opening it."""
    with open(path, "rb") as fh:
        gzipped = fh.read(2) == b"\x1f\x8b"
    stream = raw if raw is not None else io.FileIO(path, "rb")
    if gzipped:
        stream = gzip.GzipFile(fileobj=io.BufferedReader(stream, 1 << 20), mode="rb")
    return Lines(path, io.BufferedReader(stream, 1 << 20))


_SHOWN = 40  # characters of a bad field an error message shows


def shown(field: bytes) -> str:
    """A field of a bad line as an error message shows it: its repr, at most ``_SHOWN``
    characters of it, and its length when cut (a field of 5 KB of null bytes is one line)."""
    text = repr(field.decode(errors="replace"))
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(field)} bytes)"


def _hex_id(field: bytes, rows: int, f: int, num_dense: int, where: str, hashing: str = "recpipe") -> int:
    if field.lstrip(_HEX_DIGITS):  # stricter than int(x, 16): no sign, space or "_"
        raise ValueError(f"{where}: categorical column {f} (column {f + 2 + num_dense}) is not hex: {shown(field)}")
    if hashing == "torchrec":
        return int(field, 16) % rows
    return 1 + int(field, 16) % (rows - 1) if rows > 1 else 0


def parse_line(
    raw: bytes, rows: list[int], num_dense: int, where: str, hotness: list[int] | None = None,
    hashing: str = "recpipe",
) -> tuple[float, list[int], list[int]]:
    """(label, dense ints clamped at 0, ids) of one line; ``where`` = "file:line".

    ``ids`` holds ``hotness[f]`` ids of feature f (default 1 each), features in order,
    hashed by recpipe's rule or (``hashing="torchrec"``) TorchRec's; an empty field
    is id 0 under both."""
    fields = raw.rstrip(b"\r\n").split(b"\t")
    expected = 1 + num_dense + len(rows)
    if len(fields) != expected:
        raise ValueError(
            f"{where}: expected {expected} tab-separated columns (label, {num_dense} dense, "
            f"{len(rows)} categorical), got {len(fields)}"
        )
    if fields[0] not in (b"0", b"1"):
        raise ValueError(f"{where}: label must be 0 or 1, got {shown(fields[0])}")
    dense = []
    for j, field in enumerate(fields[1 : 1 + num_dense]):
        try:
            dense.append(max(int(field), 0) if field else 0)
        except ValueError:
            raise ValueError(f"{where}: dense column {j} (column {j + 2}) is not an integer: {shown(field)}") from None
    ids: list[int] = []
    for f, field in enumerate(fields[1 + num_dense :]):
        h = 1 if hotness is None else hotness[f]
        if not field:
            ids.extend([0] * h)
        elif h == 1:
            ids.append(_hex_id(field, rows[f], f, num_dense, where, hashing))
        else:
            parts = field.split(b",")
            if len(parts) != h:
                raise ValueError(
                    f"{where}: categorical column {f} (column {f + 2 + num_dense}) has {len(parts)} ids, "
                    f"data.multi_hot_sizes[{f}]={h}"
                )
            ids.extend(_hex_id(part, rows[f], f, num_dense, where, hashing) for part in parts)
    return float(fields[0] == b"1"), dense, ids


class _LineCursor:
    """Forward-only cursor over the lines of several files, read as one stream."""

    def __init__(self, files: list[str]) -> None:
        self.position = 0  # global index of the next line to hand out
        self._lines = self._iter(files)
        self._peeked: _Line | None = None  # line ``position``, read ahead by skip_to

    @staticmethod
    def _iter(files: list[str]) -> Iterator[_Line]:
        for path in files:
            with open_lines(path) as fh:
                for lineno, raw in enumerate(fh, start=1):
                    yield path, lineno, raw

    def skip_to(self, line: int) -> bool:
        """Discard lines before global line ``line``; True iff line ``line`` exists."""
        if self.position < line and self._peeked is not None:
            self._peeked = None
            self.position += 1
        n = line - self.position
        if n > 0:
            consumed = sum(1 for _ in islice(self._lines, n))  # no parsing: cheap
            self.position += consumed
            if consumed < n:
                return False
        if self._peeked is None:
            self._peeked = next(self._lines, None)
        return self._peeked is not None

    def take(self, n: int) -> list[_Line]:
        lines = [self._peeked] if self._peeked is not None else []
        self._peeked = None
        lines.extend(islice(self._lines, n - len(lines)))
        self.position += len(lines)
        return lines


class CriteoTsvReader:
    """Rank ``rank``'s batches of ``files``; see the module docstring for the split."""

    def __init__(self, spec: DataSpec, files: list[str], *, rank: int, world_size: int) -> None:
        self.files = list(files)
        self.rank = rank
        self.world_size = world_size
        self.batch_size = spec.batch_size
        self.rows = list(spec.table_sizes)
        self.num_dense = spec.num_dense
        self.hotness = spec.hotness
        self.layout = ColumnLayout(spec.feature_names, self.hotness, self.num_dense)

    def batches(self, indices: Iterable[int]) -> Iterator[Batch]:
        """Batches at increasing ``indices``; stops at the first index past the data."""
        cursor = _LineCursor(self.files)
        bs, world = self.batch_size, self.world_size
        for i in indices:
            # A rank has batch i iff global chunk i has a line, even if its own
            # part of the chunk is all padding.
            if not cursor.skip_to(i * world * bs):
                return
            own_start = (i * world + self.rank) * bs
            lines = cursor.take(bs) if cursor.skip_to(own_start) else []
            yield self._parse(lines)

    def _parse(self, lines: list[_Line]) -> Batch:
        rows = []  # per line: label, dense counts, ids
        for path, lineno, raw in lines:
            label, dense, ids = parse_line(raw, self.rows, self.num_dense, f"{path}:{lineno}", self.hotness)
            if dense and max(dense) > _INT64_MAX:
                raise ValueError(f"{path}:{lineno}: a dense count exceeds {_INT64_MAX} (int64): {max(dense)}")
            rows.append([int(label), *dense, *ids])
        n = len(rows)
        table = np.array(rows, dtype=np.int64).reshape(n, 1 + self.num_dense + self.layout.ids_per_sample)
        start, columns = 1 + self.num_dense, []
        for h in self.hotness:
            columns.append(table[:, start : start + h])
            start += h
        return self.layout.build(table[:, 0], table[:, 1 : 1 + self.num_dense], columns, n, self.batch_size)
