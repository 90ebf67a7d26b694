"""Data layer: synthetic log, Criteo TSV reader, DataLoader ordering (CPU, fast)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchmetrics.functional import auroc

from recpipe.config import load_config, parse_overrides
from recpipe.data import Batch, make_dataloader, num_batches
from recpipe.data.synthetic import SyntheticClickLog
from recpipe.data.spec import DataSpec

ROWS = [50, 1000, 7, 20000]


def small_cfg(*overrides: str, rows: list[int] = ROWS):
    return load_config(
        None,
        [
            f"model.num_embeddings_per_feature={rows}",
            "data.batch_size=64",
            "data.num_workers=0",
            "data.synthetic.num_batches=5",
            *overrides,
        ],
    )


def batches(cfg, *, rank=0, world_size=1, split="train", epoch=0, start_batch=0) -> list[Batch]:
    loader = make_dataloader(cfg, rank=rank, world_size=world_size, split=split, epoch=epoch, start_batch=start_batch)
    return list(loader)


def same(a: Batch, b: Batch) -> bool:
    return (
        torch.equal(a.dense_features, b.dense_features)
        and a.sparse_features.keys() == b.sparse_features.keys()
        and torch.equal(a.sparse_features.values(), b.sparse_features.values())
        and torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())
        and torch.equal(a.labels, b.labels)
        and torch.equal(a.weights, b.weights)
    )


def same_seq(xs: list[Batch], ys: list[Batch]) -> bool:
    return len(xs) == len(ys) and all(same(x, y) for x, y in zip(xs, ys))


# ------------------------------------------------------------------ synthetic
def test_synthetic_shapes_dtypes_ranges():
    cfg = small_cfg("data.synthetic.mean_pooling_factors=[1.0, 2.0, 1.5, 3.0]")
    got = batches(cfg)
    assert len(got) == 5 == num_batches(cfg, rank=0, world_size=1, split="train")
    for b in got:
        assert b.dense_features.shape == (64, 13) and b.dense_features.dtype == torch.float32
        assert b.labels.shape == (64,) and b.labels.dtype == torch.float32
        assert torch.equal(b.weights, torch.ones(64))
        assert set(b.labels.unique().tolist()) <= {0.0, 1.0}
        assert torch.isfinite(b.dense_features).all() and (b.dense_features >= 0).all()
        kjt = b.sparse_features
        assert kjt.keys() == ["cat_0", "cat_1", "cat_2", "cat_3"]
        assert kjt.values().dtype == torch.int64 and kjt.lengths().dtype == torch.int32
        assert kjt.lengths().numel() == 4 * 64 and (kjt.lengths() >= 1).all()
        # made with its ids per key (torchrec would read them back from the device otherwise)
        assert kjt._length_per_key == kjt.lengths().view(4, 64).sum(dim=1).tolist() and kjt.stride() == 64
        for key, rows in zip(kjt.keys(), ROWS):
            ids = kjt[key].values()
            assert ids.min() >= 0 and ids.max() < rows


def test_synthetic_determinism_per_seed_rank_epoch_split():
    cfg = small_cfg("distributed.nproc=2")
    ref = batches(cfg, world_size=2)
    assert same_seq(ref, batches(cfg, world_size=2))
    assert not same(ref[0], batches(cfg, rank=1, world_size=2)[0])
    assert not same(ref[0], batches(small_cfg("distributed.nproc=2", "train.seed=1"), world_size=2)[0])
    assert not same(ref[0], batches(cfg, world_size=2, epoch=1)[0])
    assert not same(ref[0], batches(cfg, world_size=2, split="eval")[0])
    # One fixed eval set: the epoch does not change it.
    assert same_seq(batches(cfg, split="eval", world_size=2), batches(cfg, split="eval", world_size=2, epoch=3))


def test_synthetic_batch_k_direct_equals_iteration():
    cfg = small_cfg()
    full = batches(cfg, epoch=2)
    log = SyntheticClickLog(DataSpec.from_config(cfg))
    assert same(log.batch(rank=0, split="train", epoch=2, index=3), full[3])
    assert same_seq(batches(cfg, epoch=2, start_batch=3), full[3:])
    assert batches(cfg, start_batch=9) == []


@pytest.mark.parametrize("start_batch", [0, 2])
def test_synthetic_workers_preserve_order(start_batch):
    cfg = small_cfg()
    ref = batches(cfg, start_batch=start_batch)
    with_workers = batches(small_cfg("data.num_workers=2"), start_batch=start_batch)
    assert len(ref) == 5 - start_batch
    assert same_seq(ref, with_workers)


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_synthetic_producers_make_the_inline_batches_bit_for_bit(kind):
    pooling = "data.synthetic.mean_pooling_factors=[1.0, 2.0, 1.5, 3.0]"  # batches of different sizes
    ref = batches(small_cfg(pooling, "data.synthetic.num_batches=7"), start_batch=1)
    got = batches(small_cfg(pooling, "data.synthetic.num_batches=7", "data.num_workers=3", f"data.workers_kind={kind}"),
                  start_batch=1)
    assert len(ref) == 6 and same_seq(ref, got)
    for a, b in zip(ref, got):
        assert [t.dtype for t in (a.dense_features, a.labels, a.weights)] == [t.dtype for t in (b.dense_features, b.labels, b.weights)]
        ka, kb = a.sparse_features, b.sparse_features
        assert (ka.values().dtype, ka.lengths().dtype, ka.stride()) == (kb.values().dtype, kb.lengths().dtype, kb.stride())



@pytest.mark.parametrize("workers", ["0", "2-process", "3-thread"])
def test_a_loader_spanning_epochs_gives_each_epochs_batches_in_turn(workers):
    """make_dataloader(epochs=3) from (epoch 1, batch 2): epoch 1's batches 2.. then epochs 2
    and 3 whole, bit for bit as a loader per epoch gives them; epoch_batches splits it."""
    from recpipe.data.loader import epoch_batches

    count, _, kind = workers.partition("-")
    cfg = small_cfg("data.synthetic.num_batches=4", f"data.num_workers={count}",
                    *([f"data.workers_kind={kind}"] if kind else []))
    per_epoch = [batches(cfg, epoch=1, start_batch=2), batches(cfg, epoch=2), batches(cfg, epoch=3)]
    spanning = make_dataloader(cfg, rank=0, world_size=1, split="train", epoch=1, start_batch=2, epochs=3)
    assert len(spanning) == 10
    split = epoch_batches(spanning, 2, 4)
    for want in per_epoch:
        assert same_seq(list(next(split)), want)
    assert list(next(split)) == []  # after the last epoch: nothing
    assert not same_seq(per_epoch[1], per_epoch[2])  # each epoch its own batches



def test_a_loader_spanning_epochs_starts_where_its_first_epoch_is_read():
    """The trainer reports a loader's failure to start where it reads the batches (``data_errors``):
    taking the first epoch's iterator does not start it."""
    from recpipe.data.loader import epoch_batches

    class Unstartable:
        def __iter__(self):
            raise OSError("no such file: day_0_dense.npy")

    first = next(epoch_batches(Unstartable(), 2, 4))
    with pytest.raises(OSError, match="day_0_dense.npy"):
        next(first)

