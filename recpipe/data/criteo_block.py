"""Criteo TSV lines parsed a block at a time with numpy: the fast path of ``recpipe data convert``.

``parse_block`` gives, for a block of lines, the int64 table that ``parse_line`` gives line by
line (label, dense counts clamped at 0, one id per feature, hashed by recpipe's or TorchRec's
rule), or ``None`` when the block holds anything it does not handle exactly as ``parse_line``
does: a malformed line, a ``\\r``, a sign or space in a count, a hex id of more than 16 digits,
a count beyond int32. The caller then parses that block line by line, so every error message,
every ``--skip-malformed`` count and every value is ``parse_line``'s. One-hot features only.

The work is vectorised over the block: the separators (tab, newline) give each field's start
and end; each field's bytes, right-aligned in a fixed-width window, go through a lookup table
to digit values, and Horner's rule over the window's columns makes the numbers.
"""

from __future__ import annotations

import numpy as np

__all__ = ["parse_block"]

_INT32_MAX = 2**31 - 1
_BAD = 0xFF  # a byte that is no digit

# byte -> digit value. Tab and newline (never inside a field: a field shorter than the widest
# reads the separator before it) and "-" (a count's sign: where else it is, is checked) are 0.
_DIGITS = np.full(256, _BAD, dtype=np.uint8)
_DIGITS[np.frombuffer(b"0123456789abcdefABCDEF\t\n-", np.uint8)] = [*range(16), *range(10, 16), 0, 0, 0]
_HEX_WIDTH = 16  # digits of a uint64
_DEC_WIDTH = 10  # digits of int32's largest value


def _numbers(digits: np.ndarray, starts: np.ndarray, ends: np.ndarray, width: int, base: int) -> np.ndarray | None:
    """The unsigned numbers of the fields ``[starts, ends)`` of a block (empty: 0) as uint64,
    from its bytes' ``_DIGITS``; None if a field is longer than ``width`` or holds a byte
    that is no digit of ``base``."""
    longest = int((ends - starts).max(initial=0))
    if longest > width:
        return None
    values = np.zeros(starts.shape, dtype=np.uint64)
    largest = np.zeros(starts.shape, dtype=np.uint8)
    padding, at, position = starts - 1, ends - longest, np.empty_like(ends)
    for _ in range(longest):  # Horner's rule, the most significant column first
        np.maximum(at, padding, out=position)
        digit = digits[position]
        np.maximum(largest, digit, out=largest)
        values *= np.uint64(base)
        values += digit
        at += 1
    return None if (largest >= base).any() else values


def _dense(buf: np.ndarray, digits: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray | None:
    """Decimal counts, a leading ``-`` allowed (a negative count is 0), or None."""
    negative = (ends > starts) & (buf[starts] == ord("-"))
    digits_from = starts + negative
    if (negative & (digits_from == ends)).any():  # a lone "-"
        return None
    if np.count_nonzero(buf == ord("-")) != np.count_nonzero(negative):  # a "-" elsewhere
        return None
    values = _numbers(digits, digits_from, ends, _DEC_WIDTH, 10)
    if values is None or (values[~negative] > _INT32_MAX).any():
        return None
    return np.where(negative, 0, values).astype(np.int64)


def _ids(values: np.ndarray, empty: np.ndarray, rows: list[int], hashing: str) -> np.ndarray:
    """Hex values [n, F] hashed into each table; an empty field is id 0."""
    ids = np.empty(values.shape, dtype=np.int64)
    for f, r in enumerate(rows):
        v = values[:, f]
        if hashing == "torchrec":
            ids[:, f] = v % np.uint64(r)
        else:
            ids[:, f] = v % np.uint64(r - 1) + np.uint64(1) if r > 1 else 0
    ids[empty] = 0
    return ids


def parse_block(lines: list[bytes], rows: list[int], num_dense: int, hashing: str = "recpipe") -> np.ndarray | None:
    """int64 [len(lines), 1 + num_dense + len(rows)]: label, counts, ids, as ``parse_line`` gives
    them; None where the block needs ``parse_line`` (see the module docstring)."""
    n, columns = len(lines), 1 + num_dense + len(rows)
    data = b"".join(lines)
    if data and not data.endswith(b"\n"):
        data += b"\n"  # a file's last line may lack its newline
    if not n or b"\r" in data or data.count(b"\n") != n:
        return None
    buf = np.frombuffer(data, dtype=np.uint8)
    seps = np.flatnonzero((buf == ord("\t")) | (buf == ord("\n")))
    if len(seps) != n * columns:
        return None
    ends = seps.reshape(n, columns)
    if (buf[ends[:, -1]] != ord("\n")).any():  # a line of too few fields, the next of too many
        return None
    starts = np.empty_like(ends)
    starts[0, 0] = 0
    starts.reshape(-1)[1:] = seps[:-1] + 1
    labels = buf[starts[:, 0]] - ord("0")
    if (ends[:, 0] - starts[:, 0] != 1).any() or (labels > 1).any():
        return None
    digits = _DIGITS.take(buf)
    dense = _dense(buf, digits, starts[:, 1 : 1 + num_dense], ends[:, 1 : 1 + num_dense])
    cat_starts, cat_ends = starts[:, 1 + num_dense :], ends[:, 1 + num_dense :]
    hexes = _numbers(digits, cat_starts, cat_ends, _HEX_WIDTH, 16)
    if dense is None or hexes is None:
        return None
    table = np.empty((n, columns), dtype=np.int64)
    table[:, 0] = labels
    table[:, 1 : 1 + num_dense] = dense
    table[:, 1 + num_dense :] = _ids(hexes, cat_starts == cat_ends, rows, hashing)
    return table
