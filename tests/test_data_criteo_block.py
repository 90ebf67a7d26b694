"""The block parser of ``recpipe data convert`` gives parse_line's values, or hands the block back."""

from __future__ import annotations

import numpy as np
import pytest

from recpipe.data import convert as convert_module
from recpipe.data.binary_format import Layout, read_manifest
from recpipe.data.spec import DataSpec
from recpipe.data.convert import convert
from recpipe.data.criteo import parse_line
from recpipe.data.criteo_block import parse_block
from test_data_binary import ROWS, config, random_lines, write

EDGE_LINES = [  # valid lines parse_block must parse as parse_line does
    "1" + "\t" * 17 + "\n",  # every field empty
    "0\t" + "\t".join(["2147483647", "-1", "-2147483649", "007", "0", "-0"] + ["1"] * 7) + "\t"
    + "\t".join(["ffffffffffffffff", "FFFFFFFFFFFFFFFF", "0", "00000000000000001"[1:]]) + "\n",
    "1\t" + "\t".join(["5"] * 13) + "\t" + "\t".join(["aBcDeF", "", "1", "7fffffffffffffff"]) + "\n",
]


def parsed_by_line(lines: list[bytes], hashing: str) -> np.ndarray:
    """What convert wrote before parse_block: parse_line, line by line."""
    rows = []
    for i, line in enumerate(lines):
        label, dense, ids = parse_line(line, ROWS, 13, f"x:{i + 1}", None, hashing)
        rows.append([int(label), *dense, *ids])
    return np.array(rows, dtype=np.int64)


@pytest.mark.parametrize("hashing", ["recpipe", "torchrec"])
def test_parse_block_gives_parse_lines_values(hashing):
    lines = [s.encode() for s in random_lines(500, 7) + EDGE_LINES]
    table = parse_block(lines, ROWS, 13, hashing)
    expected = parsed_by_line(lines, hashing)
    assert table is not None and table.dtype == np.int64
    np.testing.assert_array_equal(table, expected)
    last = lines[:-1] + [lines[-1].rstrip(b"\n")]  # a file's last line without its newline
    np.testing.assert_array_equal(parse_block(last, ROWS, 13, hashing), expected)


@pytest.mark.parametrize("change", [
    lambda f: f.__setitem__(0, "2"),  # label
    lambda f: f.__setitem__(0, ""),
    lambda f: f.__setitem__(3, "+5"),  # int() takes these; parse_line decides
    lambda f: f.__setitem__(3, " 5"),
    lambda f: f.__setitem__(3, "1_0"),
    lambda f: f.__setitem__(3, "-"),
    lambda f: f.__setitem__(3, "5-"),
    lambda f: f.__setitem__(3, "--5"),
    lambda f: f.__setitem__(3, "2147483648"),  # beyond int32
    lambda f: f.__setitem__(3, "00000000005"),  # eleven digits
    lambda f: f.__setitem__(15, "12g4"),
    lambda f: f.__setitem__(15, "-12"),
    lambda f: f.__setitem__(15, "1" * 17),  # beyond uint64's digits
    lambda f: f.insert(5, "1"),  # a column too many
    lambda f: f.pop(5),  # one too few
    lambda f: f.__setitem__(17, f[17] + "\r"),  # CRLF
], ids=["label 2", "no label", "+5", "space", "underscore", "lone minus", "minus after", "two minus",
        "beyond int32", "eleven digits", "not hex", "minus in id", "17 hex digits", "column too many",
        "column too few", "CRLF"])
def test_parse_block_hands_back_what_it_does_not_parse_as_parse_line(change):
    lines = random_lines(20, 3)
    fields = lines[11].rstrip("\n").split("\t")
    change(fields)
    lines[11] = "\t".join(fields) + "\n"
    assert parse_block([s.encode() for s in lines], ROWS, 13) is None


def test_a_line_too_short_and_one_too_long_are_handed_back():
    lines = random_lines(4, 5)
    a, b = lines[1].split("\t"), lines[2].split("\t")
    lines[1], lines[2] = "\t".join(a[:-1]) + "\n", "\t".join([*b[:-1], "7", b[-1]])  # same tabs in all
    assert parse_block([s.encode() for s in lines], ROWS, 13) is None


@pytest.mark.parametrize("suffix", [".tsv", ".tsv.gz"])
def test_convert_writes_parse_lines_arrays_across_blocks(tmp_path, monkeypatch, suffix):
    """Blocks parsed at once and blocks parsed line by line (one holds a line int() takes and
    the block parser does not), every array as parse_line makes it, every line number right."""
    monkeypatch.setattr(convert_module, "_CHUNK_ROWS", 16)
    lines = random_lines(100, 11)
    fields = lines[40].split("\t")
    fields[2] = "+3"
    lines[40] = "\t".join(fields)
    path = write(tmp_path / f"day{suffix}", lines)
    layout = Layout.from_spec(DataSpec.from_config(config("criteo_tsv", files=[path])))
    out = tmp_path / "bin"
    convert(layout, [str(path)], out, workers=1, progress=False)
    expected = parsed_by_line([s.encode() for s in lines], "recpipe")
    manifest = read_manifest(out)
    part = manifest.sources[0]["part"]
    got = [np.load(manifest.column_path(part, c)) for c in layout.columns()]
    np.testing.assert_array_equal(got[0], expected[:, :1])
    np.testing.assert_array_equal(got[1], expected[:, 1:14])
    for f, column in enumerate(got[2:]):
        np.testing.assert_array_equal(column, expected[:, 14 + f : 15 + f])
    assert all(a.dtype == np.dtype(d) for a, (d, _) in zip(got, layout.columns().values()))

    fields[2] = "x"
    lines[40] = "\t".join(fields)
    bad = write(tmp_path / f"bad{suffix}", lines)
    with pytest.raises(ValueError, match=r"bad\.tsv(\.gz)?:41: dense column 1 \(column 3\) is not an integer"):
        convert(layout, [str(bad)], tmp_path / "bin2", workers=1, progress=False)
