"""Criteo click-log TSV reader, split across ranks by batch.

Line format (Criteo Kaggle / Terabyte): ``label \\t D integer columns \\t F hex
columns`` with D = ``model.num_dense_features`` and F = ``len(model.
num_embeddings_per_feature)`` (13 and 26 for Criteo: 40 columns).

* label: ``0`` or ``1``.
* dense: empty -> 0; value ``log(1 + max(x, 0))`` (Criteo has -1/-2 counts).
* categorical: every sample has exactly one id per feature (length 1). Id 0 of
  each table is reserved for an empty field; a hex value ``v`` maps to
  ``1 + v mod (rows - 1)`` (all to 0 for a one-row table), so "missing" never
  shares a row with a real value.
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

from itertools import islice
from typing import Iterable, Iterator

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.config import RecpipeConfig
from recpipe.data.batch import Batch

__all__ = ["CriteoTsvReader", "parse_line"]

_Line = tuple[str, int, bytes]  # (file, 1-based line number, raw line)
_HEX_DIGITS = b"0123456789abcdefABCDEF"


def parse_line(
    raw: bytes, rows: list[int], num_dense: int, where: str
) -> tuple[float, list[int], list[int]]:
    """(label, dense ints clamped at 0, ids per feature) of one line; ``where`` = "file:line"."""
    fields = raw.rstrip(b"\r\n").split(b"\t")
    expected = 1 + num_dense + len(rows)
    if len(fields) != expected:
        raise ValueError(
            f"{where}: expected {expected} tab-separated columns (label, {num_dense} dense, "
            f"{len(rows)} categorical), got {len(fields)}"
        )
    if fields[0] not in (b"0", b"1"):
        raise ValueError(f"{where}: label must be 0 or 1, got {fields[0].decode(errors='replace')!r}")
    dense = []
    for j, field in enumerate(fields[1 : 1 + num_dense]):
        try:
            dense.append(max(int(field), 0) if field else 0)
        except ValueError:
            raise ValueError(
                f"{where}: dense column {j} (column {j + 2}) is not an integer: "
                f"{field.decode(errors='replace')!r}"
            ) from None
    ids = []
    for f, field in enumerate(fields[1 + num_dense :]):
        if not field:
            ids.append(0)
            continue
        if field.lstrip(_HEX_DIGITS):  # stricter than int(x, 16): no sign, space or "_"
            raise ValueError(
                f"{where}: categorical column {f} (column {f + 2 + num_dense}) is not hex: "
                f"{field.decode(errors='replace')!r}"
            )
        value = int(field, 16)
        ids.append(1 + value % (rows[f] - 1) if rows[f] > 1 else 0)
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
            with open(path, "rb") as fh:
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

    def __init__(self, cfg: RecpipeConfig, files: list[str], *, rank: int, world_size: int) -> None:
        self.files = list(files)
        self.rank = rank
        self.world_size = world_size
        self.batch_size = cfg.data.batch_size
        self.rows = list(cfg.model.num_embeddings_per_feature)
        self.num_dense = cfg.model.num_dense_features
        self.keys = cfg.model.feature_names

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
        bs, num_features = self.batch_size, len(self.rows)
        labels = [0.0] * bs
        dense = [[0] * self.num_dense for _ in range(bs)]
        ids = [[0] * bs for _ in range(num_features)]  # feature-major, like the KJT
        for s, (path, lineno, raw) in enumerate(lines):
            labels[s], dense[s], sample_ids = parse_line(raw, self.rows, self.num_dense, f"{path}:{lineno}")
            for f in range(num_features):
                ids[f][s] = sample_ids[f]
        weights = torch.zeros(bs)
        weights[: len(lines)] = 1.0
        kjt = KeyedJaggedTensor(
            keys=self.keys,
            values=torch.tensor(ids, dtype=torch.int64).flatten(),
            lengths=torch.ones(num_features * bs, dtype=torch.int32),
        )
        return Batch(
            dense_features=torch.tensor(dense, dtype=torch.float64).log1p_().float(),
            sparse_features=kjt,
            labels=torch.tensor(labels),
            weights=weights,
        )
