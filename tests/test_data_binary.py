"""Binary format: convert TSV (plain, gzip, multi-hot, malformed lines), read it back
bit-identical to the TSV reader, shuffle, resume, and refuse damaged data."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import re
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from recpipe.cli import main
from recpipe.config import ConfigError, load_config
from recpipe.data import make_dataloader, num_batches
from recpipe.data.binary_format import BinaryDataError, Layout, column_path, npy_header, read_manifest
from recpipe.data.spec import DataSpec
from recpipe.data.convert import convert
from recpipe.errors import DataError, data_errors, exit_code_of
from recpipe.exit_codes import EXIT_BAD_DATA, EXIT_OK
from test_checkpoint import _full_state  # every tensor of a DCP checkpoint, shards reassembled

ROWS = [7, 300, 1, 50000]  # a one-row table and one with ids beyond int16
HOT = [2, 1, 1, 3]


def random_lines(n: int, seed: int, hotness: list[int] | None = None) -> list[str]:
    """Valid Criteo-layout lines (4 features) with empty fields, negative and large
    counts, upper- and lower-case hex."""
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        dense = [rnd.choice(["", "-1", "-2", "0", str(rnd.randint(0, 9)), str(rnd.randint(0, 2**31 - 1))])
                 for _ in range(13)]
        cats = []
        for f in range(4):
            h = 1 if hotness is None else hotness[f]
            ids = [rnd.choice([format(rnd.getrandbits(32), "x"), format(rnd.getrandbits(40), "X")]) for _ in range(h)]
            cats.append("" if rnd.random() < 0.1 else ",".join(ids))
        out.append("\t".join([str(rnd.randint(0, 1)), *dense, *cats]) + "\n")
    return out


def write(path: Path, lines: list[str]) -> Path:
    data = "".join(lines).encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def config(source: str, *overrides: str, files=(), directory=None, batch_size: int = 16, hot: bool = False):
    return load_config(None, [
        f"model.num_embeddings_per_feature={ROWS}",
        f"data.batch_size={batch_size}",
        "data.num_workers=0",
        f"data.source={source}",
        *([f"data.criteo.train_files=[{','.join(map(str, files))}]"] if files else []),
        *([f"data.binary.train_dir={directory}"] if directory else []),
        *([f"data.multi_hot_sizes={HOT}"] if hot else []),
        *overrides,
    ])


def batches(cfg, *, rank=0, world_size=1, epoch=0, start_batch=0, split="train"):
    return list(make_dataloader(cfg, rank=rank, world_size=world_size, split=split, epoch=epoch, start_batch=start_batch))


def assert_same_batches(xs, ys) -> None:
    assert len(xs) == len(ys) > 0
    for i, (a, b) in enumerate(zip(xs, ys)):
        for name in ("dense_features", "labels", "weights"):
            assert torch.equal(getattr(a, name), getattr(b, name)), f"batch {i}: {name}"
        ka, kb = a.sparse_features, b.sparse_features
        assert ka.keys() == kb.keys(), f"batch {i}: keys"
        assert torch.equal(ka.values(), kb.values()) and ka.values().dtype == kb.values().dtype, f"batch {i}: ids"
        assert torch.equal(ka.lengths(), kb.lengths()) and ka.lengths().dtype == kb.lengths().dtype, f"batch {i}: lengths"


@pytest.fixture
def tsv_files(tmp_path):
    """Three files: plain, gzip, and an empty one between them."""
    return [write(tmp_path / "day_0.tsv", random_lines(45, 0)), write(tmp_path / "empty.tsv", []),
            write(tmp_path / "day_1.tsv.gz", random_lines(38, 1))]


def converted(tmp_path, files, hot=False, **kwargs):
    out = tmp_path / "bin"
    layout = Layout.from_spec(DataSpec.from_config(config("criteo_tsv", files=files, hot=hot)))
    report = convert(layout, [str(f) for f in files], out, progress=False, **kwargs)
    return out, report


# ------------------------------------------------------------------ convert
def test_convert_writes_parts_and_manifest(tmp_path, tsv_files):
    out, report = converted(tmp_path, tsv_files, workers=2)
    manifest = read_manifest(out)
    assert report.rows == manifest.num_rows == 83 and len(report.converted) == 3
    assert [rows for _, rows in manifest.part_rows()] == [45, 0, 38]
    assert manifest.layout.table_sizes == tuple(ROWS) and manifest.layout.hotness == (1, 1, 1, 1)
    first = manifest.sources[0]
    entry = manifest.parts[first["part"]]
    assert entry["source"]["sha256"] == hashlib.sha256(tsv_files[0].read_bytes()).hexdigest()
    # Self-describing arrays: numpy reads them without recpipe.
    labels = np.load(column_path(out, first["part"], "labels"))
    assert labels.dtype == np.uint8 and labels.shape == (45, 1)
    assert labels[:, 0].tolist() == [int(line[0]) for line in random_lines(45, 0)]
    cat3 = np.load(column_path(out, first["part"], "cat_3"), mmap_mode="r")
    assert cat3.dtype == np.dtype("<i4") and cat3.shape == (45, 1) and cat3.max() < ROWS[3]
    assert (np.load(column_path(out, first["part"], "cat_2")) == 0).all()
    assert np.load(column_path(out, first["part"], "dense")).shape == (45, 13)
    assert np.load(column_path(out, "00001-empty.tsv", "dense")).shape == (0, 13)
    assert manifest.version == 2 and manifest.hashing == "recpipe"
    again = convert(manifest.layout, [str(f) for f in tsv_files], out, progress=False)
    assert again.converted == [] and len(again.already) == 3


@pytest.mark.parametrize("world_size, batch_size", [(1, 16), (3, 8), (2, 20)])
def test_unshuffled_binary_equals_tsv_batches(tmp_path, tsv_files, world_size, batch_size):
    out, _ = converted(tmp_path, tsv_files)
    tsv = config("criteo_tsv", f"distributed.nproc={world_size}", files=tsv_files, batch_size=batch_size)
    binary = config("binary", f"distributed.nproc={world_size}", "data.num_workers=2", directory=out,
                    batch_size=batch_size)
    for rank in range(world_size):
        expected = batches(tsv, rank=rank, world_size=world_size)
        assert num_batches(binary, rank=rank, world_size=world_size, split="train") == len(expected)
        assert_same_batches(batches(binary, rank=rank, world_size=world_size), expected)
        assert_same_batches(batches(binary, rank=rank, world_size=world_size, start_batch=1), expected[1:])


def test_multi_hot_tsv_and_binary_agree(tmp_path):
    files = [write(tmp_path / "mh.tsv", random_lines(30, 2, HOT))]
    out, _ = converted(tmp_path, files, hot=True)
    tsv = config("criteo_tsv", files=files, hot=True)
    got = batches(config("binary", directory=out, hot=True))
    assert_same_batches(got, batches(tsv))
    kjt = got[0].sparse_features
    assert kjt["cat_0"].lengths().tolist() == [2] * 16 and kjt["cat_3"].lengths().tolist() == [3] * 16
    for b in got:  # made with its ids per key, as the lengths say
        assert b.sparse_features._length_per_key == b.sparse_features.lengths().view(4, -1).sum(dim=1).tolist()
    # The reader checks the dataset's layout against the config's.
    with pytest.raises(BinaryDataError, match=r"hotness \[2, 1, 1, 3\], data.multi_hot_sizes gives \[1, 1, 1, 1\]"):
        batches(config("binary", directory=out))


def test_multi_hot_field_with_wrong_count_names_file_and_line(tmp_path):
    lines = random_lines(5, 3, HOT)
    fields = lines[3].split("\t")
    fields[-1] = "a,b\n"
    lines[3] = "\t".join(fields)
    path = write(tmp_path / "mh.tsv", lines)
    with pytest.raises(ValueError, match=r"mh\.tsv:4: categorical column 3 .* has 2 ids, data.multi_hot_sizes\[3\]=3"):
        converted(tmp_path, [path], hot=True)


def test_malformed_line_is_an_error_or_skipped_and_reported(tmp_path, capsys):
    lines = random_lines(20, 4)
    lines[6] = lines[6].replace("\t", "\t\t", 1)  # 19 columns
    fields = lines[12].split("\t")
    fields[3] = "99999999999"  # a valid TSV count, too big for the binary format's int32
    lines[12] = "\t".join(fields)
    path = write(tmp_path / "bad.tsv.gz", lines)
    args = ["data", "convert", "--config", "-", "--out", str(tmp_path / "bin"), "--no-progress", str(path)]
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"# test\nmodel: {{num_embeddings_per_feature: {ROWS}}}\n")
    args[3] = str(cfg_file)
    assert main(args) == EXIT_BAD_DATA
    assert f"{path}:7: expected 18 tab-separated columns (label, 13 dense, 4 categorical), got 19" in capsys.readouterr().err
    assert not (tmp_path / "bin" / "manifest.json").read_text().count('"rows"')  # nothing recorded as done
    assert main(args[:-1] + ["--skip-malformed", "1", str(path)]) == EXIT_BAD_DATA
    assert "more than --skip-malformed=1 malformed lines" in capsys.readouterr().err
    assert main(args[:-1] + ["--skip-malformed", "2", str(path)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "18 rows in 1 parts" in out and "skipped 2 malformed lines" in out
    assert f"{path}:7: expected 18" in out
    assert f"{path}:13: dense column 2 (column 4) is 99999999999, beyond the binary format's int32 range" in out
    entry = next(iter(read_manifest(tmp_path / "bin").parts.values()))
    assert entry["skipped_malformed"] == 2 and len(entry["skipped_examples"]) == 2


def test_interrupted_convert_resumes_and_leaves_nothing_that_looks_finished(tmp_path, tsv_files, monkeypatch):
    import recpipe.data.convert as conv

    layout = Layout.from_spec(DataSpec.from_config(config("criteo_tsv", files=tsv_files)))
    sources = [str(f) for f in tsv_files]
    clean, _ = converted(tmp_path / "clean", tsv_files, workers=1)
    real = conv.convert_file

    def dies_on_the_third(task, on_bytes):
        if task.source.endswith("day_1.tsv.gz"):
            writer_files = list(tmp_path.glob("bin/*"))
            assert writer_files  # parts 0 and 1 are on disk
            raise KeyboardInterrupt  # like Ctrl-C in the middle of a file
        return real(task, on_bytes)

    monkeypatch.setattr(conv, "convert_file", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        convert(layout, sources, tmp_path / "bin", workers=1, progress=False)
    manifest = read_manifest(tmp_path / "bin")
    assert len(manifest.parts) == 2 and manifest.missing == [os.path.abspath(tsv_files[2])]
    with pytest.raises(BinaryDataError, match="conversion incomplete, 1 of 3 files not converted"):
        batches(config("binary", directory=tmp_path / "bin"))
    # A killed run (no cleanup) leaves temporary files and an unrecorded final file behind.
    (tmp_path / "bin" / ".00002-day_1.tsv.labels.npy.tmp-999").write_bytes(b"\x01" * 5)
    column_path(tmp_path / "bin", "00002-day_1.tsv", "dense").write_bytes(b"\x00" * 12)
    monkeypatch.setattr(conv, "convert_file", real)
    report = convert(layout, sources, tmp_path / "bin", workers=1, progress=False)
    assert report.converted == ["00002-day_1.tsv"] and len(report.already) == 2
    assert not list((tmp_path / "bin").glob(".*.tmp-*"))
    for part, _ in read_manifest(clean).part_rows():
        for column in layout.columns():
            assert column_path(tmp_path / "bin", part, column).read_bytes() == column_path(clean, part, column).read_bytes()


def test_convert_refuses_another_layout_or_changed_source(tmp_path, tsv_files):
    out, _ = converted(tmp_path, tsv_files)
    other = Layout(13, (7, 300, 1, 1000), (1, 1, 1, 1))
    with pytest.raises(BinaryDataError, match=r"holds another conversion.*table sizes \[7, 300, 1, 50000\]"):
        convert(other, [str(f) for f in tsv_files], out, progress=False)
    write(tsv_files[0], random_lines(46, 0))
    with pytest.raises(BinaryDataError, match=r"day_0\.tsv changed since it was converted"):
        convert(read_manifest(out).layout, [str(f) for f in tsv_files], out, progress=False)


def _as_format_version_1(out: Path) -> None:
    """Rewrite a converted dataset as format version 1 wrote it: headerless ``.bin``
    arrays, a manifest without the hashing name."""
    raw = json.loads((out / "manifest.json").read_text())
    for part in raw["parts"]:
        for column in raw["layout"]["columns"]:
            npy = column_path(out, part, column)
            column_path(out, part, column, version=1).write_bytes(np.load(npy).tobytes())
            npy.unlink()
    raw.update(version=1, hashing="criteo_tsv: hex v -> 1 + v mod (rows - 1), empty -> 0, one-row table -> 0")
    del raw["hashing_rule"]
    (out / "manifest.json").write_text(json.dumps(raw))


def test_format_version_1_datasets_are_still_read_and_verified(tmp_path, tsv_files, capsys):
    out, _ = converted(tmp_path, tsv_files)
    expected = batches(config("binary", "data.shuffle=true", "data.shuffle_block_rows=4", directory=out))
    _as_format_version_1(out)
    assert not list(out.glob("*.npy")) and read_manifest(out).version == 1
    assert_same_batches(batches(config("binary", "data.shuffle=true", "data.shuffle_block_rows=4", directory=out)), expected)
    assert main(["data", "verify", str(out)]) == EXIT_OK  # the checksums of the arrays' data hold for both
    assert "format version 1, ids hashed by recpipe's rule" in capsys.readouterr().out
    victim = column_path(out, "00002-day_1.tsv", "cat_1", version=1)
    victim.write_bytes(victim.read_bytes()[:-4])
    with pytest.raises(BinaryDataError, match=rf"{victim}: 148 bytes, but the manifest lists 38 rows = 152 bytes \(truncated\)"):
        batches(config("binary", directory=out))
    with pytest.raises(BinaryDataError, match="format version 1, which recpipe still reads as it is; a conversion writes "
                                              "version 2: use another --out"):
        convert(read_manifest(out).layout, [str(f) for f in tsv_files], out, progress=False)


def test_a_header_unlike_the_manifest_is_an_error_naming_the_file(tmp_path, tsv_files):
    out, _ = converted(tmp_path, tsv_files)
    victim = column_path(out, "00000-day_0.tsv", "dense")
    np.save(victim, np.load(victim).astype(np.int64))
    with pytest.raises(BinaryDataError, match=rf"{victim}: its .npy header says int64 \[45, 13\], the manifest int32 \[45, 13\]"):
        batches(config("binary", directory=out))
    victim.write_bytes(b"not an array")
    with pytest.raises(BinaryDataError, match=rf"{victim}: not a readable .npy file"):
        batches(config("binary", directory=out))


def test_torchrec_hashing_gives_torchrecs_ids_and_is_recorded(tmp_path, tsv_files, capsys):
    lines = random_lines(45, 0)
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"# test\nmodel: {{num_embeddings_per_feature: {ROWS}}}\n")
    out = tmp_path / "torchrec"
    assert main(["data", "convert", "--config", str(cfg_file), "--out", str(out), "--hashing", "torchrec",
                 "--no-progress", str(tsv_files[0])]) == EXIT_OK
    manifest = read_manifest(out)
    assert manifest.hashing == "torchrec" and "v mod rows" in json.loads((out / "manifest.json").read_text())["hashing_rule"]
    for f in range(4):
        # torchrec.datasets.criteo: int(v or "0", 16), then % num_embeddings when batches are made
        want = [int(line.rstrip("\n").split("\t")[14 + f] or "0", 16) % ROWS[f] for line in lines]
        assert np.load(column_path(out, manifest.sources[0]["part"], f"cat_{f}"))[:, 0].tolist() == want
    recpipe_ids = np.load(column_path(converted(tmp_path, tsv_files[:1])[0], "00000-day_0.tsv", "cat_3"))
    assert not np.array_equal(recpipe_ids, np.load(column_path(out, "00000-day_0.tsv", "cat_3")))
    with pytest.raises(BinaryDataError, match="ids hashed by torchrec's rule, this run hashes by recpipe's"):
        convert(manifest.layout, [str(tsv_files[0])], out, progress=False)


# ------------------------------------------------------------------ shuffle
def _row_ids(cfg, world_size, epoch, start_batch=0):
    """Per rank: the label-free identity of every real sample (its dense counts)."""
    out = []
    for rank in range(world_size):
        got = batches(cfg, rank=rank, world_size=world_size, epoch=epoch, start_batch=start_batch)
        out.append([tuple(b.dense_features[i].tolist()) for b in got for i in range(b.batch_size) if b.weights[i]])
    return out


def test_shuffle_is_a_permutation_per_epoch_and_resumes_exactly(tmp_path, tsv_files):
    out, _ = converted(tmp_path, tsv_files)
    plain = config("binary", "distributed.nproc=2", directory=out, batch_size=8)
    shuffled = config("binary", "distributed.nproc=2", "data.shuffle=true", "data.shuffle_block_rows=4",
                      "data.num_workers=2", directory=out, batch_size=8)
    reference = sorted(r for rank in _row_ids(plain, 2, 0) for r in rank)
    assert len(reference) == 83
    orders = []
    for epoch in range(3):
        per_rank = _row_ids(shuffled, 2, epoch)
        assert sorted(per_rank[0] + per_rank[1]) == reference  # every row once, on one rank
        orders.append(per_rank)
    assert orders[0] != orders[1] != orders[2] and orders[0] != _row_ids(plain, 2, 0)
    assert _row_ids(shuffled, 2, 1) == orders[1]  # deterministic in (seed, epoch)
    for rank in range(2):
        full = batches(shuffled, rank=rank, world_size=2, epoch=1)
        assert_same_batches(batches(shuffled, rank=rank, world_size=2, epoch=1, start_batch=3), full[3:])
    reseeded = config("binary", "distributed.nproc=2", "data.shuffle=true", "train.seed=5", directory=out, batch_size=8)
    assert _row_ids(reseeded, 2, 1) != orders[1]
    # The eval split is never shuffled.
    ev = config("binary", "data.shuffle=true", f"data.binary.eval_dir={out}", directory=out)
    assert_same_batches(batches(ev, split="eval", epoch=4), batches(config("binary", directory=out)))



@pytest.mark.parametrize("workers", [0, 2])
def test_a_shuffled_loader_spanning_epochs_is_the_loaders_per_epoch(tmp_path, tsv_files, workers):
    """One loader over epochs 1-3 of shuffled binary data from epoch 1's batch 3 (producer
    processes build them in their slots: make_into) gives each epoch's own order, bit for bit."""
    from recpipe.data.loader import epoch_batches

    out, _ = converted(tmp_path, tsv_files)
    cfg = config("binary", "distributed.nproc=2", "data.shuffle=true", "data.shuffle_block_rows=4",
                 f"data.num_workers={workers}", directory=out, batch_size=8)
    for rank in range(2):
        want = [batches(cfg, rank=rank, world_size=2, epoch=1, start_batch=3),
                batches(cfg, rank=rank, world_size=2, epoch=2), batches(cfg, rank=rank, world_size=2, epoch=3)]
        n = len(want[1])
        split = epoch_batches(make_dataloader(cfg, rank=rank, world_size=2, split="train", epoch=1, start_batch=3,
                                              epochs=3), n - 3, n)
        for epoch in want:
            assert_same_batches(list(next(split)), epoch)