def test_a_loader_per_epoch_for_a_source_that_cannot_span_them(tmp_path):
    cfg = tsv_cfg([tmp_path / "day_0.tsv"])
    with pytest.raises(ValueError, match="data.source='criteo_tsv' makes one loader per epoch"):
        make_dataloader(cfg, rank=0, world_size=1, split="train", epochs=2)

def test_synthetic_batch_counts_per_rank_and_eval():
    cfg = small_cfg("distributed.nproc=3", "data.synthetic.num_batches_per_rank=[2, 4, 3]", "data.synthetic.num_eval_batches=2")
    for rank, n in enumerate([2, 4, 3]):
        assert num_batches(cfg, rank=rank, world_size=3, split="train") == n
        assert len(batches(cfg, rank=rank, world_size=3)) == n
    assert num_batches(cfg, rank=1, world_size=3, split="eval") == 2
    with pytest.raises(ValueError, match="rank 3"):
        make_dataloader(cfg, rank=3, world_size=3, split="train")


def _id_counts(alpha: float, rows: int = 10000) -> torch.Tensor:
    cfg = small_cfg(f"data.synthetic.zipf_alpha={alpha}", "data.batch_size=4096", rows=[rows])
    b = SyntheticClickLog(DataSpec.from_config(cfg)).batch(rank=0, split="train", epoch=0, index=0)
    return torch.bincount(b.sparse_features.values(), minlength=rows)


