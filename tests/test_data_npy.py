"""``data.source: criteo_npy``: TorchRec's ``.npy`` days written by torchrec's own
``BinaryCriteoUtils.tsv_to_npys`` give the batches of TorchRec's
``InMemoryBinaryCriteoIterDataPipe``; MLPerf's multi-hot ``.npz``; contiguous ids;
recpipe's split, shuffle and resume; damaged files named before training."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from recpipe.cli import main
from recpipe.config import ConfigError, load_config
from recpipe.data import make_dataloader, num_batches
from recpipe.data.binary_format import BinaryDataError, column_path, read_manifest
from recpipe.exit_codes import EXIT_BAD_DATA, EXIT_OK

ROOT = Path(__file__).resolve().parents[1]
# 26 tables of different sizes, so that a feature read from the wrong column shows.
SIZES = [97 + 13 * f for f in range(26)]
DAY_ROWS = [150, 100]  # a batch spans the day boundary; 250 rows leave a partial last batch


def _synthetic_tsv():
    spec = importlib.util.spec_from_file_location("synthetic_tsv", ROOT / "scripts" / "synthetic_tsv.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _edge_cases(path: Path) -> None:
    """Empty dense and categorical fields and negative counts in a few lines, as Criteo has."""
    lines = path.read_text().splitlines(keepends=True)
    for i in range(0, len(lines), 7):
        fields = lines[i].rstrip("\n").split("\t")
        fields[1 + i % 13] = ["", "-1", "-2"][i % 3]
        fields[14 + i % 26] = ""
        lines[i] = "\t".join(fields) + "\n"
    path.write_text("".join(lines))


@pytest.fixture(scope="module")
def days(tmp_path_factory) -> dict:
    """TSV days from the synthetic log (ids drawn from 10^6-row tables, so hashing
    matters), converted by torchrec's own tsv_to_npys."""
    from torchrec.datasets.criteo import BinaryCriteoUtils

    root = tmp_path_factory.mktemp("criteo")
    gen = load_config(None, [f"model.num_embeddings_per_feature={[10**6] * 26}", "data.batch_size=64"])
    tsv = _synthetic_tsv()
    prefixes, files = [], []
    for d, rows in enumerate(DAY_ROWS):
        path = root / f"day_{d}.tsv"
        tsv.write_file(gen, path, rows, d, "train")
        _edge_cases(path)
        prefix = root / f"day_{d}"
        BinaryCriteoUtils.tsv_to_npys(str(path), f"{prefix}_dense.npy", f"{prefix}_sparse.npy", f"{prefix}_labels.npy")
        prefixes.append(str(prefix))
        files.append(path)
    return {"root": root, "prefixes": prefixes, "tsv": files}


def config(prefixes, *overrides: str, batch_size: int = 16):
    return load_config(None, [
        f"model.num_embeddings_per_feature={SIZES}",
        f"data.batch_size={batch_size}",
        "data.num_workers=0",
        "data.source=criteo_npy",
        f"data.npy.train=[{','.join(prefixes)}]",
        *overrides,
    ])


def batches(cfg, *, rank=0, world_size=1, epoch=0, start_batch=0, split="train"):
    return list(make_dataloader(cfg, rank=rank, world_size=world_size, split=split, epoch=epoch, start_batch=start_batch))


def _real(batch):
    """(ids [n, 26] feature-major per sample, dense [n, 13], labels [n]) of the real samples."""
    n = int(batch.weights.sum())
    ids = batch.sparse_features.values().view(26, -1).T[:n]
    return ids, batch.dense_features[:n], batch.labels[:n]