def test_shuffle_needs_the_binary_source():
    with pytest.raises(ConfigError, match="data.shuffle=true needs data.source='binary'"):
        load_config(None, ["data.shuffle=true"])


# ------------------------------------------------------------- damaged data
def test_truncated_or_missing_file_is_an_error_naming_it_before_training(tmp_path, tsv_files, capsys):
    out, _ = converted(tmp_path, tsv_files)
    victim = column_path(out, "00002-day_1.tsv", "cat_1")
    victim.write_bytes(victim.read_bytes()[:-4])
    with pytest.raises(BinaryDataError, match=rf"{victim}: 276 bytes, but the manifest lists 128 header bytes \+ 38 rows = 280 bytes \(truncated\)"):
        make_dataloader(config("binary", directory=out), rank=0, world_size=1, split="train")
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"# test\nmodel: {{num_embeddings_per_feature: {ROWS}}}\ndata: {{source: binary, "
                        f"binary: {{train_dir: {out}}}}}\ntrain: {{device: cpu}}\n")
    assert main(["train", "--config", str(cfg_file)]) == EXIT_BAD_DATA  # before any process starts
    assert str(victim) in capsys.readouterr().err
    victim.unlink()
    assert main(["data", "verify", str(out)]) == EXIT_BAD_DATA
    assert f"{victim}: missing" in capsys.readouterr().err