def test_zipf_skew_and_uniform():
    skewed = _id_counts(1.2)
    top10 = skewed.topk(10).values.sum().item() / skewed.sum().item()
    assert top10 > 0.3  # uniform would give 10 / 10000
    # Discrete Zipf(1.2) over 10^4 ranks puts ~19% on rank 0 (1 / sum k^-1.2).
    assert 0.15 < skewed.max().item() / skewed.sum().item() < 0.23
    # Hot ids are spread over the table, not packed at its start.
    hot = skewed.topk(10).indices
    assert hot.max() - hot.min() > 1000
    uniform = _id_counts(0.0)
    assert uniform.max().item() < 8 and (uniform > 0).float().mean() > 0.3


def test_mean_pooling_factors():
    factors = [1.0, 2.5, 5.0, 1.5]
    cfg = small_cfg(f"data.synthetic.mean_pooling_factors={factors}", "data.batch_size=2048")
    lengths = SyntheticClickLog(DataSpec.from_config(cfg)).batch(rank=0, split="train", epoch=0, index=0).sparse_features.lengths()
    means = lengths.view(4, -1).float().mean(dim=1)
    assert torch.allclose(means, torch.tensor(factors), atol=0.15)
    assert (lengths.view(4, -1)[0] == 1).all()
    one_hot = SyntheticClickLog(DataSpec.from_config(small_cfg("data.synthetic.mean_pooling_factors=1.0"))).batch(
        rank=0, split="train", epoch=0, index=0).sparse_features
    assert one_hot._length_per_key == [64] * 4 == one_hot.lengths().view(4, -1).sum(dim=1).tolist()


def test_planted_model_positive_rate_and_auc():
    cfg = small_cfg("data.batch_size=1024", "data.synthetic.num_eval_batches=4")
    log = SyntheticClickLog(DataSpec.from_config(cfg))
    evals = batches(cfg, split="eval")
    labels = torch.cat([b.labels for b in evals])
    logits = torch.cat([log.planted_logits(b.dense_features, b.sparse_features) for b in evals])
    assert 0.25 < labels.mean().item() < 0.35
    assert auroc(logits.float(), labels.long(), task="binary").item() > 0.75
    # The same planted model on every rank: rank 1's labels follow it just as well.
    r1 = log.batch(rank=1, split="train", epoch=0, index=0)
    r1_logits = log.planted_logits(r1.dense_features, r1.sparse_features).float()
    assert auroc(r1_logits, r1.labels.long(), task="binary").item() > 0.75


def test_dlrm_learns_planted_model():
    from recpipe.models.dlrm import build_model

    torch.manual_seed(0)
    cfg = small_cfg("data.batch_size=256", "data.synthetic.num_batches=60", "data.synthetic.num_eval_batches=4")
    model = build_model(cfg.model, torch.device("cpu"))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    for b in batches(cfg):
        loss, _ = model(b)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        outs = [model(b)[1] for b in batches(cfg, split="eval")]
    logits, labels = torch.cat([o[1] for o in outs]), torch.cat([o[2] for o in outs])
    assert auroc(logits, labels.long(), task="binary").item() > 0.65


