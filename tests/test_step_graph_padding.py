"""``pad_features`` (recpipe.speedups.step_graph) against the per-key, per-bucket loop it
computes all at once (``reference_pad_features``, kept in the study that times the two,
benchmarks/studies/step_graph_padding.py): the same values, lengths, weights, stride, ids
per key, and None, on many random batches."""

from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from benchmarks.studies.step_graph_padding import reference_pad_features
from recpipe.speedups.fixed_splits import Buckets
from recpipe.speedups.step_graph import pad_features


def _same(got, want):
    if want is None:
        assert got is None
        return
    assert got is not None
    assert got.keys() == want.keys() and got.stride() == want.stride()
    assert got.length_per_key() == want.length_per_key()
    for a, b in ((got.values(), want.values()), (got.lengths(), want.lengths())):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if want.weights_or_none() is None:
        assert got.weights_or_none() is None
    else:
        assert got.weights().dtype == want.weights().dtype and torch.equal(got.weights(), want.weights())


def _random_case(g: torch.Generator):
    """A random KJT with its capacities and buckets: some keys empty, some bucketed (some of
    their buckets without table rows, some without ids), capacities below, at and above."""
    keys = int(torch.randint(1, 6, (1,), generator=g))
    stride = int(torch.randint(1, 7, (1,), generator=g))
    dtype = [torch.int32, torch.int64][int(torch.randint(0, 2, (1,), generator=g))]
    lengths, values, capacity, buckets = [], [], [], []
    for _ in range(keys):
        rows = int(torch.randint(1, 40, (1,), generator=g))
        key_lengths = torch.randint(0, 4, (stride,), generator=g) * int(torch.rand(1, generator=g) > 0.2)
        n = int(key_lengths.sum())
        high = rows if torch.rand(1, generator=g) > 0.3 else max(1, rows // 4)  # some buckets get no ids
        ids = torch.randint(0, high, (n,), generator=g)
        lengths.append(key_lengths)
        values.append(ids)
        slack = lambda: int(torch.randint(-1, 4, (1,), generator=g))  # noqa: E731 (-1: over capacity)
        if torch.rand(1, generator=g) < 0.6:
            # ceil(rows / count) rows a bucket: with count near rows, the last buckets hold none
            b = Buckets.of_table(rows, int(torch.randint(2, 6, (1,), generator=g)))
            held = b.counts(ids)
            cap = [0 if b.first_row(r) is None else max(0, h + slack()) for r, h in enumerate(held)]
            buckets.append(b)
            capacity.append(cap)
        else:
            buckets.append(None)
            capacity.append(max(0, n + slack()) if torch.rand(1, generator=g) < 0.5 else [max(0, n + slack())])
    weights = None
    if torch.rand(1, generator=g) < 0.5:
        weights = torch.rand(sum(len(v) for v in values), generator=g)
    kjt = KeyedJaggedTensor(keys=[f"f{k}" for k in range(keys)], values=torch.cat(values).to(dtype),
                            lengths=torch.cat(lengths).to(torch.int32), weights=weights)
    if all(b is None for b in buckets) and torch.rand(1, generator=g) < 0.5:
        buckets = None  # no buckets given at all
    return kjt, capacity, buckets


@pytest.mark.parametrize("seed", range(8))
def test_pad_features_equals_the_per_key_loop(seed):
    g = torch.Generator().manual_seed(seed)
    seen = {"none": 0, "padded": 0}
    for _ in range(150):
        kjt, capacity, buckets = _random_case(g)
        want = reference_pad_features(kjt, capacity, buckets)
        _same(pad_features(kjt, capacity, buckets), want)
        seen["none" if want is None else "padded"] += 1
    assert seen["none"] > 10 and seen["padded"] > 10  # both outcomes drawn


def test_pad_features_edges():
    b = Buckets.of_table(10, 4)  # blocks of 3 rows: buckets 0..3 start at rows 0, 3, 6, 9
    assert b.first_row(3) == 9
    no_rows = Buckets.of_table(5, 4)  # blocks of 2: bucket 3 starts at row 6, past the table
    assert no_rows.first_row(3) is None
    cases = [
        # exactly full: nothing added, an empty padding bag per key
        (KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 4, 7, 9]), lengths=torch.tensor([1, 1, 1, 1])),
         [[1, 1, 0, 0], 2], [b, None]),
        # a key without ids: bucket first rows / row 0
        (KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([], dtype=torch.int64),
                           lengths=torch.tensor([0, 0, 0, 0])), [[2, 1, 1, 3], 3], [b, None]),
        # a bucket without table rows has capacity 0; one bucket over capacity: None
        (KeyedJaggedTensor(keys=["a"], values=torch.tensor([0, 1, 2]), lengths=torch.tensor([3])),
         [[2, 1, 1, 0]], [no_rows]),
        (KeyedJaggedTensor(keys=["a"], values=torch.tensor([0, 1, 2]), lengths=torch.tensor([3])),
         [[1, 2, 1, 0]], [no_rows]),
        # every bucket's padding from its own first ids
        (KeyedJaggedTensor(keys=["a"], values=torch.tensor([4, 0, 5, 1, 3]), lengths=torch.tensor([5])),
         [[3, 4, 0, 0]], [b]),
        # unbucketed only, no buckets given; cycling through fewer ids than the padding
        (KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([5, 6, 8], dtype=torch.int32),
                           lengths=torch.tensor([2, 0, 1, 0]), weights=torch.tensor([0.5, 1.5, 2.0])),
         [7, 4], None),
    ]
    outcomes = []
    for kjt, capacity, buckets in cases:
        want = reference_pad_features(kjt, capacity, buckets)
        _same(pad_features(kjt, capacity, buckets), want)
        outcomes.append(None if want is None else want.values().tolist())
    assert outcomes == [[1, 4, 7, 9], [0, 0, 3, 6, 9, 9, 9, 0, 0, 0], [0, 1, 2, 4], None, [4, 0, 5, 1, 3, 0, 4],
                        [5, 6, 5, 6, 5, 6, 5, 8, 8, 8, 8]]


def test_pad_features_refuses_capacity_in_a_bucket_without_rows():
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.tensor([0]), lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match="0 for a bucket without table rows"):
        pad_features(kjt, [[1, 1, 1, 1]], [Buckets.of_table(5, 4)])