def test_corrupt_contents_are_caught_by_range_checks_and_checksums(tmp_path, tsv_files, capsys):
    out, _ = converted(tmp_path, tsv_files)
    assert main(["data", "verify", str(out)]) == EXIT_OK
    assert "83 rows in 3 parts, sizes and SHA-256 as in the manifest" in capsys.readouterr().out
    victim = column_path(out, "00000-day_0.tsv", "cat_1")
    ids = np.load(victim, mmap_mode="r+")
    ids[20] = 300  # table t_cat_1 has 300 rows: ids 0..299
    ids.flush()
    del ids
    assert main(["data", "verify", str(out), "--sizes-only"]) == EXIT_OK
    assert main(["data", "verify", str(out)]) == EXIT_BAD_DATA
    assert f"{victim}: SHA-256 differs" in capsys.readouterr().err
    with pytest.raises(BinaryDataError, match=rf"{victim}: row 20 holds \[300\], outside the valid range of cat_1 \(ids 0..299\)"):
        batches(config("binary", directory=out))


def _flip_a_bit(path: Path) -> None:
    """Flip bit 1 of the first byte of the array data: a count of 0..3 stays one of 0..3, in range."""
    offset = npy_header(path)[3]
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ 0b10]))


def test_verify_says_its_problems_as_every_command_does(tmp_path, tsv_files, capsys):
    out, _ = converted(tmp_path, tsv_files)
    dense, ids = column_path(out, "00000-day_0.tsv", "dense"), column_path(out, "00002-day_1.tsv", "cat_1")
    _flip_a_bit(dense)
    assert main(["data", "verify", str(out)]) == EXIT_BAD_DATA
    corrupt = f"{dense}: SHA-256 differs from the manifest's (corrupt)"
    assert capsys.readouterr().err == f"recpipe data verify: {corrupt} [exit {EXIT_BAD_DATA}]\n"
    ids.unlink()
    assert main(["data", "verify", str(out)]) == EXIT_BAD_DATA
    missing = f"{ids}: missing (the manifest lists 38 rows, 152 bytes of data)"
    assert capsys.readouterr().err == f"recpipe data verify: {out}: 2 problems:\n  {corrupt}\n  {missing}\n[exit 5]\n"