# ------------------------------------------------------------------ Criteo TSV
ROWS26 = [10] * 25 + [1]


def tsv_line(label: int, dense: list[str], cats: list[str]) -> str:
    return "\t".join([str(label), *dense, *cats]) + "\n"


def numbered_line(n: int) -> str:
    """A valid line whose first dense column is ``n`` (to identify it after parsing)."""
    return tsv_line(n % 2, [str(n)] + ["1"] * 12, [format(n, "x")] * 26)


def tsv_cfg(train: list, *overrides: str, batch_size: int = 4, eval_files: list | None = None):
    return load_config(
        None,
        {
            "model.num_embeddings_per_feature": ROWS26,
            "data.source": "criteo_tsv",
            "data.batch_size": batch_size,
            "data.num_workers": 0,
            "data.criteo.train_files": [str(p) for p in train],
            "data.criteo.eval_files": [str(p) for p in eval_files or []],
            **parse_overrides(list(overrides)),  # read as --set reads them
        },
    )


def test_tsv_parsing_empty_fields_and_hashing(tmp_path):
    path = tmp_path / "day_0.tsv"
    dense = ["", "-1", "-2", "0", "3", "1000000"] + ["7"] * 7
    cats = ["", "ff", "0a", "FFFFFFFF"] + ["1"] * 22
    path.write_text(tsv_line(1, dense, cats) + tsv_line(0, ["2"] * 13, ["b"] * 26).replace("\n", "\r\n"))
    (b,) = batches(tsv_cfg([path]))
    assert b.labels.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert b.weights.tolist() == [1.0, 1.0, 0.0, 0.0]
    expected = torch.log1p(torch.tensor([0, 0, 0, 0, 3, 1000000] + [7] * 7, dtype=torch.float64)).float()
    assert torch.equal(b.dense_features[0], expected)
    assert torch.equal(b.dense_features[1], torch.full((13,), 2.0).log1p())
    kjt = b.sparse_features
    assert (kjt.lengths() == 1).all() and kjt.keys()[25] == "cat_25"
    # Empty -> reserved id 0; hex v -> 1 + v mod (rows - 1) (rows=10); one-row table -> 0.
    assert kjt["cat_0"].values()[0] == 0
    assert kjt["cat_1"].values()[0] == 1 + 0xFF % 9
    assert kjt["cat_2"].values()[0] == 1 + 0x0A % 9
    assert kjt["cat_3"].values()[0] == 1 + 0xFFFFFFFF % 9
    assert kjt["cat_0"].values()[1] == 1 + 0xB % 9
    assert (kjt["cat_25"].values() == 0).all()
    for key, rows in zip(kjt.keys(), ROWS26):
        assert 0 <= kjt[key].values().min() and kjt[key].values().max() < rows


GOOD = tsv_line(0, ["1"] * 13, ["a"] * 26)


@pytest.mark.parametrize(
    "bad, what",
    [
        (tsv_line(0, ["1"] * 13, ["a"] * 25), "expected 40 tab-separated columns .*got 39"),
        ("\n", "expected 40 tab-separated columns .*got 1"),
        (tsv_line(2, ["1"] * 13, ["a"] * 26), "label must be 0 or 1"),
        (tsv_line(0, ["1"] * 5 + ["1.5"] + ["1"] * 7, ["a"] * 26), "dense column 5 .* not an integer: '1.5'"),
        (tsv_line(1, ["1"] * 13, ["a"] * 3 + ["xyz"] + ["a"] * 22), "categorical column 3 .* not hex: 'xyz'"),
        (tsv_line(1, ["1"] * 13, ["-a"] + ["a"] * 25), "categorical column 0 .* not hex"),
    ],
    ids=["39-columns", "blank", "label-2", "dense-float", "cat-not-hex", "cat-signed"],
)
def test_tsv_malformed_line_reports_file_and_line(tmp_path, bad, what):
    good = tmp_path / "good.tsv"
    good.write_text(GOOD * 3)
    path = tmp_path / "part_7.tsv"
    path.write_text(GOOD * 2 + bad + GOOD)
    with pytest.raises(ValueError, match=rf"part_7\.tsv:3: {what}"):
        batches(tsv_cfg([good, path]))


