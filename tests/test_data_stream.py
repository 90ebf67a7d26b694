"""recpipe.data.stream: batches made by threads arrive in index order; errors and
abandoned iterators are handled."""

from __future__ import annotations

import gc
import time

import pytest

from recpipe.data.stream import BatchStream


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_order_is_the_index_order_whatever_the_threads(workers):
    def make(i):
        time.sleep(0.001 * (i % 3))  # finish out of order
        return i * i

    assert list(BatchStream(make, 2, 11, workers)) == [i * i for i in range(2, 11)]
    assert list(BatchStream(make, 5, 5, workers)) == []
    assert len(BatchStream(make, 2, 11, workers)) == 9


@pytest.mark.parametrize("workers", [0, 2])
def test_an_error_is_raised_at_its_batch(workers):
    def make(i):
        if i == 3:
            raise ValueError("batch 3 is broken")
        return i

    it = iter(BatchStream(make, 0, 10, workers))
    assert [next(it), next(it), next(it)] == [0, 1, 2]
    with pytest.raises(ValueError, match="batch 3 is broken"):
        next(it)


def test_an_abandoned_iterator_stops_its_threads():
    it = iter(BatchStream(lambda i: i, 0, 10_000, 2))
    assert next(it) == 0
    threads = list(it.producers.threads)
    del it
    gc.collect()
    for t in threads:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in threads)