def test_train_start_says_when_a_dataset_was_never_verified_or_written_since(tmp_path, tsv_files, monkeypatch):
    """Opening a dataset checks sizes and every batch's ranges, not the SHA-256s (which would
    read the whole dataset at every start): a bit flip within range trains silently unless
    `recpipe data verify` runs; the start of a run says when it has not since the files changed."""
    from recpipe.data import check_data

    monkeypatch.delenv("RANK", raising=False)
    out, _ = converted(tmp_path, tsv_files)
    cfg = config("binary", directory=out)
    with pytest.warns(UserWarning, match=re.escape(f"data.binary.train_dir={str(out)!r}: its SHA-256 checksums were "
                                                   f"never checked; `recpipe data verify {out}` checks every file")):
        check_data(cfg)
    assert main(["data", "verify", str(out)]) == EXIT_OK
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_data(cfg)  # verified and unchanged: nothing to say
    time.sleep(0.05)  # a later write: beyond the granularity of file timestamps (a kernel tick, 10 ms at most)
    dense = column_path(out, "00000-day_0.tsv", "dense")
    _flip_a_bit(dense)
    assert len(batches(cfg)) == 6  # every value in range: it would train
    with pytest.warns(UserWarning, match=re.escape(f"{dense.name} was written after `recpipe data verify` last "
                                                   "checked it")):
        check_data(cfg)
    assert main(["data", "verify", str(out)]) == EXIT_BAD_DATA


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_a_corrupt_batch_made_by_a_producer_is_raised_at_its_turn(tmp_path, tsv_files, kind):
    out, _ = converted(tmp_path, tsv_files)
    victim = column_path(out, "00000-day_0.tsv", "cat_1")
    ids = np.load(victim, mmap_mode="r+")
    ids[20] = 300  # row 20: batch 1 of 16 rows
    ids.flush()
    del ids
    it = data_errors(make_dataloader(config("binary", "data.num_workers=2", f"data.workers_kind={kind}", directory=out),
                                     rank=0, world_size=1, split="train"))
    assert next(it).batch_size == 16
    with pytest.raises(DataError, match=rf"bad training data: {victim}: row 20 holds \[300\], outside the valid range") as caught:
        next(it)
    assert type(caught.value.__cause__) is BinaryDataError and exit_code_of(caught.value) == EXIT_BAD_DATA


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("kind", ["process", "thread"])
def test_producers_make_the_inline_batches_bit_for_bit(tmp_path, tsv_files, kind, shuffle):
    out, _ = converted(tmp_path, tsv_files)
    common = ["distributed.nproc=2", f"data.shuffle={str(shuffle).lower()}", "data.shuffle_block_rows=4"]
    inline = config("binary", *common, directory=out, batch_size=8)
    made = config("binary", *common, "data.num_workers=2", f"data.workers_kind={kind}", directory=out, batch_size=8)
    for rank in range(2):
        for epoch, start in ((0, 0), (1, 2)):
            ref = batches(inline, rank=rank, world_size=2, epoch=epoch, start_batch=start)
            assert_same_batches(batches(made, rank=rank, world_size=2, epoch=epoch, start_batch=start), ref)