def test_tsv_rank_split_disjoint_covering_padded(tmp_path):
    files = [tmp_path / "a.tsv", tmp_path / "b.tsv"]
    files[0].write_text("".join(numbered_line(n) for n in range(13)))
    files[1].write_text("".join(numbered_line(n) for n in range(13, 23)))
    cfg = tsv_cfg(files, "distributed.nproc=3")
    seen = []
    for rank in range(3):
        assert num_batches(cfg, rank=rank, world_size=3, split="train") is None
        got = batches(cfg, rank=rank, world_size=3)
        # 23 lines, global chunks of 3 ranks x 4: every rank has ceil(23 / 12) = 2 batches.
        assert len(got) == 2 and all(b.batch_size == 4 for b in got)
        for i, b in enumerate(got):
            real = b.weights.bool()
            ids = b.dense_features[real, 0].double().expm1().round().long().tolist()
            assert ids == [n for n in range((i * 3 + rank) * 4, (i * 3 + rank + 1) * 4) if n < 23]
            seen += ids
            pad = ~real
            assert (b.labels[pad] == 0).all() and (b.dense_features[pad] == 0).all()
    assert sorted(seen) == list(range(23))
    # Rank 2's last batch is lines 20..23: line 23 does not exist -> one padding sample;
    # the padding (weight 0) is what keeps every rank at full batches.
    assert batches(cfg, rank=2, world_size=3)[1].weights.tolist() == [1.0, 1.0, 1.0, 0.0]


def test_tsv_resume_and_workers(tmp_path):
    path = tmp_path / "day.tsv"
    path.write_text("".join(numbered_line(n) for n in range(37)))
    cfg = tsv_cfg([path], "distributed.nproc=2", batch_size=3)
    full = batches(cfg, rank=1, world_size=2)
    assert len(full) == 7  # ceil(37 / 6)
    assert same_seq(batches(cfg, rank=1, world_size=2, start_batch=4), full[4:])
    assert batches(cfg, rank=1, world_size=2, start_batch=7) == []
    workers = tsv_cfg([path], "distributed.nproc=2", "data.num_workers=2", batch_size=3)
    assert same_seq(batches(workers, rank=1, world_size=2, start_batch=1), full[1:])


def test_workers_kind_is_ignored_with_a_warning_where_it_does_not_apply(tmp_path):
    with pytest.warns(UserWarning, match="data.workers_kind='thread' is ignored: data.num_workers=0 makes"):
        assert len(batches(small_cfg("data.workers_kind=thread"))) == 5
    path = tmp_path / "day.tsv"
    path.write_text("".join(numbered_line(n) for n in range(8)))
    with pytest.warns(UserWarning, match="data.workers_kind='process' is ignored: criteo_tsv always parses"):
        assert len(batches(tsv_cfg([path], "data.num_workers=1", "data.workers_kind=process"))) == 2


def test_uvm_tables_make_the_producers_threads():
    """A forked producer would get a copy of the UVM tables' pinned host memory."""
    from recpipe.data.loader import workers_kind_of

    uvm = ["train.device=cuda", "data.num_workers=2", "sharding.tables.t_cat_0.kernel=fused_uvm",
           "sharding.tables.t_cat_1.kernel=fused_uvm_caching"]
    from recpipe.data.stream import PROCESSES_AVAILABLE

    plain = "process" if PROCESSES_AVAILABLE else "thread"  # threads where fork or memfd is missing
    assert workers_kind_of(small_cfg("train.device=cuda", "data.num_workers=2")) == plain
    assert workers_kind_of(small_cfg(*uvm)) == "thread"
    with pytest.warns(UserWarning, match="data.workers_kind='process' is replaced by 'thread': tables t_cat_0, t_cat_1 are in UVM"):
        assert workers_kind_of(small_cfg(*uvm, "data.workers_kind=process")) == "thread"