def _torchrec_batches(prefixes, rank, world_size, batch_size):
    from torchrec.datasets.criteo import InMemoryBinaryCriteoIterDataPipe

    pipe = InMemoryBinaryCriteoIterDataPipe(
        "train", [f"{p}_dense.npy" for p in prefixes], [f"{p}_sparse.npy" for p in prefixes],
        [f"{p}_labels.npy" for p in prefixes], batch_size=batch_size, rank=rank, world_size=world_size, hashes=SIZES,
    )
    return list(pipe), pipe.num_full_batches


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_batches_equal_torchrecs_in_memory_datapipe(days, world_size):
    B = 16
    cfg = config(days["prefixes"], f"distributed.nproc={world_size}", batch_size=B)
    ours, theirs, full = {}, {}, None
    for rank in range(world_size):
        ours[rank] = batches(cfg, rank=rank, world_size=world_size)
        theirs[rank], full = _torchrec_batches(days["prefixes"], rank, world_size, B)
        assert num_batches(cfg, rank=rank, world_size=world_size, split="train") == len(ours[rank]) == -(-250 // (world_size * B))
    tail_ours, tail_theirs = [], []
    for g in range(-(-250 // B)):  # global batches in stream order
        rank, i = g % world_size, g // world_size
        if g < full:  # TorchRec's full batches: the same rows, ids, dense, labels
            ids, dense, labels = _real(ours[rank][i])
            t = theirs[rank][i]
            assert len(labels) == B and t.labels.shape == (B,)
            assert torch.equal(ids, t.sparse_features.values().view(26, -1).T), f"batch {g}: ids"
            assert t.sparse_features.keys() == ours[rank][i].sparse_features.keys()
            assert torch.equal(dense, t.dense_features), f"batch {g}: dense"
            assert torch.equal(labels, t.labels.float()), f"batch {g}: labels"
        else:  # the partial last global batch: TorchRec splits it evenly, recpipe in order and pads
            tail_ours.append(_real(ours[rank][i]))
    for rank in range(world_size):
        tail_theirs += [(b.sparse_features.values().view(26, -1).T, b.dense_features, b.labels.float())
                        for b in theirs[rank][full // world_size :]]
    for k in range(3):
        a = torch.cat([x[k] for x in tail_ours]) if tail_ours else None
        b = torch.cat([x[k] for x in tail_theirs]) if tail_theirs else None
        assert (a is None and b is None) or torch.equal(a, b)
    assert sum(len(x[2]) for x in tail_ours) == 250 - full * B


def test_torchrec_hashing_of_recpipe_convert_gives_the_same_ids(days, tmp_path):
    """`recpipe data convert --hashing torchrec` of the same TSV: TorchRec's ids."""
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"# test\nmodel: {{num_embeddings_per_feature: {SIZES}}}\n")
    out = tmp_path / "bin"
    assert main(["data", "convert", "--config", str(cfg_file), "--out", str(out), "--hashing", "torchrec",
                 "--no-progress", "--workers", "1", *map(str, days["tsv"])]) == EXIT_OK
    binary = load_config(None, [f"model.num_embeddings_per_feature={SIZES}", "data.batch_size=16", "data.num_workers=0",
                                "data.source=binary", f"data.binary.train_dir={out}"])
    for a, b in zip(batches(binary), batches(config(days["prefixes"])), strict=True):
        assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
        assert torch.equal(a.labels, b.labels) and torch.equal(a.weights, b.weights)
    assert read_manifest(out).hashing == "torchrec"
    assert np.load(column_path(out, read_manifest(out).sources[0]["part"], "cat_0")).max() < SIZES[0]


def test_shuffle_is_a_permutation_and_resumes_exactly_with_producers(days):
    common = ["distributed.nproc=2", "data.shuffle=true", "data.shuffle_block_rows=8"]
    inline = config(days["prefixes"], *common)
    made = config(days["prefixes"], *common, "data.num_workers=2", "data.workers_kind=process")
    plain = config(days["prefixes"], "distributed.nproc=2")

    def rows(cfg, epoch):
        return sorted(tuple(x.tolist()) for r in range(2) for b in batches(cfg, rank=r, world_size=2, epoch=epoch)
                      for x in _real(b)[0])

    assert rows(inline, 0) == rows(plain, 0) and len(rows(plain, 0)) == 250  # every row once, on one rank
    for rank in range(2):
        first = batches(inline, rank=rank, world_size=2, epoch=1)
        assert [b.labels.tolist() for b in first] != [b.labels.tolist() for b in batches(plain, rank=rank, world_size=2)]
        for got, want in zip(batches(made, rank=rank, world_size=2, epoch=1, start_batch=3), first[3:], strict=True):
            assert torch.equal(got.sparse_features.values(), want.sparse_features.values())
            assert torch.equal(got.dense_features, want.dense_features) and torch.equal(got.labels, want.labels)
    # The eval split is never shuffled.
    ev = config(days["prefixes"], "data.shuffle=true", f"data.npy.eval=[{days['prefixes'][0]}]")
    ev_batches = batches(ev, split="eval", epoch=3)
    assert torch.equal(ev_batches[0].labels, batches(config(days["prefixes"]))[0].labels)
    assert len(ev_batches) == -(-150 // 16)


def _multi_hot(root: Path, hotness: list[int], compressed: bool = False) -> str:
    """An MLPerf-style day: dense and labels as TorchRec writes them, the ids in
    ``day_0_sparse_multi_hot.npz`` (member "f.npy": int32 [rows, h_f], as
    materialize_synthetic_multihot_dataset.py saves them)."""
    rng = np.random.default_rng(0)
    prefix = root / "mh" / "day_0"
    prefix.parent.mkdir(exist_ok=True)
    np.save(f"{prefix}_dense.npy", rng.random((40, 13), dtype=np.float32))
    np.save(f"{prefix}_labels.npy", rng.integers(0, 2, (40, 1), dtype=np.int32))
    members = {str(f): rng.integers(0, 3 * SIZES[f], (40, h), dtype=np.int32) for f, h in enumerate(hotness)}
    (np.savez_compressed if compressed else np.savez)(f"{prefix}_sparse_multi_hot.npz", **members)
    return str(prefix)


def test_mlperf_multi_hot_npz_is_memory_mapped_and_hashed(tmp_path):
    hotness = [1 + f % 4 for f in range(26)]
    prefix = _multi_hot(tmp_path, hotness)
    cfg = config([prefix], f"data.multi_hot_sizes={hotness}")
    got = batches(cfg)
    members = np.load(f"{prefix}_sparse_multi_hot.npz")
    for i, b in enumerate(got):
        n = int(b.weights.sum())
        kjt = b.sparse_features
        for f, h in enumerate(hotness):
            assert kjt[f"cat_{f}"].lengths().tolist() == [h] * 16
            want = members[str(f)][i * 16 : i * 16 + n] % SIZES[f]  # MLPerf's `feats % hash`
            assert kjt[f"cat_{f}"].values().view(16, h)[:n].tolist() == want.tolist()
    # The wrong hotness, a one-id .npy for multi-hot data, a compressed archive: errors naming the file.
    wrong = list(hotness)
    wrong[5] += 1
    with pytest.raises(BinaryDataError, match=r"member 5.npy: shape \[40, 2\], expected \[rows, 3\] .*multi_hot_sizes\[5\]=3"):
        batches(config([prefix], f"data.multi_hot_sizes={wrong}"))
    with pytest.raises(BinaryDataError, match=r"sparse files \*_sparse.npy hold one id per feature"):
        batches(config([prefix], f"data.multi_hot_sizes={hotness}", "data.npy.sparse_suffix=_sparse.npy"))
    (tmp_path / "z").mkdir()
    packed = _multi_hot(tmp_path / "z", hotness, compressed=True)
    with pytest.raises(BinaryDataError, match="member 0.npy: compressed, so it cannot be memory-mapped; .*np.savez"):
        batches(config([packed], f"data.multi_hot_sizes={hotness}"))
    assert zipfile.is_zipfile(f"{prefix}_sparse_multi_hot.npz")


def _day(root: Path, ids: np.ndarray, labels=None, dense=None) -> str:
    prefix = root / "day_9"
    rows = len(ids)
    np.save(f"{prefix}_dense.npy", np.ones((rows, 13), np.float32) if dense is None else dense)
    np.save(f"{prefix}_labels.npy", np.zeros((rows, 1), np.int32) if labels is None else labels)
    np.save(f"{prefix}_sparse.npy", ids)
    return str(prefix)


def test_contiguous_ids_are_used_as_they_are_and_checked(tmp_path):
    ids = np.tile(np.arange(26, dtype=np.int64), (20, 1)) + np.arange(20)[:, None]  # row r, feature f: r + f
    prefix = _day(tmp_path, ids)
    got = batches(config([prefix], "data.npy.ids=contiguous"))
    assert torch.equal(_real(got[0])[0], torch.from_numpy(ids[:16]))
    ids[17, 3] = SIZES[3]  # one past table t_cat_3
    prefix = _day(tmp_path, ids)
    with pytest.raises(BinaryDataError, match=rf"day_9_sparse.npy: row 17 holds .*outside the valid range \(ids 0 .. "
                                              rf"table rows - 1 \(data.npy.ids=contiguous\)"):
        batches(config([prefix], "data.npy.ids=contiguous"))
    assert len(batches(config([prefix]))) == 2  # modulo: hashed into the table


def test_bad_values_and_headers_are_errors_naming_the_file(tmp_path, capsys):
    ids = np.zeros((20, 26), np.int32)
    ids[4, 0] = -3  # older torchrec stored raw ids as int32: those >= 2**31 wrapped to negative values
    assert _real(batches(config([_day(tmp_path, ids)]))[0])[0][4, 0] == -3 % SIZES[0]  # numpy's %, as TorchRec
    with pytest.raises(BinaryDataError, match=r"day_9_sparse.npy: row 4 holds \[-3, 0, .*\(ids 0 .. table rows - 1"):
        batches(config([_day(tmp_path, ids)], "data.npy.ids=contiguous"))
    labels = np.full((20, 1), -1, np.int32)  # TorchRec's filler label of Kaggle's test set
    with pytest.raises(BinaryDataError, match=r"day_9_labels.npy: row 0 holds \[-1\], outside the valid range \(labels 0 or 1"):
        batches(config([_day(tmp_path, np.zeros((20, 26), np.int64), labels=labels)]))
    dense = np.ones((20, 13), np.float32)
    dense[9, 2] = np.nan
    with pytest.raises(BinaryDataError, match=r"day_9_dense.npy: row 9 holds .*finite dense values"):
        batches(config([_day(tmp_path, np.zeros((20, 26), np.int64), dense=dense)]))
    prefix = _day(tmp_path, np.zeros((20, 26), np.int64), dense=np.ones((20, 12), np.float32))
    with pytest.raises(BinaryDataError, match=r"day_9_dense.npy: shape \[20, 12\], expected \[rows, 13\]"):
        batches(config([prefix]))
    prefix = _day(tmp_path, np.zeros((19, 26), np.int64))
    np.save(f"{prefix}_labels.npy", np.zeros(20, np.int32))  # 1-D labels are fine, a different count is not
    with pytest.raises(BinaryDataError, match=r"data.npy.train: the files of day .*day_9' have different row counts: "
                                              r"\{'dense': 19, 'labels': 20, 'sparse': 19\}"):
        batches(config([prefix]))
    np.save(f"{prefix}_sparse.npy", np.asfortranarray(np.zeros((20, 26), np.int64)))
    with pytest.raises(BinaryDataError, match="Fortran-order"):
        batches(config([prefix]))
    Path(f"{prefix}_sparse.npy").unlink()
    # recpipe train checks the days before any process starts.
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"# test\nmodel: {{num_embeddings_per_feature: {SIZES}}}\n"
                        f"data: {{source: criteo_npy, npy: {{train: [{prefix}]}}}}\ntrain: {{device: cpu}}\n")
    assert main(["train", "--config", str(cfg_file)]) == EXIT_BAD_DATA
    assert f"{prefix}_sparse.npy: no such file" in capsys.readouterr().err


def test_config_rules_and_no_eval_message(days):
    from recpipe.data import no_eval_data

    with pytest.raises(ConfigError, match=r"data.npy.train is empty but data.source='criteo_npy'"):
        load_config(None, ["data.source=criteo_npy"])
    with pytest.raises(ConfigError, match=r"data.npy.sparse_suffix"):
        load_config(None, ["data.source=criteo_npy", "data.npy.train=[x]", "data.npy.sparse_suffix=_sparse.bin"])
    cfg = config(days["prefixes"])
    assert num_batches(cfg, rank=0, world_size=1, split="eval") == 0
    assert no_eval_data(cfg.data) == "data.npy.eval is empty"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["process", "thread"])
def test_cuda_batches_are_pinned_and_copy_exactly(tmp_path, kind):
    rng = np.random.default_rng(1)  # numpy only: no torchrec dataset tooling needed on the GPU machine
    prefix = _day(tmp_path, rng.integers(0, 2**32, (200, 26), dtype=np.int64), rng.integers(0, 2, (200, 1), dtype=np.int32),
                  rng.random((200, 13), dtype=np.float32))
    pinned_cfg = config([prefix], "data.num_workers=2", f"data.workers_kind={kind}", "data.pin_memory=true",
                        "data.shuffle=true", "data.shuffle_block_rows=8")
    plain = config([prefix], "data.pin_memory=false", "data.shuffle=true", "data.shuffle_block_rows=8")
    torch.cuda._sleep(1_000_000_000)  # the copies wait behind a long kernel while each pinned batch is dropped
    on_gpu = []
    for pinned in make_dataloader(pinned_cfg, rank=0, world_size=1, split="train"):
        assert pinned.dense_features.is_pinned() and pinned.sparse_features.values().is_pinned()
        on_gpu.append(pinned.to(torch.device("cuda"), non_blocking=True))
    torch.cuda.synchronize()
    want = batches(plain)
    assert len(on_gpu) == len(want)
    for got, ref in zip(on_gpu, want):
        got = got.to(torch.device("cpu"))
        assert torch.equal(got.dense_features, ref.dense_features) and torch.equal(got.labels, ref.labels)
        assert torch.equal(got.sparse_features.values(), ref.sparse_features.values())


def test_trainer_trains_and_evaluates_on_npy_days(days, tmp_path):
    """The trainer end to end on one rank (in this process): TorchRec's days as train and eval data."""
    import json

    import torch.distributed as dist

    from recpipe.train.trainer import Trainer

    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [
        f"model.num_embeddings_per_feature={SIZES}", "data.source=criteo_npy", f"data.npy.train=[{days['prefixes'][0]}]",
        f"data.npy.eval=[{days['prefixes'][1]}]", "data.batch_size=32", "data.num_workers=1", "data.shuffle=true",
        "distributed.nproc=1", "train.steps=6", "train.eval_every=3", "train.log_every=3", "train.progress=false",
        f"logging.run_dir={tmp_path / 'run'}", "logging.tensorboard=false", "sharding.tables={}",
    ])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        Trainer(cfg, torch.device("cpu")).fit()
    finally:
        dist.destroy_process_group()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 5  # 150 rows: 5 batches of 32, one epoch
    assert summary["eval_auc"] is not None and summary["samples"] == 5 * 32


def test_modulo_keeps_ids_inside_their_tables_and_divides_the_others_exactly():
    """``data.npy.ids: modulo`` is numpy's ``%`` on every id, whichever way it is computed."""
    from recpipe.data.criteo_npy import _modulo

    rng = np.random.default_rng(0)
    rows = np.array(SIZES, dtype=np.int64)
    inside = rng.integers(0, min(SIZES), (64, 26), dtype=np.int32)
    assert _modulo(inside, rows) is inside  # nothing to divide: the ids as they are
    for dtype in (np.int32, np.int64):
        raw = rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, (64, 26), dtype=dtype, endpoint=True)
        raw[0] = np.iinfo(dtype).min
        got = _modulo(raw, rows)
        assert np.array_equal(got, raw.astype(np.int64) % rows) and got.min() >= 0 and (got < rows).all()
    member = rng.integers(-5, 3 * SIZES[4], (64, 7), dtype=np.int32)  # one multi-hot member, one table
    assert np.array_equal(_modulo(member, rows[4]), member.astype(np.int64) % SIZES[4])
    big = np.array([[2**40 + 3]], dtype=np.int64)  # a table beyond int32: int64 division
    assert _modulo(np.array([[-1]], dtype=np.int32), np.int64(2**33))[0, 0] == 2**33 - 1
    assert _modulo(big, np.int64(7))[0, 0] == (2**40 + 3) % 7


def test_one_hot_ids_as_one_array_build_the_batch_of_per_feature_columns():
    """One [n, F] array of one id per feature (the one-hot ``.npy`` file) gives the batch
    that F single columns give, padding included."""
    from recpipe.data.columns import ColumnLayout

    rng = np.random.default_rng(1)
    keys = [f"cat_{f}" for f in range(26)]
    layout = ColumnLayout(keys, [1] * 26, 13)
    ids = rng.integers(0, 1000, (10, 26), dtype=np.int32)
    labels, dense = rng.integers(0, 2, 10), rng.random((10, 13), dtype=np.float32)
    for n in (10, 7, 0):
        one = layout.build(labels, dense, ids, n, 12, log1p=False)
        columns = layout.build(labels, dense, [ids[:, f : f + 1] for f in range(26)], n, 12, log1p=False)
        assert torch.equal(one.sparse_features.values(), columns.sparse_features.values())
        assert torch.equal(one.sparse_features.lengths(), columns.sparse_features.lengths())
        assert one.sparse_features.values().view(26, 12)[:, :n].tolist() == ids[:n].T.tolist()
        assert one.sparse_features.values().view(26, 12)[:, n:].eq(0).all()