def test_layout_mismatch_names_both_values(tmp_path, tsv_files):
    out, _ = converted(tmp_path, tsv_files)
    cfg = load_config(None, ["model.num_embeddings_per_feature=[7, 300, 1, 1000]", "data.source=binary",
                             f"data.binary.train_dir={out}"])
    with pytest.raises(BinaryDataError, match=r"table sizes \[7, 300, 1, 50000\], model.num_embeddings_per_feature=\[7, 300, 1, 1000\]"):
        make_dataloader(cfg, rank=0, world_size=1, split="train")


# -------------------------------------------------------------------- bench
@pytest.mark.parametrize("source", ["synthetic", "criteo_tsv", "binary"])
def test_data_bench_prints_samples_per_second_last(tmp_path, tsv_files, source, capsys):
    out, _ = converted(tmp_path, tsv_files)
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"# test\nmodel: {{num_embeddings_per_feature: {ROWS}}}\ndata: {{batch_size: 16}}\n")
    sets = {"synthetic": [], "criteo_tsv": [f"data.criteo.train_files=[{tsv_files[0]}]"],
            "binary": [f"data.binary.train_dir={out}"]}[source]
    args = ["data", "bench", "--config", str(cfg_file), "--batches", "7", "--warmup", "2", "--set", f"data.source={source}"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == EXIT_OK
    last = capsys.readouterr().out.strip().splitlines()[-1]
    number, unit = last.split(" ")
    assert unit == "samples/s" and float(number) > 0


# ----------------------------------------------------------------- training
TRAIN = [
    "model.embedding_dim=8",
    "model.dense_arch_layer_sizes=[16, 8]",
    "model.over_arch_layer_sizes=[16, 1]",
    "sharding.tables={t_cat_3: {type: row_wise}}",
    "train.eval_every=0",
    "train.progress=false",
    "train.log_every=2",
    "distributed.nproc=2",
    "distributed.backend=gloo",
    "train.device=cpu",
    "checkpoint.keep=1",
]


def _train(tmp_path: Path, run: str, data: list[str], steps: int, every: int = 0) -> Path:
    cfg_file = tmp_path / "train.yaml"
    cfg_file.write_text(f"# test\nmodel: {{num_embeddings_per_feature: {ROWS}}}\ndata: {{batch_size: 16}}\n")
    sets = TRAIN + data + [f"train.steps={steps}", f"checkpoint.dir={tmp_path / run / 'ckpt'}",
                           f"checkpoint.every={every}", f"logging.run_dir={tmp_path / run}"]
    args = ["train", "--config", str(cfg_file)]
    for s in sets:
        args += ["--set", s]
    assert main(args) == EXIT_OK
    return tmp_path / run


def _final_state(run: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    (step,) = (p for p in (run / "ckpt").iterdir() if p.name.startswith("step_"))  # not the run lock
    return _full_state(step, tmp_path)


def _assert_same_state(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    assert sum(k.startswith("model.") and "embedding_bags" in k for k in a) == 4  # every table, shards reassembled
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{what}: {different}"


@pytest.mark.slow
def test_two_ranks_train_bit_identically_from_tsv_and_binary(tmp_path, tsv_files):
    out, _ = converted(tmp_path, tsv_files)
    files = ",".join(map(str, tsv_files))
    # 83 rows, 2 ranks x 16: 3 batches per rank and epoch, the last one part padding.
    common = ["train.epochs=2"]
    tsv = _train(tmp_path, "tsv", common + ["data.source=criteo_tsv", f"data.criteo.train_files=[{files}]",
                                            f"data.criteo.eval_files=[{tsv_files[0]}]", "data.num_workers=1"], 100)
    binary = _train(tmp_path, "binary", common + ["data.source=binary", f"data.binary.train_dir={out}",
                                                  f"data.binary.eval_dir={converted(tmp_path / 'ev', tsv_files[:1])[0]}",
                                                  "data.num_workers=2"], 100)
    summaries = [json.loads((run / "summary.json").read_text()) for run in (tsv, binary)]
    assert summaries[0]["steps"] == summaries[1]["steps"] == 6
    for key in ("loss", "eval_auc", "eval_logloss"):
        assert summaries[0][key] == summaries[1][key], key
    _assert_same_state(_final_state(tsv, tmp_path), _final_state(binary, tmp_path), "binary vs TSV")


def test_no_eval_data_names_the_key_of_the_configured_source(tmp_path, tsv_files):
    from recpipe.data import no_eval_data

    out, _ = converted(tmp_path, tsv_files)
    empty, _ = converted(tmp_path / "empty", [tsv_files[1]])  # the empty file: a dataset of 0 rows
    no_dir = config("binary", directory=out)
    no_rows = config("binary", f"data.binary.eval_dir={empty}", directory=out)
    tsv = config("criteo_tsv", files=tsv_files)
    for cfg, why in ((no_dir, "data.binary.eval_dir is not set"), (no_rows, f"data.binary.eval_dir={str(empty)!r} holds no rows"),
                     (tsv, "data.criteo.eval_files is empty")):
        assert num_batches(cfg, rank=0, world_size=1, split="eval") == 0
        assert no_eval_data(cfg.data) == why


@pytest.mark.slow
def test_shuffled_binary_training_resumes_bit_identically(tmp_path, tsv_files, capfd):
    import shutil

    out, _ = converted(tmp_path, tsv_files)
    data = ["data.source=binary", f"data.binary.train_dir={out}", "data.shuffle=true", "data.shuffle_block_rows=4",
            "train.epochs=3", "checkpoint.keep=2"]
    straight = _train(tmp_path, "straight", data, 8, every=4)  # saves steps 4 and 8
    assert "no eval data (data.binary.eval_dir is not set): evaluation is skipped" in capfd.readouterr().out
    # Resume from the straight run's step 4: inside epoch 1 (3 steps per epoch), batch 1.
    (tmp_path / "resumed" / "ckpt").mkdir(parents=True)
    shutil.copytree(straight / "ckpt" / "step_00000004", tmp_path / "resumed" / "ckpt" / "step_00000004")
    meta = json.loads((straight / "ckpt" / "step_00000004" / "metadata.json").read_text())
    assert (meta["epoch"], meta["batch"]) == (1, 1)
    resumed = _train(tmp_path, "resumed", data, 8, every=4)
    a = _full_state(straight / "ckpt" / "step_00000008", tmp_path)
    b = _full_state(resumed / "ckpt" / "step_00000008", tmp_path)
    _assert_same_state(a, b, "resumed vs straight")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["process", "thread"])
@pytest.mark.parametrize("source", ["synthetic", "binary"])
def test_cuda_batches_are_pinned_by_the_producers_and_copy_exactly(tmp_path, tsv_files, source, kind):
    out, _ = converted(tmp_path, tsv_files)
    directory = out if source == "binary" else None
    cfg = config(source, "data.num_workers=2", f"data.workers_kind={kind}", "data.pin_memory=true",
                 "data.synthetic.num_batches=12", directory=directory, batch_size=8)
    plain = config(source, "data.pin_memory=false", "data.synthetic.num_batches=12", directory=directory, batch_size=8)
    # The copies wait behind a long kernel while each pinned batch is dropped at once:
    # its memory must not be reused (by the loader's next batches) before its copy ran.
    torch.cuda._sleep(1_000_000_000)
    on_gpu = []
    for pinned in make_dataloader(cfg, rank=0, world_size=1, split="train"):
        tensors = [pinned.dense_features, pinned.labels, pinned.weights, pinned.sparse_features.values(),
                   pinned.sparse_features.lengths()]
        assert all(t.is_pinned() for t in tensors)
        on_gpu.append(pinned.to(torch.device("cuda"), non_blocking=True))
    torch.cuda.synchronize()
    assert_same_batches([b.to(torch.device("cpu")) for b in on_gpu], batches(plain))


def test_data_bench_times_after_what_the_producers_made_ahead(tmp_path, capsys):
    """The default warm-up is what the loader holds made ahead (each producer's slots and the one
    it is making, the ready queue) plus 5: the rate is a sustained one, not a drained queue's."""
    from recpipe.data.cli import made_ahead
    from recpipe.data.processes import READY, SLOTS

    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"# test\nmodel: {{num_embeddings_per_feature: {ROWS}}}\ndata: {{batch_size: 16, num_workers: 2}}\n")
    assert made_ahead(load_config(str(cfg_file))) == 2 * (SLOTS + 1) + READY
    assert main(["data", "bench", "--config", str(cfg_file), "--batches", "6"]) == EXIT_OK
    out = capsys.readouterr().out.strip().splitlines()
    assert f"{2 * (SLOTS + 1) + READY + 5} untimed, then 6 batches" in out[-4] and "second half (sustained)" in out[-2]
    assert out[-1].endswith(" samples/s")


@pytest.mark.parametrize("workers", [0, 1])
def test_data_bench_counts_the_producer_processes_cpu(tmp_path, capsys, workers):
    """The producers' CPU is reported per batch and added into the CPU per sample."""
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"# test\nmodel: {{num_embeddings_per_feature: {ROWS}}}\ndata: {{batch_size: 64, num_workers: {workers}}}\n")
    assert main(["data", "bench", "--config", str(cfg_file), "--batches", "40", "--warmup", "2"]) == EXIT_OK
    cpu, total = capsys.readouterr().out.strip().splitlines()[-3:-1]
    this, _, rest = cpu.partition("this process (the training process's share) ")[2].partition(" ms")
    per_sample = float(total.split(" us of CPU per sample")[0].split()[-1])
    if workers:
        producers = float(rest.split("worker processes ")[1].split(" ms")[0])
        assert producers > 0  # making a batch costs its producer CPU, counted once the producers are reaped
        assert per_sample > float(this) * 1e3 / 64
    else:
        assert "no worker processes" in rest
        assert per_sample == pytest.approx(float(this) * 1e3 / 64, abs=0.006 * 1e3 / 64)  # "this" has 2 decimals