def test_tsv_workers_are_spawned_not_forked_with_uvm_tables(tmp_path):
    """Same batches from spawned workers (a fork would copy the UVM tables' pinned memory)."""
    path = tmp_path / "day.tsv"
    path.write_text("".join(numbered_line(n) for n in range(8)))
    plain = tsv_cfg([path], "data.num_workers=1")
    uvm = tsv_cfg([path], "data.num_workers=1", "train.device=cuda", "sharding.tables.t_cat_0.kernel=fused_uvm")
    from recpipe.data import make_dataloader

    assert make_dataloader(uvm, rank=0, world_size=1, split="train").multiprocessing_context.get_start_method() == "spawn"
    assert same_seq(batches(uvm), batches(plain))


def test_tsv_eval_split(tmp_path):
    path = tmp_path / "day.tsv"
    path.write_text("".join(numbered_line(n) for n in range(5)))
    cfg = tsv_cfg([path])
    assert num_batches(cfg, rank=0, world_size=1, split="eval") == 0
    assert batches(cfg, split="eval") == []
    with_eval = tsv_cfg([path], eval_files=[path])
    assert same_seq(batches(with_eval, split="eval"), batches(with_eval))


# ------------------------------------------------- synthetic: the numpy pieces equal torch's
def test_rounded_power_rounds_as_torchs_power_also_at_rounding_boundaries():
    """numpy's power differs from torch's in the last bit for most values; the ranks may not."""
    from recpipe.data.synthetic import _rounded_power, _zipf_scale

    alpha = 1.05
    b = 1.0 - alpha
    c, e = 0.5**b, 1.0 / b
    rows = torch.tensor([10.0, 1e5, 1e7], dtype=torch.float64)
    scale = _zipf_scale(rows, alpha).unsqueeze(1)
    torch_ranks = lambda u: torch.floor((c + u * scale) ** e + 0.5).long()  # noqa: E731  (the formula's own)
    u = torch.rand(3, 50_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.equal(_rounded_power(u, scale, c, e), torch_ranks(u))
    # u whose power lies within a few ulp of k + 0.5 for many k: where numpy's power rounds
    # the other way, torch's must decide.
    k = torch.linspace(1.0, 9.0, 3, dtype=torch.float64).unsqueeze(1) * torch.logspace(0, 6, 4000, dtype=torch.float64)
    k = torch.minimum(k.floor() + 1, rows.unsqueeze(1) - 1)
    steps = 1.0 + torch.arange(-6, 7, dtype=torch.float64).repeat_interleave(k.shape[1]) * torch.finfo(torch.float64).eps
    near = ((k - 0.5).repeat(1, 13) ** (1.0 / e) * steps - c) / scale
    numpy_ranks = torch.from_numpy(np.floor(np.power((c + near * scale).numpy(), e) + 0.5).astype(np.int64))
    assert not torch.equal(numpy_ranks, torch_ranks(near))  # the case exists here ...
    assert torch.equal(_rounded_power(near, scale, c, e), torch_ranks(near))  # ... and is handled


def test_hash_unit_is_splitmix64():
    """The planted model's id hash, in numpy's uint64, against splitmix64 in Python integers."""
    from recpipe.data.synthetic import _hash_unit

    def splitmix(key: int, i: int) -> float:
        m = 2**64 - 1
        z = (key + i * 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return ((z ^ (z >> 31)) >> 11) * 2.0**-53

    ids = np.array([[0, 1, 2**40 + 7], [5, 2**62, 123456789]], dtype=np.int64)
    keys = np.array([[-(2**63) + 3], [2**62 + 11]], dtype=np.int64)
    want = [[splitmix(int(k) % 2**64, int(i)) for i in row] for k, row in zip(keys[:, 0], ids)]
    assert _hash_unit(ids, keys).tolist() == want
